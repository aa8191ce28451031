"""``SharedPrefixAttention``: sequences that share prefixes, each prefix stored and computed once.

A GRPO batch holds G prompts with n completions each. Scored as separate sequences (``PackedAttention``)
every prompt runs through the model n times; here it runs once and its n completions attend to the
one copy of its keys and values. The outputs equal those of the separate sequences (to fp32
rounding), and so do the gradients: a shared prefix's activations receive the sum of what its
suffixes send back, which is what n copies would have received one by one. "Prefix sharing" in the
sense of Hydragen (Juravsky et al. 2024) and verl's prefix grouper, for training.

Layout of the one packed row ``[1, N]``: every prefix back to back (``num_prefix_tokens`` of them),
then every suffix back to back, in row order. Positions restart at 0 on each prefix and continue on
each suffix (``P .. P + S - 1`` after a prefix of length P): pass ``positions()`` to ``Decoder.forward``.

* prefix queries attend causally within their prefix: a ``PackedAttention`` over the prefix region;
* suffix queries attend to their whole prefix and causally within their own suffix. Suffixes of one
  prefix are laid side by side in *lanes* of about as many queries as the prefix has tokens (16 to
  ``LANE_QUERY_TOKENS``; a longer suffix has a lane of its own); a lane's keys are its prefix once
  plus its suffixes, and a mask keeps each suffix to the prefix and itself. Lanes are grouped into
  buckets of at most ``SUFFIX_BUCKET_ELEMENTS`` score entries (lanes x queries x keys); a bucket is
  one SDPA call over lanes padded to ``[b, Tq]`` queries and ``[b, Tk]`` keys, gathered from the
  packed row by index (a prefix's keys are repeated per lane only inside attention, never in the
  matmuls). On a GRPO batch of short completions lanes cut the SDPA calls' batch from one entry per
  sample to a few per group, which is most of attention's cost on CPU. A single suffix over the
  budget goes alone, as one causal sequence (its prefix's queries recomputed there, no mask).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tether.models.attention import PackedAttention, _is_windowed, _to_heads_first, sdpa

# Score entries (lanes x queries x keys) of one suffix bucket: bounds its mask and score memory
# (~4M entries: a 4 MB mask) while a GRPO batch of short completions stays one call per layer.
SUFFIX_BUCKET_ELEMENTS = 1 << 22
# Queries of one lane (suffixes of one prefix side by side). Masked pairs between a lane's suffixes
# are wasted work, growing with the lane, while every lane costs the attention kernel a fixed set-up.
# A lane takes as many queries as its prefix has tokens (each query then wastes about as many
# score entries as it must compute over the prefix), at least LANE_MIN_QUERY_TOKENS and at most
# LANE_QUERY_TOKENS. On the demo's batch (prefixes of ~8 tokens, 16 completions of ~3) lanes of 16
# instead of 64 queries make the training step 10-13% faster: its lanes were mostly masked pairs.
LANE_QUERY_TOKENS = 64
LANE_MIN_QUERY_TOKENS = 16


def _offsets(lengths: Sequence[int], start: int) -> list[int]:
    """Where each of consecutive pieces of ``lengths`` begins, the first at ``start``."""
    out, offset = [], start
    for n in lengths:
        out.append(offset)
        offset += n
    return out


@dataclass(frozen=True, slots=True)
class _SuffixBucket:
    """One SDPA call: queries ``[b, Tq]`` and keys ``[b, Tk]`` of b lanes gathered from the packed row."""

    num_lanes: int  # b
    num_queries: int  # Tq
    num_keys: int  # Tk
    query_index: torch.Tensor  # LongTensor[b * Tq] into the packed row (padding -> 0)
    key_index: torch.Tensor  # LongTensor[b * Tk]
    output_index: torch.Tensor  # LongTensor[num real suffix tokens] into the flat [b * Tq] output
    query_positions: torch.Tensor  # LongTensor[b, Tq] (-1: padding)
    key_positions: torch.Tensor  # LongTensor[b, Tk] (-1: padding)
    query_rows: torch.Tensor  # LongTensor[b, Tq] the suffix (row) of each query (-1: padding)
    key_rows: torch.Tensor  # LongTensor[b, Tk] the suffix of each key (-1: a prefix key, seen by all)
    is_causal: bool  # one suffix as one whole causal sequence: no mask


@dataclass(frozen=True, slots=True)
class _Lane:
    prefix: int
    rows: list[int]
    num_queries: int  # sum of the rows' suffix lengths


@dataclass(slots=True)
class SharedPrefixAttention:
    """Prefixes of lengths ``prefix_lens [G]``, suffixes of lengths ``suffix_lens [B]`` (0 allowed),
    ``suffix_prefix [B]`` the prefix of each suffix; see the module docstring for the layout."""

    prefix_lens: Sequence[int]
    suffix_lens: Sequence[int]
    suffix_prefix: Sequence[int]
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] | None = None
    _prefix: PackedAttention = field(init=False, repr=False)
    _buckets: list[_SuffixBucket] = field(default_factory=list, init=False, repr=False)
    _masks: dict[tuple[int, bool], torch.Tensor | None] = field(default_factory=dict, init=False, repr=False)
    # Lanes emit suffix tokens grouped by prefix; this puts them back in packed order (None: already).
    _unpermute: torch.Tensor | None = field(default=None, init=False, repr=False)
    _prefix_starts: list[int] = field(default_factory=list, init=False, repr=False)
    _suffix_starts: list[int] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self.prefix_lens = [int(n) for n in self.prefix_lens]
        self.suffix_lens = [int(n) for n in self.suffix_lens]
        self.suffix_prefix = [int(g) for g in self.suffix_prefix]
        if len(self.suffix_lens) != len(self.suffix_prefix):
            raise ValueError(f"{len(self.suffix_lens)} suffix lengths but {len(self.suffix_prefix)} prefix ids")
        if any(n <= 0 for n in self.prefix_lens) or any(n < 0 for n in self.suffix_lens):
            raise ValueError("prefix lengths must be positive and suffix lengths non-negative")
        if any(not 0 <= g < len(self.prefix_lens) for g in self.suffix_prefix):
            raise ValueError(f"suffix_prefix must index the {len(self.prefix_lens)} prefixes")
        self._prefix_starts = _offsets(self.prefix_lens, 0)
        self._suffix_starts = _offsets(self.suffix_lens, self.num_prefix_tokens)
        self._prefix = PackedAttention(self.prefix_lens, self.sliding_window, self.sliding_window_layers)
        self._buckets = self._make_buckets()
        emitted = torch.cat([torch.arange(self.num_prefix_tokens)]
                            + [b.query_index.view(b.num_lanes * b.num_queries)[b.output_index] for b in self._buckets])
        if not torch.equal(emitted, torch.arange(self.num_tokens)):
            self._unpermute = torch.argsort(emitted)

    @property
    def num_prefix_tokens(self) -> int:
        return sum(self.prefix_lens)

    @property
    def num_tokens(self) -> int:
        return self.num_prefix_tokens + sum(self.suffix_lens)

    def prefix_starts(self) -> list[int]:
        """Offset of each prefix in the packed row."""
        return list(self._prefix_starts)

    def suffix_starts(self) -> list[int]:
        """Offset of each suffix in the packed row (after every prefix)."""
        return list(self._suffix_starts)

    def positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[1, N]``: 0..P-1 on each prefix, P..P+S-1 on each suffix."""
        out = [t for n in self.prefix_lens for t in range(n)]  # one tensor at the end, not one per row
        for g, n in zip(self.suffix_prefix, self.suffix_lens):
            out.extend(range(self.prefix_lens[g], self.prefix_lens[g] + n))
        return torch.tensor(out, dtype=torch.long, device=device)[None]

    def _make_lanes(self) -> list[_Lane]:
        lanes: list[_Lane] = []
        open_lane: dict[int, int] = {}  # prefix -> index of its lane still taking suffixes
        floor = min(LANE_MIN_QUERY_TOKENS, LANE_QUERY_TOKENS)
        for row, n in enumerate(self.suffix_lens):
            if n == 0:
                continue
            g = self.suffix_prefix[row]
            lane = lanes[open_lane[g]] if g in open_lane else None
            budget = max(floor, min(LANE_QUERY_TOKENS, self.prefix_lens[g]))
            if lane is not None and lane.num_queries + n <= budget:
                lanes[open_lane[g]] = _Lane(g, lane.rows + [row], lane.num_queries + n)
            else:
                open_lane[g] = len(lanes)
                lanes.append(_Lane(g, [row], n))
        return lanes

    def _make_buckets(self) -> list[_SuffixBucket]:
        buckets: list[_SuffixBucket] = []
        current: list[_Lane] = []
        max_queries = max_prefix = 0  # of ``current``, kept as lanes join (not rescanned per lane)
        for lane in self._make_lanes():
            queries, prefix = max(max_queries, lane.num_queries), max(max_prefix, self.prefix_lens[lane.prefix])
            if current and (len(current) + 1) * queries * (prefix + queries) > SUFFIX_BUCKET_ELEMENTS:
                buckets.append(self._bucket(current))
                current, queries, prefix = [], lane.num_queries, self.prefix_lens[lane.prefix]
            current.append(lane)
            max_queries, max_prefix = queries, prefix
        if current:
            buckets.append(self._bucket(current))
        return buckets

    def _bucket(self, lanes: list[_Lane]) -> _SuffixBucket:
        # Index lists are built in Python and converted once: per-row tensor ops cost more than the
        # attention itself on a GRPO batch of short completions.
        prefix_starts, suffix_starts = self._prefix_starts, self._suffix_starts
        max_prefix = max(self.prefix_lens[x.prefix] for x in lanes)
        max_queries = max(x.num_queries for x in lanes)
        is_causal = len(lanes) == 1 and len(lanes[0].rows) == 1 and (
            max_queries * (max_prefix + max_queries) > SUFFIX_BUCKET_ELEMENTS)
        # the causal bucket is the whole sequence, prefix queries included: fused SDPA, no mask
        num_queries = max_prefix + max_queries if is_causal else max_queries
        num_keys = max_prefix + max_queries
        q_index, q_pos, q_rows, k_index, k_pos, k_rows, output_index = [], [], [], [], [], [], []
        for i, lane in enumerate(lanes):
            p = self.prefix_lens[lane.prefix]
            prefix_ids = list(range(prefix_starts[lane.prefix], prefix_starts[lane.prefix] + p))
            ids, pos, rows = [], [], []
            for row in lane.rows:
                n = self.suffix_lens[row]
                ids += range(suffix_starts[row], suffix_starts[row] + n)
                pos += range(p, p + n)
                rows += [row] * n
            k_pad = [0] * (max_prefix - p), [-1] * (max_prefix - p)
            q_pad = [0] * (max_queries - lane.num_queries), [-1] * (max_queries - lane.num_queries)
            k_index += prefix_ids + k_pad[0] + ids + q_pad[0]
            k_pos += list(range(p)) + k_pad[1] + pos + q_pad[1]
            k_rows += [-1] * max_prefix + rows + q_pad[1]
            if is_causal:  # one suffix, no padding: the queries are the keys
                q_index, q_pos, q_rows = k_index, k_pos, [lane.rows[0]] * num_keys
                output_index += range(p, p + lane.num_queries)
            else:
                q_index += ids + q_pad[0]
                q_pos += pos + q_pad[1]
                q_rows += rows + q_pad[1]
                output_index += range(i * num_queries, i * num_queries + lane.num_queries)
        b = len(lanes)
        as_long = lambda xs, *shape: torch.tensor(xs, dtype=torch.long).view(*shape)  # noqa: E731
        return _SuffixBucket(b, num_queries, num_keys, as_long(q_index, -1), as_long(k_index, -1),
                             as_long(output_index, -1), as_long(q_pos, b, num_queries), as_long(k_pos, b, num_keys),
                             as_long(q_rows, b, num_queries), as_long(k_rows, b, num_keys), is_causal)

    def _mask(self, index: int, bucket: _SuffixBucket, is_windowed: bool) -> torch.Tensor | None:
        """Bool ``[b, 1, Tq, Tk]`` (True = attend), built once per bucket and kind of layer."""
        key = (index, is_windowed)
        if key not in self._masks:
            if bucket.is_causal and not is_windowed:
                self._masks[key] = None
            else:
                q_pos, k_pos = bucket.query_positions[:, :, None], bucket.key_positions[:, None, :]
                distance = q_pos - k_pos  # [b, Tq, Tk]
                k_rows = bucket.key_rows[:, None, :]
                mask = (k_pos >= 0) & (distance >= 0) & ((k_rows < 0) | (k_rows == bucket.query_rows[:, :, None]))
                if is_windowed:
                    mask &= distance < self.sliding_window
                # a padded query sees the first key (a real prefix token), so its softmax stays finite
                first = torch.zeros_like(mask)
                first[:, :, 0] = True
                mask |= (q_pos < 0) & first
                self._masks[key] = mask[:, None]
        return self._masks[key]

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q ``[1, N, Hq, D]``, k/v ``[1, N, Hkv, D]`` in the packed layout -> ``[1, N, Hq, D]``."""
        if q.shape[0] != 1 or q.shape[1] != self.num_tokens:
            raise ValueError(f"packed q must be [1, {self.num_tokens}, H, D], got {list(q.shape)}")
        is_windowed = _is_windowed(layer_idx, self.sliding_window, self.sliding_window_layers)
        num_prefix = self.num_prefix_tokens
        outputs = [self._prefix.attend(layer_idx, q[:, :num_prefix], k[:, :num_prefix], v[:, :num_prefix])[0]]
        q_flat, k_flat, v_flat = q[0], k[0], v[0]  # [N, H, D]
        for index, bucket in enumerate(self._buckets):
            b, tq, tk = bucket.num_lanes, bucket.num_queries, bucket.num_keys
            # index_select: its backward is an index_add, which sums what a shared prefix receives
            q_b = q_flat.index_select(0, bucket.query_index).view(b, tq, *q.shape[2:])
            k_b = k_flat.index_select(0, bucket.key_index).view(b, tk, *k.shape[2:])
            v_b = v_flat.index_select(0, bucket.key_index).view(b, tk, *v.shape[2:])
            mask = self._mask(index, bucket, is_windowed)
            out = sdpa(_to_heads_first(q_b), _to_heads_first(k_b), _to_heads_first(v_b), mask=mask,
                       is_causal=mask is None)  # [b, Hq, Tq, D]
            outputs.append(_to_heads_first(out).reshape(b * tq, *q.shape[2:]).index_select(0, bucket.output_index))
        out = torch.cat(outputs)  # [N, Hq, D] in emission order
        return (out if self._unpermute is None else out.index_select(0, self._unpermute))[None]
