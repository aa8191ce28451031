"""Attention backends: padded, packed and cached attention all equal plain per-sequence forwards."""

import pytest
import torch

from helpers.hf_tiny import load_tiny_model
from tether.models import CausalAttention, ContiguousKVCache, PackedAttention

ATOL = 1e-4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_tiny_model(tmp_path_factory.mktemp("qwen3"), "qwen3", num_kv_heads=1)


@pytest.fixture(scope="module")
def windowed_model(tmp_path_factory):
    return load_tiny_model(tmp_path_factory.mktemp("mistral"), "mistral", sliding_window=3)


def random_ids(*lengths: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 100, (length,), generator=generator) for length in lengths]


@torch.no_grad()
def logits_alone(model, ids: torch.Tensor) -> torch.Tensor:
    return model.compute_logits(model(ids[None]))[0]  # [T, vocab]


@pytest.mark.parametrize("side", ["left", "right"])
@torch.no_grad()
def test_padded_batch_equals_unpadded_rows(model, side):
    rows = random_ids(5, 9, 2)
    width = max(len(row) for row in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    is_real = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, row in enumerate(rows):
        span = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        input_ids[b, span], is_real[b, span] = row, True
    positions = (is_real.long().cumsum(-1) - 1).clamp(min=0)  # 0 on each row's first real token
    logits = model.compute_logits(model(input_ids, positions, attn=CausalAttention(key_padding_mask=is_real)))
    assert torch.isfinite(logits).all()  # padded rows too: no NaN leaks out of all-masked queries
    for b, row in enumerate(rows):
        torch.testing.assert_close(logits[b][is_real[b]], logits_alone(model, row), atol=ATOL, rtol=0)


@torch.no_grad()
def test_packed_row_equals_separate_sequences(model):
    rows = random_ids(4, 7, 1, 5, seed=1)
    packed = PackedAttention(seq_lens=torch.tensor([len(row) for row in rows]))
    assert packed.positions().tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 0, 0, 1, 2, 3, 4]]
    logits = model.compute_logits(model(torch.cat(rows)[None], packed.positions(), attn=packed))[0]
    expected = torch.cat([logits_alone(model, row) for row in rows])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_packed_gradients_equal_separate_sequences(model):
    rows = random_ids(3, 6, seed=2)
    packed = PackedAttention([3, 6])
    model.zero_grad()
    hidden = model(torch.cat(rows)[None], packed.positions(), attn=packed)
    model.compute_logits(hidden).logsumexp(-1).sum().backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for row in rows:
        model.compute_logits(model(row[None])).logsumexp(-1).sum().backward()
    for packed_grad, param in zip(packed_grads, model.parameters()):
        torch.testing.assert_close(packed_grad, param.grad, atol=1e-4, rtol=1e-4)
    model.zero_grad()


def test_packed_rejects_a_row_of_the_wrong_length(model):
    with pytest.raises(ValueError, match="packed q"):
        model(torch.ones(1, 5, dtype=torch.long), attn=PackedAttention([2, 2]))


@torch.no_grad()
def prefill_and_decode(model, prompts: list[torch.Tensor], num_steps: int, cache: ContiguousKVCache):
    """Greedy generation through the cache; returns the per-row logits of every step [B, steps, V]."""
    width = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    is_real = torch.zeros(len(prompts), width, dtype=torch.bool)
    for b, prompt in enumerate(prompts):
        input_ids[b, width - len(prompt) :], is_real[b, width - len(prompt) :] = prompt, True
    positions = (is_real.long().cumsum(-1) - 1).clamp(min=0)
    cache.set_padding(is_real)
    hidden = model(input_ids, positions, attn=cache)
    step_logits = [model.compute_logits(hidden[:, -1])]
    for step in range(num_steps - 1):
        next_ids = step_logits[-1].argmax(-1, keepdim=True)  # [B, 1]
        assert cache.next_positions().tolist() == (positions[:, -1:] + 1 + step).tolist()
        hidden = model(next_ids, cache.next_positions(), attn=cache)
        step_logits.append(model.compute_logits(hidden[:, -1]))
    return torch.stack(step_logits, dim=1)


@pytest.mark.parametrize("fixture", ["model", "windowed_model"])
@torch.no_grad()
def test_cache_prefill_then_decode_equals_full_forward(request, fixture):
    model = request.getfixturevalue(fixture)
    prompts = random_ids(3, 6, 1, seed=3)
    num_steps = 5
    cache = ContiguousKVCache.for_model(model.config, batch=3, max_len=6 + num_steps)
    if fixture == "windowed_model":
        assert cache.sliding_window == 3
    step_logits = prefill_and_decode(model, prompts, num_steps, cache)
    assert cache.num_filled == 6 + num_steps - 1
    for b, prompt in enumerate(prompts):
        sequence = torch.cat([prompt, step_logits[b, :-1].argmax(-1)])  # prompt + generated tokens
        expected = logits_alone(model, sequence)[len(prompt) - 1 :]
        torch.testing.assert_close(step_logits[b], expected, atol=ATOL, rtol=0)


def test_cache_overflow_and_reset(model):
    cache = ContiguousKVCache.for_model(model.config, batch=1, max_len=4)
    with torch.no_grad():
        model(torch.ones(1, 4, dtype=torch.long), attn=cache)
        with pytest.raises(ValueError, match="overflow"):
            model(torch.ones(1, 1, dtype=torch.long), attn=cache)
        cache.reset()
        assert cache.num_filled == 0
        model(torch.ones(1, 2, dtype=torch.long), attn=cache)
    assert cache.num_filled == 2 and cache.is_real[0].tolist() == [True, True, False, False]


@torch.no_grad()
def test_sliding_window_mask_by_hand():
    # one head, D=1, q=k=1: every visible key gets equal weight, so the output is the mean of visible v
    q = torch.ones(1, 5, 1, 1)
    v = torch.arange(5, dtype=torch.float32).view(1, 5, 1, 1)
    out = CausalAttention(sliding_window=2).attend(0, q, q, v)
    assert out.flatten().tolist() == [0.0, 0.5, 1.5, 2.5, 3.5]
    unwindowed_layer = CausalAttention(sliding_window=2, sliding_window_layers=(1,)).attend(0, q, q, v)
    assert unwindowed_layer.flatten().tolist() == [0.0, 0.5, 1.0, 1.5, 2.0]


def test_padded_queries_keep_one_visible_key():
    # Some SDPA kernels return NaN for a query row with every key masked, and NaN values at padded
    # slots would then leak into real rows through 0 * NaN: each padded query must see its own slot.
    is_real = torch.tensor([[False, False, True, True], [True, True, True, True]])
    mask = CausalAttention(key_padding_mask=is_real).mask_for(4, torch.device("cpu"))
    assert mask.shape == (2, 1, 4, 4)
    assert mask.any(-1).all()
    assert mask[0, 0].tolist() == [
        [True, False, False, False],
        [False, True, False, False],
        [False, False, True, False],
        [False, False, True, True],
    ]


def test_masked_gqa_attention_on_cuda_repeats_keys_and_values_with_the_same_result_and_gradients():
    """CUDA's masked enable_gqa call would take the math path; the trainer repeats K and V per head."""
    from helpers.fake_cuda import FakeCuda
    from tether.models.attention import sdpa

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 7, 8, generator=gen, requires_grad=True)
    k = torch.randn(2, 2, 7, 8, generator=gen, requires_grad=True)
    v = torch.randn(2, 2, 7, 8, generator=gen, requires_grad=True)
    mask = torch.ones(7, 7, dtype=torch.bool).tril()[None, None].expand(2, 1, 7, 7)
    expected = sdpa(q, k, v, mask)
    expected.square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    fake = FakeCuda()
    with fake:
        leaves = [t.detach().to("cuda").requires_grad_() for t in (q, k, v)]
        out = sdpa(*leaves, mask.to("cuda"))
        out.square().sum().backward()
    assert not fake.errors
    torch.testing.assert_close(out.detach(), expected.detach(), atol=1e-5, rtol=1e-5)
    for leaf, grad in zip(leaves, grads):
        torch.testing.assert_close(leaf.grad, grad, atol=1e-5, rtol=1e-5)
