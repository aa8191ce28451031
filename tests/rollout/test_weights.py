from __future__ import annotations

import pytest
import torch

from tether.rollout.weights import SharedWeights, plan_buckets


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
    assert len(shared.buckets) == 2 and not shared.has_unread
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
    shared.write(named(1), 1)
    with pytest.raises(TimeoutError):
        shared.write(named(2), 2, timeout_s=0.05)  # version 1 not acknowledged: never overwrite it
    with pytest.raises(RuntimeError, match="died"):
        shared.write(named(2), 2, is_reader_alive=lambda: False)
    views, _ = shared.read()
    assert torch.equal(dict(views)["a"], named(1)[0][1])  # still version 1, untorn
