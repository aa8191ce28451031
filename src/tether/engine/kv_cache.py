"""KV storage of the engine: the paged pool (``KVCache``) and the contiguous decode copies (``DecodeKV``).

The pool holds every sequence's keys and values in fixed-size blocks addressed through block tables
(``tether.engine.block_manager`` owns the tables and reference counts). Decode rows additionally
keep a contiguous copy of their context so the decode attention reads it as a strided view instead
of gathering it from the pool every step (``DecodeKV``); both are written by
``tether.engine.attention.PagedAttention``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from tether.engine.cpu_kernels import choose_decode_layout


class SeqSpan(Protocol):
    """What a step computes for one sequence (``tether.engine.attention.SeqSpan``): tokens
    ``[start, start + num_new)`` of ``block_table``."""

    start: int
    num_new: int
    block_table: list[int]


@dataclass(slots=True)
class KVCache:
    """The pool. k, v: ``[num_layers, num_blocks, block_size, Hkv, D]``; slot = block * size + offset."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCache:
        # One block more than asked for: ``pad_block``, never handed out, so never written.
        shape = (num_layers, num_blocks + 1, block_size, num_kv_heads, head_dim)
        # Zeros, not empty: padded gathers read unused slots, and NaN garbage times a zero
        # attention weight would still be NaN.
        return cls(
            torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
        )

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    @property
    def num_blocks(self) -> int:
        """Blocks sequences can own (``pad_block`` is not one of them)."""
        return self.k.shape[1] - 1

    @property
    def pad_block(self) -> int:
        """The block padded block tables point at: all zeros, read (masked) and never written, so a
        padded read never sees another sequence's keys and values (a non-finite value times a zero
        attention weight is NaN)."""
        return self.k.shape[1] - 1

    def nonfinite_slots(self) -> torch.Tensor:
        """bool ``[blocks, block_size]`` (on the CPU): the slots holding a NaN or infinite key or value
        in any layer or head (a layer at a time)."""
        num_blocks, block_size = self.k.shape[1], self.k.shape[2]
        is_bad = torch.zeros(num_blocks, block_size, dtype=torch.bool, device=self.k.device)
        for pool in (self.k, self.v):
            for layer in pool:
                is_bad |= ~torch.isfinite(layer).view(num_blocks, block_size, -1).all(dim=-1)
        return is_bad.cpu()

    def nonfinite_blocks(self) -> list[int]:
        """The blocks holding a NaN or infinite key or value in any slot."""
        return self.nonfinite_slots().any(dim=1).nonzero().view(-1).tolist()

    def zero_slots(self, slots: torch.Tensor) -> None:
        """Zero the slots ``slots`` (bool ``[blocks, block_size]``) in every layer and head."""
        mask = slots.to(self.k.device)[None, :, :, None, None]
        self.k.masked_fill_(mask, 0)
        self.v.masked_fill_(mask, 0)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Apply copy-on-write block copies, all layers at once."""
        if copies:
            copy_rows((self.k, self.v), copies)


def _layer_rows(pool: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` (of dim 1) of every layer as indices into ``pool`` viewed ``[L * N, ...]``."""
    num_layers, num_rows = pool.shape[0], pool.shape[1]
    layer_start = torch.arange(num_layers, device=index.device)[:, None] * num_rows
    return (layer_start + index[None, :]).view(-1)  # [L * n], layer-major


def copy_rows(pools: tuple[torch.Tensor, ...], pairs: list[tuple[int, int]]) -> None:
    """``pool[:, dst] = pool[:, src]`` for each ``(src, dst)`` of ``pairs`` (distinct ``dst``), in
    contiguous ``[L, N, ...]`` tensors with the same ``L`` and ``N``.

    Through the ``[L * N, row]`` view: one ``index_select`` and one ``index_put_`` over whole rows.
    Advanced indexing on dim 1 copied element by element (twice as slow for a GRPO batch's forks)."""
    device = pools[0].device
    src = torch.tensor([s for s, _ in pairs], device=device)
    dst = torch.tensor([d for _, d in pairs], device=device)
    src_rows, dst_rows = _layer_rows(pools[0], src), _layer_rows(pools[0], dst)
    for pool in pools:
        flat = pool.view(pool.shape[0] * pool.shape[1], -1)
        flat.index_put_((dst_rows,), flat.index_select(0, src_rows))


@dataclass(frozen=True, slots=True)
class SlotWrites:
    """Where a step's decode rows write their new token in ``DecodeKV`` (``DecodeKV.slot_writes``)."""

    slots: torch.Tensor  # [S] 0..S-1
    positions: torch.Tensor  # [S] each slot's new-token position
    rows: torch.Tensor  # [S * Hkv] (slot, head, position) rows of a layer's copy viewed [R * Hkv * C, D]


def _tokens_dim(is_transposed: bool) -> int:
    """The token axis of a ``[L, R, Hkv, C, D]`` (or transposed ``[L, R, Hkv, D, C]``) copy."""
    return 4 if is_transposed else 3


class DecodeKV:
    """Contiguous per-sequence copies of the KV of decode rows, kept across steps.

    Gathering every decode row's whole context out of the pool, per layer and per step, copies far
    more than the step computes (on CPU it cost as much as the attention itself). Instead a sequence
    that keeps decoding owns a slot here: its context is gathered once, then each step appends one
    key/value per layer, and the decode attention reads slots ``[0, S)`` as a strided view, no copy.

    Values are ``v``: ``[L, R, Hkv, C, D]``. Keys are ``[L, R, Hkv, C, D]`` too, or transposed
    ``[L, R, Hkv, D, C]`` (``keys_transposed``): the decode score matmul ``q @ K^T`` with a few query
    rows per KV head is memory-bound, and which layout MKL streams faster depends on the CPU: keys
    transposed ran it ~1.5x faster on an Intel Xeon (128 rows x 256 keys, 2 threads), ``[C, D]`` keys
    1.4x faster on an AMD EPYC (``cpu_kernels.choose_decode_layout`` picks by the CPU; values held
    ``[D, C]`` were 1.6x slower there with the room slots keep to grow). The compiled decode
    attention (``tether.engine.native``) reads either, ``[C, D]`` keys 1.7x faster: the runner asks
    for those when it has the kernel. Other dtypes keep ``[C, D]`` keys and attend through SDPA,
    which scores in fp32 (a bf16 matmul would round the scores); handed a transposed view, SDPA's
    CPU kernel moved bf16 greedy log-probs by ~0.02. A bf16 model's copies stay bf16 so that its
    decode rows attend by the same kernel as the trainer's forward: copies held in fp32 for the fp32
    matmuls were as close to an fp32 reference as SDPA and no faster end to end, but put the
    engine's log-probs 5x further from the bf16 trainer's (mean 0.0053 against 0.0011), the
    mismatch the loop's importance weights correct for.

    A slot stays valid only while its sequence decodes in consecutive ``assign`` calls (same
    ``block_table`` object, ``start`` equal to the slot's length): any other path that writes its KV
    (prefill chunk, recompute after preemption, draft rollback) breaks the chain, and the next
    decode gathers afresh. Memory is capped at ``max_tokens`` slots x length (the pool's own size);
    past it ``assign`` returns None and the step gathers from the pool as before.
    """

    def __init__(self, pool: KVCache, max_tokens: int, keys_transposed: bool | None = None) -> None:
        """``keys_transposed`` None: fp32 keys in the layout this CPU's decode matmuls stream fastest
        (``cpu_kernels.choose_decode_layout``; transposed on other devices), ``[C, D]`` otherwise."""
        num_layers, _, _, num_kv_heads, head_dim = pool.k.shape
        self.max_tokens = max_tokens
        is_fp32 = pool.k.dtype == torch.float32
        if keys_transposed is None:
            keys_transposed = is_fp32 and (pool.k.device.type != "cpu" or choose_decode_layout())
        self.keys_transposed = keys_transposed
        if not is_fp32 and self.keys_transposed:
            raise ValueError("DecodeKV: only fp32 keys may be transposed (other dtypes attend through SDPA)")
        self._dims = (num_layers, num_kv_heads, head_dim)
        # Flat storage that only grows; k and v are views of its start in the current shape. On a GPU it
        # is allocated at the cap up front, as the pool is: memory a trainer on the same device cannot
        # take in between, and no growth that holds the old storage and the new at once.
        cap_numel = math.prod(self._shape(1, max_tokens, False)) if pool.k.device.type == "cuda" else 0
        self._storage = {"k": pool.k.new_zeros(cap_numel), "v": pool.v.new_zeros(cap_numel)}
        self.k = self._storage["k"][:0].view(self._shape(0, 0, self.keys_transposed))  # [L, R, Hkv, C, D] or [.., D, C]
        self.v = self._storage["v"][:0].view(self._shape(0, 0, False))  # [L, R, Hkv, C, D]
        self.tables: list[list[int] | None] = []  # [R] each slot's block_table object
        self.lengths: list[int] = []  # [R] tokens held (the slot's next write position)

    def clear(self) -> None:
        self.tables = [None] * len(self.tables)

    def zero_(self) -> None:
        """Drop every slot and zero the storage (padding past a slot's length is read, masked)."""
        self.clear()
        for storage in self._storage.values():
            storage.zero_()

    def _shape(self, num_rows: int, num_tokens: int, is_transposed: bool) -> tuple[int, ...]:
        num_layers, num_kv_heads, head_dim = self._dims
        inner = (head_dim, num_tokens) if is_transposed else (num_tokens, head_dim)
        return (num_layers, num_rows, num_kv_heads, *inner)

    def _copies(self) -> tuple[tuple[str, bool], ...]:
        """(attribute, whether its token axis is last) of the key and value copies."""
        return (("k", self.keys_transposed), ("v", False))

    def slot_writes(self, positions: torch.Tensor) -> SlotWrites:
        """Where ``write`` puts slot i's new token, at ``positions[i]``: computed once per step,
        used by every layer."""
        num_kv_heads, capacity = self._dims[1], self.capacity
        slots = torch.arange(positions.shape[0], device=positions.device)  # [S]
        heads = torch.arange(num_kv_heads, device=positions.device)  # [Hkv]
        # Row (slot i, head h, position p) of the [R * Hkv * C, D] view: one index_copy_ per tensor
        # (advanced indexing with two index tensors took ~10 % longer).
        rows = ((slots[:, None] * num_kv_heads + heads) * capacity + positions[:, None]).view(-1)
        return SlotWrites(slots, positions, rows)

    def write(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, where: SlotWrites
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append slot i's new key/value ``k[i]``, ``v[i]`` (``[S, Hkv, D]``) in layer
        ``layer_idx`` where ``where`` says; returns slots ``[0, S)`` as views over their ``C``
        positions: keys transposed ``[S, Hkv, D, C]`` (a strided view unless ``keys_transposed``),
        values ``[S, Hkv, C, D]``."""
        num_rows, head_dim = k.shape[0], k.shape[-1]
        k_rows, v_rows = self.k[layer_idx], self.v[layer_idx]  # contiguous
        v_rows.view(-1, head_dim).index_copy_(0, where.rows, v.to(v_rows.dtype).view(-1, head_dim))
        if self.keys_transposed:
            # The new key is column p of the slot's [D, C] matrix. Indexing slots and positions
            # writes it in 0.05 ms (128 rows); an index_copy_ of single elements took 2.7x as long.
            k_rows[where.slots, :, :, where.positions] = k.to(k_rows.dtype)  # [S, Hkv, D]
            keys_t = k_rows[:num_rows]
        else:
            k_rows.view(-1, head_dim).index_copy_(0, where.rows, k.to(k_rows.dtype).view(-1, head_dim))
            keys_t = k_rows[:num_rows].transpose(-1, -2)
        return keys_t, v_rows[:num_rows]

    @property
    def num_slots(self) -> int:
        return self.v.shape[1]

    @property
    def capacity(self) -> int:
        """Tokens each slot holds."""
        return self.v.shape[3]

    def assign(self, spans: list[SeqSpan], pool: KVCache, block_size: int) -> list[int] | None:
        """Give each decode row of the step slot ``i``; returns the rows in slot order (None: over
        the memory cap, use the pool). Moves and fills slots so that rows ``[0, S)`` are current."""
        rows = [i for i, span in enumerate(spans) if span.num_new == 1]
        capacity = -(-max((spans[i].start + 1 for i in rows), default=1) // block_size) * block_size
        if len(rows) * capacity > self.max_tokens:
            self.clear()
            return None
        self._reserve(len(rows), capacity)
        slot_of = {id(table): slot for slot, table in enumerate(self.tables) if table is not None}
        kept: dict[int, int] = {}  # row -> its current slot, for rows whose slot is still valid
        for row in rows:
            span, slot = spans[row], slot_of.get(id(spans[row].block_table))
            # identity, not equality: a recycled table with equal ids is another sequence's KV
            is_same_table = slot is not None and self.tables[slot] is span.block_table
            if is_same_table and self.lengths[slot] == span.start:
                kept[row] = slot
        staying = {row for row in rows if kept.get(row, len(rows)) < len(rows)}  # keep their slots
        free = sorted(set(range(len(rows))) - {kept[row] for row in staying})
        order_by_slot: list[int | None] = [None] * len(rows)
        for row in staying:
            order_by_slot[kept[row]] = row
        moves, fills = [], []
        for row in rows:
            if row in staying:
                continue
            slot = free.pop(0)
            order_by_slot[slot] = row
            (moves if row in kept else fills).append((row, slot))
        self._move([(kept[row], slot) for row, slot in moves])
        self._fill([(spans[row], slot) for row, slot in fills], pool, block_size)
        ordered = [row for row in order_by_slot if row is not None]
        self.tables = [spans[row].block_table for row in ordered] + [None] * (len(self.tables) - len(ordered))
        self.lengths = [spans[row].start + 1 for row in ordered] + [0] * (len(self.lengths) - len(ordered))
        return ordered

    def _reserve(self, num_rows: int, num_tokens: int) -> None:
        """Hold at least ``num_rows`` slots of ``num_tokens`` (doubling, so growth is rare), never more
        than ``max_tokens`` in all (``assign`` guarantees ``num_rows * num_tokens`` fits)."""
        old_rows, old_tokens = self.num_slots, self.capacity
        if num_rows <= old_rows and num_tokens <= old_tokens:
            return
        # Double only the dimension that is short: doubling rows for longer slots halved the tokens
        # per slot the cap allows.
        new_rows = old_rows if num_rows <= old_rows else max(num_rows, 2 * old_rows)
        new_tokens = old_tokens if num_tokens <= old_tokens else max(num_tokens, 2 * old_tokens)
        is_past_cap = new_rows * new_tokens > self.max_tokens
        if is_past_cap:
            # Past the cap: exactly the rows this step needs, each as long as the cap then allows.
            # Straight there, not a block at a time (that reallocated nearly every step: 8 % of a run);
            # and rows beyond this step's are dropped, or a wide batch followed by a few long
            # stragglers kept every old row at the new length (many times the cap).
            new_rows = num_rows
            new_tokens = max(num_tokens, self.max_tokens // num_rows)
        numel = math.prod(self._shape(new_rows, new_tokens, False))
        # Within the storage it has, the new shape is a new view of it, zeroed: rows are dropped and
        # gathered again from the pool when they next decode (keeping them would move data over
        # itself). Fresh memory took 30-400 ms per 150 MB on a shared VM (page faults), a re-view
        # zeroes it in ~10 and the refill of 128 rows costs about one step. Only past its storage
        # does it allocate, copying the rows it keeps.
        if numel <= self._storage["v"].numel():
            for name, is_transposed in self._copies():
                shape = self._shape(new_rows, new_tokens, is_transposed)
                setattr(self, name, self._storage[name][:numel].view(shape).zero_())
            self.tables, self.lengths = [None] * new_rows, [0] * new_rows  # every row gathered afresh
            return
        # Past it, the storage grows at least twofold, and straight to the cap once a shape reaches
        # it: shapes at the cap differ by rounding (68 x 726 then 128 x 386 tokens in the engine
        # benchmark), and one a few tokens over the storage reallocated 150 MB (~330 ms, 3.5 % of
        # a run) on every rollout.
        cap_numel = math.prod(self._shape(1, self.max_tokens, False))
        # at least numel: ``assign`` keeps every shape within the cap
        size = cap_numel if is_past_cap else min(max(numel, 2 * self._storage["v"].numel()), cap_numel)
        kept_rows, kept_tokens = min(old_rows, new_rows), min(old_tokens, new_tokens)
        for name, is_transposed in self._copies():
            old, dim = getattr(self, name), _tokens_dim(is_transposed)
            self._storage[name] = old.new_zeros(size)
            grown = self._storage[name][:numel].view(self._shape(new_rows, new_tokens, is_transposed))
            grown.narrow(1, 0, kept_rows).narrow(dim, 0, kept_tokens).copy_(
                old.narrow(1, 0, kept_rows).narrow(dim, 0, kept_tokens))
            setattr(self, name, grown)
        self.tables = (self.tables + [None] * new_rows)[:new_rows]
        self.lengths = (self.lengths + [0] * new_rows)[:new_rows]
        for slot, length in enumerate(self.lengths):
            if length > new_tokens:  # cut short: gathered afresh when its sequence next decodes
                self.tables[slot], self.lengths[slot] = None, 0

    def _move(self, moves: list[tuple[int, int]]) -> None:
        if moves:
            copy_rows((self.k, self.v), moves)

    def _fill(self, fills: list[tuple[SeqSpan, int]], pool: KVCache, block_size: int) -> None:
        """Copy each new row's computed context ``[0, start)`` out of the pool: all layers at once on
        the CPU (fewer, larger copies), a layer at a time elsewhere, where a gather of every layer of
        many rows at once would need memory the KV budget (pool and copies) does not count."""
        fills = [(span, slot) for span, slot in fills if span.start > 0]
        if not fills:
            return
        num_blocks = max(-(-span.start // block_size) for span, _ in fills)
        pad = [pool.pad_block]
        tables = [span.block_table[:num_blocks] + pad * (num_blocks - len(span.block_table)) for span, _ in fills]
        ids = torch.tensor(tables, dtype=torch.long, device=self.v.device).view(-1)  # [n * Nb]
        width = num_blocks * block_size
        runs = _slot_runs([slot for _, slot in fills])
        rows = _layer_rows(pool.k, ids)  # [L * n * Nb] into the pool viewed [L * NB, ...]
        num_layers = pool.k.shape[0]
        step = num_layers if self.v.device.type == "cpu" else 1
        rows_per_layer = len(fills) * num_blocks
        for (name, is_transposed), source in zip(self._copies(), (pool.k, pool.v)):
            flat = source.view(num_layers * source.shape[1], *source.shape[2:])  # [L * NB, bs, Hkv, D]
            window = getattr(self, name).narrow(_tokens_dim(is_transposed), 0, width)
            for first_layer in range(0, num_layers, step):
                layers = min(step, num_layers - first_layer)
                chunk = rows.narrow(0, first_layer * rows_per_layer, layers * rows_per_layer)
                gathered = flat.index_select(0, chunk)  # [l * n * Nb, bs, Hkv, D]
                gathered = gathered.view(layers, len(fills), width, *source.shape[3:]).transpose(2, 3)
                if is_transposed:
                    gathered = gathered.transpose(3, 4)  # [l, n, Hkv, D, width]
                target = window.narrow(0, first_layer, layers)
                for first, start, length in runs:  # into slots in consecutive runs
                    target[:, first : first + length].copy_(gathered[:, start : start + length])
                del gathered  # before the next gather: one chunk's transient at a time


def _slot_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(first slot, position in ``slots``, length) of each run of consecutive slots, in order."""
    runs: list[tuple[int, int, int]] = []
    for position, slot in enumerate(slots):
        if runs and slot == runs[-1][0] + runs[-1][2]:
            first, start, length = runs[-1]
            runs[-1] = (first, start, length + 1)
        else:
            runs.append((slot, position, 1))
    return runs
