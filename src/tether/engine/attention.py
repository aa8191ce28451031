"""Paged attention: the engine's ``AttentionBackend`` over a block pool, for one flattened step.

A step runs every scheduled token of every sequence back to back in one row (``B = 1``). Per layer,
``attend`` writes the new keys/values into their pool slots (``slot_mapping``), then gathers each
sequence's whole context through its block table and runs SDPA. Sequences are attended in at most
two padded batches, each one SDPA call per layer:

* decode rows (one new token): queries ``[S, Hkv, G, D]`` -- the G query heads of a KV head act
  as G queries, so grouped-query attention needs no expanded K/V -- over keys ``[S, Hkv, L, D]``
  with a length mask;
* prefill chunks (several new tokens): queries padded to ``[S, Hq, Tq, D]``, causal over cached
  plus new keys. Where the compiled kernel serves (``is_query_at_a_time``: fp32 on the CPU) instead
  each real query attends alone through it over its sequence's keys up to its own position: the
  computation, in the same order, that the token would get as a decode row, so its KV and output do
  not depend on how the scheduler cut the prompt into chunks or which other sequences shared the step
  (batch invariance needs this; without it the kernel is still as fast as SDPA on prompts of 32-128
  tokens and faster on longer ones, 0.92x the time at 500, ~0.8x at 1,500-3,000).

All indices and masks are built once per step (``build_step_metadata``) and shared by all layers,
so the per-layer work has no Python loop over sequences. The storage (the pool, and the contiguous
copies decode rows read) lives in ``tether.engine.kv_cache``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tether.engine.kv_cache import DecodeKV, KVCache, SlotWrites
from tether.engine.native import DecodeAttention

# Padding-aware grouping: split a group of rows only if it has this many rows and the split leaves
# at most this fraction of the padded area (each extra group costs one more SDPA call per layer).
_MIN_ROWS_TO_SPLIT = 8
_MIN_SPLIT_GAIN = 0.8
_MAX_SPLITS = 2
# fp32 decode rows read from ``DecodeKV`` attend with matmul + softmax; rows gathered from the pool
# do so up to this many keys (CPU), through SDPA beyond.
_MAX_KEYS_MATMUL_DECODE = 128



@dataclass(slots=True)
class AttentionGroup:
    """Sequences attended by one SDPA call per layer (S rows, queries padded to Tq, keys to Lk)."""

    query_index: torch.Tensor  # [S, Tq] position of each query in the step; padding repeats a real one
    block_ids: torch.Tensor  # [S * Nb] block tables, flattened, padded with the pool's pad block; Lk = Nb * block_size
    mask: torch.Tensor | None  # [S, 1, Tq, Lk] additive float mask (0 or -inf); None: query rows instead
    window_mask: torch.Tensor | None  # the same with the sliding window applied, if the model has one
    out_index: torch.Tensor  # [M] step positions of the real queries
    out_select: torch.Tensor | None  # [M] their rows in the flattened [S * Tq] output; None: no padding
    # Decode groups: each row's context length [S] (its keys), and the model's sliding window.
    context_lens: torch.Tensor | None = None
    window: int | None = None
    # Decode rows served by ``DecodeKV`` (row i in its slot i): each row's new-token position [S].
    decode_kv_positions: torch.Tensor | None = None
    # Prefill groups attended a query at a time by the compiled kernel, instead of the masks: each real
    # query's row in the group [M] and its number of keys (its position + 1) [M], in ``out_index`` order.
    query_rows: torch.Tensor | None = None
    query_lens: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return self.query_index.shape[0]

    @property
    def is_decode(self) -> bool:
        return self.query_index.shape[1] == 1


@dataclass(slots=True)
class StepMetadata:
    slot_mapping: torch.Tensor  # [T] pool slot of each new token
    groups: list[AttentionGroup]


@dataclass(slots=True)
class SeqSpan:
    """What the step computes for one sequence: tokens [start, start + num_new) of ``block_table``."""

    start: int
    num_new: int
    block_table: list[int]


def build_step_metadata(
    spans: list[SeqSpan],
    block_size: int,
    sliding_window: int | None,
    dtype: torch.dtype,
    device: torch.device,
    pad_block: int,
    decode_kv_rows: list[int] | None = None,
    is_query_at_a_time: bool = False,
) -> StepMetadata:
    """Slot mapping and attention groups for a step computing ``spans`` (in step order).

    ``decode_kv_rows``: the decode rows in ``DecodeKV`` slot order (``DecodeKV.assign``); they form
    one group read from those contiguous copies instead of gathered from the pool. ``pad_block``:
    the block that pads shorter block tables (``KVCache.pad_block``). ``is_query_at_a_time``: prefill
    groups carry query rows and lengths for the compiled kernel instead of masks.
    """
    offsets, slots = [], []
    offset = 0
    for span in spans:
        offsets.append(offset)
        offset += span.num_new
        slots.extend(_slots(span, block_size))
    decode_rows = [i for i, span in enumerate(spans) if span.num_new == 1]
    prefill_rows = [i for i, span in enumerate(spans) if span.num_new > 1]
    if decode_kv_rows is not None:
        decode_groups = [decode_kv_rows] if decode_kv_rows else []
    else:
        decode_groups = _split_by_length(decode_rows, spans, _MAX_SPLITS)
    groups = [
        _build_group(
            [spans[i] for i in rows], [offsets[i] for i in rows], block_size, sliding_window, dtype, device,
            pad_block, is_query_at_a_time,
        )
        for rows in decode_groups + _split_by_length(prefill_rows, spans, _MAX_SPLITS)
    ]
    starts = [spans[i].start for i in decode_kv_rows] if decode_kv_rows else []
    ints = torch.tensor(slots + starts, dtype=torch.long, device=device)  # one host-to-device copy
    if decode_kv_rows:
        groups[0].decode_kv_positions = ints[len(slots) :]
    return StepMetadata(ints[: len(slots)], groups)


def _padded_area(spans: list[SeqSpan]) -> int:
    """Query-key pairs one padded SDPA call computes (and, for the keys, gathers) for ``spans``."""
    return len(spans) * max(s.num_new for s in spans) * max(s.start + s.num_new for s in spans)


def _split_by_length(rows: list[int], spans: list[SeqSpan], num_splits: int) -> list[list[int]]:
    """Rows in groups of similar context length, when that saves enough padding to pay an extra call.

    One split point over rows sorted by length, chosen to minimise the padded area, applied
    recursively ``num_splits`` deep (at most 2 ** num_splits groups). O(S log S) host work.
    """
    if not rows:
        return []
    if num_splits == 0 or len(rows) < _MIN_ROWS_TO_SPLIT:
        return [rows]
    ordered = sorted(rows, key=lambda i: spans[i].start + spans[i].num_new)
    best_area, best_cut = _padded_area([spans[i] for i in ordered]), 0
    single_area = best_area
    num_rows = len(ordered)
    suffix_q = [0] * (num_rows + 1)
    for k in range(num_rows - 1, -1, -1):
        suffix_q[k] = max(suffix_q[k + 1], spans[ordered[k]].num_new)
    prefix_q = 0
    longest = spans[ordered[-1]].start + spans[ordered[-1]].num_new
    for cut in range(1, num_rows):
        left = spans[ordered[cut - 1]]
        prefix_q = max(prefix_q, left.num_new)
        area = cut * prefix_q * (left.start + left.num_new) + (num_rows - cut) * suffix_q[cut] * longest
        if area < best_area:
            best_area, best_cut = area, cut
    if best_cut == 0 or best_area > _MIN_SPLIT_GAIN * single_area:
        return [rows]
    return _split_by_length(ordered[:best_cut], spans, num_splits - 1) + _split_by_length(
        ordered[best_cut:], spans, num_splits - 1
    )


def _slots(span: SeqSpan, block_size: int) -> list[int]:
    end = span.start + span.num_new
    table = span.block_table
    if span.num_new == 1:  # the decode fast path: one slot, no loop
        return [table[span.start // block_size] * block_size + span.start % block_size]
    return [table[p // block_size] * block_size + p % block_size for p in range(span.start, end)]


def _build_group(
    spans: list[SeqSpan],
    offsets: list[int],
    block_size: int,
    window: int | None,
    dtype: torch.dtype,
    device: torch.device,
    pad_block: int,
    is_query_at_a_time: bool = False,
) -> AttentionGroup:
    num_blocks = max(-(-(s.start + s.num_new) // block_size) for s in spans)
    num_rows = len(spans)
    # One host-to-device copy for the group's integers (on a GPU each copy from the host is a sync).
    host: list[int] = []
    for s in spans:  # each row's block table, cut or padded to num_blocks
        host += s.block_table[:num_blocks]
        host += [pad_block] * (num_blocks - len(s.block_table))
    host += [s.start for s in spans] + [s.num_new for s in spans] + offsets
    ints = torch.tensor(host, dtype=torch.long, device=device)
    block_ids = ints[: num_rows * num_blocks]  # [S * Nb]
    start, num_new, offset = ints[num_rows * num_blocks :].view(3, num_rows)  # [S] each
    q_len = int(max(s.num_new for s in spans))
    j = torch.arange(q_len, device=device)  # [Tq]
    # Padded queries repeat the row's last real token: a valid input whose output is dropped.
    query_index = offset[:, None] + torch.minimum(j[None, :], num_new[:, None] - 1)  # [S, Tq]
    q_pos = start[:, None] + j[None, :]  # [S, Tq] absolute positions (padding runs past the end)
    # The real queries' places, from the host's spans: boolean indexing on a GPU would wait for it.
    out_select = None
    if any(s.num_new != q_len for s in spans):
        real = [row * q_len + i for row, s in enumerate(spans) for i in range(s.num_new)]
        out_select = torch.tensor(real, dtype=torch.long, device=device)  # [M] into [S * Tq]
    flat_index = query_index.view(-1)
    group = AttentionGroup(
        query_index=query_index,
        block_ids=block_ids,
        mask=None,
        window_mask=None,
        out_index=flat_index if out_select is None else flat_index[out_select],
        out_select=out_select,
        context_lens=start + num_new if q_len == 1 else None,
        window=window,
    )
    if q_len > 1 and is_query_at_a_time:  # the kernel takes each query's row and length, no mask
        rows = torch.arange(len(spans), device=device)[:, None].expand(-1, q_len).reshape(-1)
        lens = (q_pos + 1).view(-1)
        group.query_rows = rows if out_select is None else rows[out_select]
        group.query_lens = lens if out_select is None else lens[out_select]
        return group
    k_pos = torch.arange(num_blocks * block_size, device=device)[None, None, :]  # [1, 1, Lk]
    q_pos = q_pos[:, :, None]  # [S, Tq, 1]
    context_len = (start + num_new)[:, None, None]  # [S, 1, 1]
    # Comparisons broadcast straight to bool [S, Tq, Lk] (no int64 distances: 512 MB for a 2,048-token
    # chunk over 32k keys). Every row keeps key 0, so padded queries never see an all -inf row (NaN).
    is_visible = (k_pos <= q_pos) & (k_pos < context_len)  # [S, Tq, Lk]
    group.mask = _additive(is_visible, dtype)
    group.window_mask = _additive(is_visible & (k_pos > q_pos - window), dtype) if window is not None else None
    return group


def _additive(is_visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool [S, Tq, Lk] -> [S, 1, Tq, Lk]: 0 where visible, -inf elsewhere (faster in SDPA than bool)."""
    mask = torch.zeros(is_visible.shape, dtype=dtype, device=is_visible.device)
    return mask.masked_fill_(~is_visible, float("-inf")).unsqueeze(1)


@dataclass(slots=True)
class PagedAttention:
    """``AttentionBackend`` for one engine step; built by the runner with that step's metadata."""

    cache: KVCache
    meta: StepMetadata
    sliding_window_layers: tuple[int, ...] = ()  # layers that use the group's window_mask
    decode_kv: DecodeKV | None = None  # holds the decode group's KV when it has ``decode_kv_positions``
    # Decode rows attend through this compiled kernel when given (``tether.engine.native``; the runner
    # gives it for fp32 models on CPU only)
    decode_kernel: DecodeAttention | None = None
    _slot_writes: SlotWrites | None = field(default=None, init=False)  # the first layer's, for all

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q ``[1, T, Hq, D]``, k/v ``[1, T, Hkv, D]`` -> ``[1, T, Hq, D]``."""
        k_pool, v_pool = self.cache.k[layer_idx], self.cache.v[layer_idx]  # [NB, bs, Hkv, D]
        num_kv_heads, head_dim = k_pool.shape[2], k_pool.shape[3]
        # Write first: a sequence's own new keys are read back by the gather below.
        k_pool.view(-1, num_kv_heads, head_dim).index_copy_(0, self.meta.slot_mapping, k[0].to(k_pool.dtype))
        v_pool.view(-1, num_kv_heads, head_dim).index_copy_(0, self.meta.slot_mapping, v[0].to(v_pool.dtype))
        q = q[0]  # [T, Hq, D]
        is_windowed = layer_idx in self.sliding_window_layers
        out = torch.empty_like(q)
        for group in self.meta.groups:  # at most two: decodes, prefill chunks
            mask = group.window_mask if is_windowed and group.window_mask is not None else group.mask
            if group.decode_kv_positions is not None and self.decode_kv is not None:
                keys_t, values = self._append_decode_kv(layer_idx, k[0], v[0], group)
                is_matmul = keys_t.dtype == torch.float32  # either key layout (DecodeKV picked the faster)
                rows = self._attend_decode(q, keys_t, values, group, mask, is_windowed, is_matmul)
            else:
                keys = _gather(k_pool, group)  # [S, Hkv, Lk, D]
                values = _gather(v_pool, group)
                if group.is_decode:
                    is_short_on_cpu = keys.device.type == "cpu" and keys.shape[2] <= _MAX_KEYS_MATMUL_DECODE
                    is_matmul = keys.dtype == torch.float32 and is_short_on_cpu
                    rows = self._attend_decode(q, keys.transpose(-1, -2), values, group, mask, is_windowed, is_matmul)
                elif group.query_rows is not None and self.decode_kernel is not None:
                    # A query at a time, as a decode row at its position would be: the real queries only
                    window = group.window if is_windowed and group.window is not None else 0
                    out[group.out_index] = _attend_queries_native(self.decode_kernel, q, keys, values, group, window)
                    continue
                else:
                    rows = _attend_prefill(q, keys, values, group, mask)
            out[group.out_index] = rows if group.out_select is None else rows[group.out_select]
        return out.unsqueeze(0)

    def _attend_decode(
        self, q: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor, group: AttentionGroup,
        mask: torch.Tensor, is_windowed: bool, is_matmul: bool,
    ) -> torch.Tensor:
        """``_attend_decode``, through the compiled kernel when there is one."""
        if self.decode_kernel is not None:
            window = group.window if is_windowed and group.window is not None else 0
            return _attend_decode_native(self.decode_kernel, q, keys_t, values, group, window)
        return _attend_decode(q, keys_t, values, group, mask, is_matmul)

    def _append_decode_kv(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, group: AttentionGroup
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the decode rows' new k/v ``[T, Hkv, D]`` into their slots; their keys transposed
        ``[S, Hkv, D, Lk]`` and values ``[S, Hkv, Lk, D]`` as views of the slots ``[0, S)``."""
        assert self.decode_kv is not None and group.decode_kv_positions is not None
        num_keys = group.mask.shape[-1]
        index = group.query_index.view(-1)  # [S] each row's token in the step
        if self._slot_writes is None:
            self._slot_writes = self.decode_kv.slot_writes(group.decode_kv_positions)
        keys_t, values = self.decode_kv.write(layer_idx, k[index], v[index], self._slot_writes)
        return keys_t[..., :num_keys], values[:, :, :num_keys]


def _gather(pool: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    """pool [NB, bs, Hkv, D] -> the group's contexts [S, Hkv, Lk, D] (a strided view of one copy)."""
    num_rows = group.num_rows
    gathered = pool.index_select(0, group.block_ids)  # [S * Nb, bs, Hkv, D]
    return gathered.view(num_rows, -1, pool.shape[2], pool.shape[3]).transpose(1, 2)


def _attend_decode(
    q: torch.Tensor,
    keys_t: torch.Tensor,
    values: torch.Tensor,
    group: AttentionGroup,
    mask: torch.Tensor,
    is_matmul: bool,
) -> torch.Tensor:
    """One query per row: keys transposed ``[S, Hkv, D, Lk]`` (contiguous or a transposed view:
    ``DecodeKV``'s layouts, or a pool gather), values ``[S, Hkv, Lk, D]`` -> ``[S, Hq, D]``.

    ``is_matmul`` (fp32): two batched matmuls and a softmax instead of SDPA. They beat SDPA's CPU
    kernel: for short contexts its per-(row, head) set-up dominates a 2 x 16 score tile (1.3-1.8x at
    16-32 keys, even at 128); for long ones both matmuls are memory-bound, and with the faster layout
    for the CPU they stream K and V at close to its bandwidth.
    """
    num_rows, num_kv_heads, head_dim, num_keys = keys_t.shape
    queries = q[group.query_index.view(-1)]  # [S, Hq, D]
    # Query head h reads KV head h // G, so the G heads of a group are G queries of one KV head.
    queries = queries.view(num_rows, num_kv_heads, -1, head_dim).to(keys_t.dtype)  # [S, Hkv, G, D]
    if is_matmul:
        # Scaling the queries, not the scores, saves a pass over [S, Hkv, G, Lk].
        scores = torch.matmul(queries * head_dim**-0.5, keys_t).add_(mask)  # [S, Hkv, G, Lk]
        out = torch.matmul(scores.softmax(dim=-1), values)  # [S, Hkv, G, D]
    else:
        keys = keys_t.transpose(-1, -2)  # [S, Hkv, Lk, D]
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask)  # [S, Hkv, G, D]
    return out.reshape(num_rows, -1, head_dim)  # [S, Hq, D]


def _attend_decode_native(
    kernel: DecodeAttention, q: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor, group: AttentionGroup,
    window: int,
) -> torch.Tensor:
    """``_attend_decode`` by the compiled kernel: the same inputs, the rows' context lengths (and
    the sliding window) instead of the mask, which only encodes them."""
    assert group.context_lens is not None
    num_rows, num_kv_heads, head_dim, _ = keys_t.shape
    queries = q[group.query_index.view(-1)].view(num_rows, num_kv_heads, -1, head_dim)  # [S, Hkv, G, D]
    queries = queries.to(keys_t.dtype)  # as _attend_decode (under autocast q may be another dtype)
    out = kernel(queries, keys_t.transpose(-1, -2), values, group.context_lens, head_dim**-0.5, window)
    return out.view(num_rows, -1, head_dim)  # [S, Hq, D]


def _attend_queries_native(
    kernel: DecodeAttention, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, group: AttentionGroup,
    window: int,
) -> torch.Tensor:
    """A prefill group's real queries ``[M, Hq, D]``, each attending alone through the compiled kernel
    over its sequence's keys ``[S, Hkv, Lk, D]`` up to its own position: the computation a decode row
    at that position does, whatever the chunk."""
    assert group.query_rows is not None and group.query_lens is not None
    num_kv_heads, head_dim = keys.shape[1], keys.shape[3]
    queries = q[group.out_index].view(-1, num_kv_heads, q.shape[1] // num_kv_heads, head_dim)  # [M, Hkv, G, D]
    out = kernel(queries.to(keys.dtype), keys, values, group.query_lens, head_dim**-0.5, window, group.query_rows)
    return out.view(-1, q.shape[1], head_dim)  # [M, Hq, D]


def _attend_prefill(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, group: AttentionGroup, mask: torch.Tensor
) -> torch.Tensor:
    num_rows, num_kv_heads, _, head_dim = keys.shape
    queries = q[group.query_index].transpose(1, 2).to(keys.dtype)  # [S, Hq, Tq, D]
    num_heads, num_queries = queries.shape[1], queries.shape[2]
    group_size = num_heads // num_kv_heads
    if group_size == 1 or queries.device.type == "cpu":  # the CPU's SDPA takes GQA with a mask
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, enable_gqa=group_size > 1)
    # On CUDA whether a masked enable_gqa call gets a fused kernel depends on the torch version (older
    # ones took the math path, K and V repeated in fp32 per head); query heads as many as the KV heads
    # get the memory-efficient kernel on every version. Either the G query heads of a KV head go along
    # the query axis (the mask repeated G times: cheap for a short span, a verify or a small chunk) or
    # K and V are repeated per query head (a long chunk).
    elif mask.element_size() * num_queries < 2 * keys.element_size() * num_kv_heads * head_dim:
        folded = queries.reshape(num_rows, num_kv_heads, group_size * num_queries, head_dim)
        out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask.repeat(1, 1, group_size, 1))
        # reshape: CUDA's memory-efficient kernel returns a transposed view, which no view can split
        out = out.reshape(num_rows, num_heads, num_queries, head_dim)
    else:
        out = F.scaled_dot_product_attention(queries, keys.repeat_interleave(group_size, dim=1),
                                             values.repeat_interleave(group_size, dim=1), attn_mask=mask)
    return out.transpose(1, 2).reshape(-1, num_heads, head_dim)  # [S * Tq, Hq, D]
