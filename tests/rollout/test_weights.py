from __future__ import annotations

import pytest
import torch

from tether.rollout.weights import SharedWeights, decoder_from_weights, plan_buckets


def named(seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [("a", torch.randn(3, 4, generator=gen)), ("b", torch.randn(5, generator=gen).to(torch.bfloat16)),
            ("c", torch.randn(2, 2, 2, generator=gen))]


def test_plan_buckets_packs_in_order_and_splits_at_the_budget():
    slots, sizes = plan_buckets([("a", (3, 4), torch.float32), ("b", (5,), torch.float32),
                                 ("c", (8,), torch.float32)], bucket_bytes=4 * 17)
    assert [(s.bucket, s.offset, s.numel) for s in slots] == [(0, 0, 12), (0, 12, 5), (1, 0, 8)]
    assert sizes == [17, 8]


def test_a_tensor_larger_than_a_bucket_goes_alone():
    _, sizes = plan_buckets([("a", (2,), torch.float32), ("b", (10,), torch.float32)], bucket_bytes=16)
    assert sizes == [2, 10]


def test_round_trip_is_bitwise_in_every_dtype_and_handshake_orders_versions():
    shared = SharedWeights(named(0), bucket_bytes=4 * 13)  # forces several buckets
    assert len(shared.buckets) == 2 and shared.has_unread and shared.published_version == 0
    views, version = shared.read()  # the values it was made from, as version 0
    initial = dict(views)
    assert version == 0 and all(torch.equal(initial[name], t) for name, t in named(0))
    shared.ack(0)
    assert not shared.has_unread
    for version in (1, 2):
        source = named(version)
        shared.write(source, version)
        assert shared.has_unread and shared.published_version == version
        views, read_version = shared.read()
        received = dict(views)
        assert read_version == version
        for name, tensor in source:
            assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor)
        shared.ack(version)
        assert not shared.has_unread


def test_writer_waits_for_the_previous_ack():
    shared = SharedWeights(named(0))
    with pytest.raises(TimeoutError):
        shared.write(named(1), 1, timeout_s=0.05)  # version 0, its initial values, not read yet
    shared.ack(0)
    shared.write(named(1), 1)
    with pytest.raises(TimeoutError):
        shared.write(named(2), 2, timeout_s=0.05)  # version 1 not acknowledged: never overwrite it
    with pytest.raises(RuntimeError, match="died"):
        shared.write(named(2), 2, is_reader_alive=lambda: False)
    views, _ = shared.read()
    assert torch.equal(dict(views)["a"], named(1)[0][1])  # still version 1, untorn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tied", [False, True])
def test_the_generator_process_model_is_built_from_the_initial_weights(tmp_path, dtype, tied):
    """No copy of the model travels to the generator process: it builds its own from version 0, in
    tensors of its own (not the buckets, which the trainer overwrites), tied as the trainer's."""
    from helpers.hf_tiny import load_tiny_model

    model = load_tiny_model(tmp_path, tie=tied).to(dtype)
    shared = SharedWeights(model.named_parameters(), bucket_bytes=4096)
    built = decoder_from_weights(model.config, shared)
    assert not shared.has_unread  # acknowledged: the trainer may publish version 1
    for (name, want), (_, got) in zip(model.state_dict().items(), built.state_dict().items(), strict=True):
        assert got.dtype == dtype and torch.equal(got, want) and not got.is_shared(), name
    assert (built.lm_head.weight is built.model.embed_tokens.weight) == tied
    ids = torch.tensor([[1, 5, 9, 2]])
    assert torch.equal(built(ids), model(ids))
    shared.write(((n, torch.zeros_like(t)) for n, t in model.named_parameters()), 1)
    assert torch.equal(built(ids), model(ids))  # the buckets changed, the built model did not
