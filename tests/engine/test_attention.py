import pytest
import torch

from tether.engine import native
from tether.engine.attention import PagedAttention, SeqSpan, _split_by_length, build_step_metadata
from tether.engine.kv_cache import KVCache

NUM_KV_HEADS, NUM_Q_HEADS, HEAD_DIM, BLOCK_SIZE = 2, 6, 8, 4


def reference(q, k, v, start, window):
    """q [n, Hq, D] at positions start.., k/v [start + n, Hkv, D] -> [n, Hq, D], plain softmax attention."""
    group = NUM_Q_HEADS // NUM_KV_HEADS
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM**0.5
    q_pos = torch.arange(start, start + q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= q_pos - k_pos < window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("is_native", [False, True])  # decode rows through the compiled kernel
@pytest.mark.parametrize("window", [None, 3])
def test_mixed_prefill_and_decode_step_matches_reference(window, is_native):
    torch.manual_seed(0)
    # (cached tokens, new tokens): decodes with short and long contexts, fresh and continued prefills
    layout = [
        (0, 5),
        (7, 1),
        (30, 1),
        (3, 1),
        (9, 4),
        (0, 1),
        (12, 1),
        (40, 1),
        (2, 1),
        (5, 1),
        (33, 1),
        (1, 1),
    ]
    num_blocks = 64
    cache = KVCache.allocate(
        1, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu")
    )
    free = (torch.randperm(num_blocks - 1) + 1).tolist()  # scattered blocks, as after a while of serving
    spans, full_k, full_v = [], [], []
    for cached, num_new in layout:
        total = cached + num_new
        table = [free.pop() for _ in range(-(-total // BLOCK_SIZE))]
        k, v = torch.randn(total, NUM_KV_HEADS, HEAD_DIM), torch.randn(total, NUM_KV_HEADS, HEAD_DIM)
        for pos in range(cached):  # what earlier steps wrote
            cache.k[0, table[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = k[pos]
            cache.v[0, table[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = v[pos]
        spans.append(SeqSpan(cached, num_new, table))
        full_k.append(k)
        full_v.append(v)
    # Blocks no sequence owns hold NaN (KV a failed sequence left behind): padded reads must not
    # touch them, or a zero attention weight times NaN poisons every row of the group.
    cache.k[:, [0, *free]] = float("nan")
    cache.v[:, [0, *free]] = float("nan")
    meta = build_step_metadata(spans, BLOCK_SIZE, window, torch.float32, torch.device("cpu"), cache.pad_block)
    assert len(meta.groups) >= 3  # decodes were split by length, plus the prefill group
    num_tokens = sum(n for _, n in layout)
    q = torch.randn(1, num_tokens, NUM_Q_HEADS, HEAD_DIM)
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, layout)])[None]
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, layout)])[None]
    kernel = native.decode_attention_kernel() if is_native else None
    if is_native and kernel is None:
        pytest.skip("the native kernel cannot be built here")
    attn = PagedAttention(cache, meta, sliding_window_layers=(0,) if window else (), decode_kernel=kernel)
    out = attn.attend(0, q, new_k, new_v)[0]
    offset = 0
    for (cached, num_new), k, v in zip(layout, full_k, full_v):
        expected = reference(q[0, offset : offset + num_new], k, v, cached, window)
        torch.testing.assert_close(out[offset : offset + num_new], expected, atol=1e-5, rtol=1e-5)
        offset += num_new


def test_split_by_length_groups_short_and_long_rows():
    spans = [SeqSpan(start, 1, []) for start in [3, 100, 4, 98, 5, 99, 2, 101, 6, 97]]
    groups = _split_by_length(list(range(10)), spans, num_splits=1)
    assert sorted(map(sorted, groups)) == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
    even = [SeqSpan(50, 1, []) for _ in range(10)]
    assert _split_by_length(list(range(10)), even, num_splits=2) == [list(range(10))]


@pytest.mark.parametrize("num_queries", [5, 80])  # the G query heads along the query axis; K and V repeated
def test_prefill_attention_on_cuda_matches_the_gqa_call_without_enable_gqa(num_queries):
    """On CUDA a masked SDPA call with enable_gqa runs the math path (K and V in fp32 per head, ~20x the
    memory): the engine folds the query heads into the query axis or repeats K and V per head instead,
    with the same result as the CPU's GQA call."""
    from helpers.fake_cuda import FakeCuda
    from tether.engine.attention import AttentionGroup, _attend_prefill

    gen = torch.Generator().manual_seed(0)
    num_rows, num_heads, num_kv_heads, head_dim, num_keys = 3, 6, 2, 16, 96
    q = torch.randn(num_rows * num_queries, num_heads, head_dim, generator=gen)
    keys = torch.randn(num_rows, num_kv_heads, num_keys, head_dim, generator=gen)
    values = torch.randn(num_rows, num_kv_heads, num_keys, head_dim, generator=gen)
    lengths = torch.tensor([88, 96, 90])[:, None, None]  # each row's context; its queries are the last
    positions = lengths - num_queries + torch.arange(num_queries)[None, :, None]  # [S, Tq, 1]
    is_visible = torch.arange(num_keys)[None, None, :] <= positions  # [S, Tq, Lk]
    mask = torch.zeros(is_visible.shape).masked_fill_(~is_visible, float("-inf")).unsqueeze(1)  # [S, 1, Tq, Lk]
    group = AttentionGroup.__new__(AttentionGroup)
    group.query_index = torch.arange(num_rows * num_queries).view(num_rows, num_queries)
    expected = _attend_prefill(q, keys, values, group, mask)  # the CPU's call, enable_gqa
    fake = FakeCuda()
    with fake:
        on_gpu = [t.to("cuda") for t in (q, keys, values, mask)]
        group.query_index = group.query_index.to("cuda")
        out = _attend_prefill(on_gpu[0], on_gpu[1], on_gpu[2], group, on_gpu[3])
    assert not fake.errors
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
