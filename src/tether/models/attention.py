"""Attention backends: how a decoder layer attends, chosen by the caller, never by a global.

The decoder computes q, k, v (RoPE already applied) and hands them to the backend passed into
``Decoder.forward``. Each backend owns its own masking and KV storage:

* ``CausalAttention``     -- full sequences ``[B, T]``, optional key padding mask (training, scoring).
* ``PackedAttention``     -- several sequences concatenated into one row ``[1, T]`` (padding-free
                             training); attention never crosses a sequence boundary.
* ``ContiguousKVCache``   -- a static per-row cache for simple batched generation.
* the rollout engine adds a paged backend (``tether.engine.attention``) behind the same protocol.

Shapes: q ``[B, T, Hq, D]``, k and v ``[B, T, Hkv, D]``; ``attend`` returns ``[B, T, Hq, D]``.
Hq is a multiple of Hkv (grouped-query attention); backends expand k/v or use SDPA's ``enable_gqa``.

Sliding windows (Mistral, Qwen with ``use_sliding_window``) are a backend setting too, because the
mask is the backend's business: ``sliding_window`` keys at most (the query's own key included), on the
layers listed in ``sliding_window_layers`` (``None`` = every layer). ``ModelConfig.sliding_window``
and ``ModelConfig.sliding_window_layers`` hold the checkpoint's values; ``Decoder.forward`` builds a
``CausalAttention`` with them when no backend is passed.

Padding rows never produce NaN: a query whose keys are all padding is allowed to see its own slot, so
softmax stays finite (its output is garbage, and the caller ignores padded positions).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from tether.models.config import ModelConfig


class AttentionBackend(Protocol):
    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attend q over the keys/values this backend holds for ``layer_idx`` plus the new k, v."""
        ...


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
) -> torch.Tensor:
    """q ``[B, Hq, Tq, D]``, k/v ``[B, Hkv, Tk, D]``, mask bool ``[B, 1, Tq, Tk]`` (True = attend)
    -> ``[B, Hq, Tq, D]``. Scale is SDPA's default 1/sqrt(D), as in all four families.

    On CUDA a masked call with ``enable_gqa`` takes the math path (K and V in fp32, per head) on
    older torch versions; K and V repeated per query head let the memory-efficient kernel serve it
    on every version."""
    is_gqa = q.shape[1] != k.shape[1]
    if is_gqa and mask is not None and q.device.type != "cpu":
        group_size = q.shape[1] // k.shape[1]
        k, v, is_gqa = k.repeat_interleave(group_size, dim=1), v.repeat_interleave(group_size, dim=1), False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=is_gqa)


def _causal_mask(
    query_slots: torch.Tensor, num_keys: int, window: int | None, key_is_real: torch.Tensor | None
) -> torch.Tensor:
    """query_slots ``[Tq]`` (each query's own key index), key_is_real ``[B, Tk]``
    -> bool mask ``[B or 1, 1, Tq, Tk]``, True = attend."""
    key_slots = torch.arange(num_keys, device=query_slots.device)
    distance = query_slots[:, None] - key_slots[None, :]  # [Tq, Tk]
    mask = distance >= 0
    if window is not None:
        mask = mask & (distance < window)
    if key_is_real is None:
        return mask[None, None]
    # a padded query with no real key in reach sees itself, so its softmax row is not all -inf
    is_self = distance == 0
    return (mask[None] & (key_is_real[:, None, :] | is_self[None]))[:, None]


def sliding_window_args(config: ModelConfig) -> dict[str, int | tuple[int, ...] | None]:
    """The checkpoint's sliding window as backend keyword arguments: every backend a model runs
    with must apply it (``PackedAttention(lens, **sliding_window_args(model.config))``)."""
    return {"sliding_window": config.sliding_window, "sliding_window_layers": config.sliding_window_layers}


def _is_windowed(layer_idx: int, window: int | None, layers: tuple[int, ...] | None) -> bool:
    return window is not None and (layers is None or layer_idx in layers)


def _to_heads_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)  # [B, T, H, D] -> [B, H, T, D]


@dataclass(slots=True)
class CausalAttention:
    """Full sequences ``[B, T]``; ``key_padding_mask [B, T]`` is True for real tokens (left or right
    padding). Positions for left-padded rows should start at 0 on the first real token."""

    key_padding_mask: torch.Tensor | None = None
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] | None = None  # None: the window applies to every layer
    _masks: dict[tuple[bool, int], torch.Tensor] = field(default_factory=dict, init=False, repr=False)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        is_windowed = _is_windowed(layer_idx, self.sliding_window, self.sliding_window_layers)
        q_, k_, v_ = _to_heads_first(q), _to_heads_first(k), _to_heads_first(v)
        if self.key_padding_mask is None and not is_windowed:
            return _to_heads_first(sdpa(q_, k_, v_, is_causal=True))  # fused causal path, no mask tensor
        mask = self.mask_for(q.shape[1], q.device, is_windowed)
        return _to_heads_first(sdpa(q_, k_, v_, mask=mask))

    def mask_for(self, num_tokens: int, device: torch.device, is_windowed: bool = False) -> torch.Tensor:
        """``[B or 1, 1, T, T]``, built once and shared by all layers of a kind."""
        key = (is_windowed, num_tokens)
        if key not in self._masks:
            slots = torch.arange(num_tokens, device=device)
            window = self.sliding_window if is_windowed else None
            self._masks[key] = _causal_mask(slots, num_tokens, window, self.key_padding_mask)
        return self._masks[key]


# Sequences are grouped into chunks of up to this many tokens, each attended by one SDPA call with a
# block-diagonal causal mask: many short sequences (a GRPO batch) then cost a few calls instead of
# one call per sequence, while the mask stays small (at most CHUNK_TOKENS^2 booleans). Masked-out
# pairs are wasted work, so chunks stay small: on a GRPO batch of 128 sequences of ~37 tokens a
# training step took 0.41 s with 128-token chunks against 0.56 s with 512 (1 CPU thread). Longer
# sequences go alone, on SDPA's fused causal path.
PACKED_CHUNK_TOKENS = 128


@dataclass(slots=True)
class PackedAttention:
    """One row ``[1, T]`` holding sequences of lengths ``seq_lens`` back to back (sum == T).

    Attention is causal within each sequence and never crosses a boundary. Positions must restart at
    0 for each sequence: pass ``positions()`` to ``Decoder.forward``. Consecutive sequences are
    grouped into chunks of at most ``PACKED_CHUNK_TOKENS`` tokens (a longer sequence is a chunk of
    its own, on SDPA's fused causal path); each chunk is one SDPA call with a block-diagonal mask,
    so memory is bounded by the chunk size, not T^2.
    """

    seq_lens: Sequence[int] | torch.Tensor
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] | None = None
    _chunk_lens: list[int] = field(default_factory=list, init=False, repr=False)
    _chunk_seq_lens: list[list[int]] = field(default_factory=list, init=False, repr=False)
    _masks: dict[tuple[int, bool], torch.Tensor | None] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        lens = self.seq_lens.tolist() if isinstance(self.seq_lens, torch.Tensor) else list(self.seq_lens)
        if any(length <= 0 for length in lens):
            raise ValueError(f"seq_lens must be positive, got {lens}")
        self.seq_lens = [int(length) for length in lens]
        for length in self.seq_lens:
            if self._chunk_lens and self._chunk_lens[-1] + length <= PACKED_CHUNK_TOKENS:
                self._chunk_lens[-1] += length
                self._chunk_seq_lens[-1].append(length)
            else:
                self._chunk_lens.append(length)
                self._chunk_seq_lens.append([length])

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens)

    def positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[1, T]``: 0..L_i-1 for each sequence in turn."""
        return torch.tensor([t for length in self.seq_lens for t in range(length)], dtype=torch.long,
                            device=device)[None]

    def _mask(self, chunk: int, is_windowed: bool, device: torch.device) -> torch.Tensor | None:
        """Block-diagonal causal mask ``[1, 1, Tc, Tc]`` of a chunk; None means plain causal."""
        key = (chunk, is_windowed)
        if key not in self._masks:
            lens = self._chunk_seq_lens[chunk]
            if len(lens) == 1 and not is_windowed:
                self._masks[key] = None
            else:
                seq_id = torch.repeat_interleave(torch.arange(len(lens), device=device),
                                                 torch.tensor(lens, device=device))  # [Tc]
                slots = torch.cat([torch.arange(n, device=device) for n in lens])  # position in its sequence
                window = self.sliding_window if is_windowed else None
                distance = slots[:, None] - slots[None, :]  # valid only within a sequence
                mask = (seq_id[:, None] == seq_id[None, :]) & (distance >= 0)
                if window is not None:
                    mask &= distance < window
                self._masks[key] = mask[None, None]
        return self._masks[key]

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.shape[0] != 1 or q.shape[1] != self.num_tokens:
            raise ValueError(f"packed q must be [1, {self.num_tokens}, H, D], got {list(q.shape)}")
        is_windowed = _is_windowed(layer_idx, self.sliding_window, self.sliding_window_layers)
        # split (not slicing in a loop): its backward is one concatenation, not one full-size
        # gradient buffer per piece.
        pieces = zip(*(_to_heads_first(x).split(self._chunk_lens, dim=2) for x in (q, k, v)))
        outputs = []
        for chunk, (q_i, k_i, v_i) in enumerate(pieces):
            mask = self._mask(chunk, is_windowed, q.device)
            outputs.append(sdpa(q_i, k_i, v_i, mask=mask, is_causal=mask is None))
        return _to_heads_first(torch.cat(outputs, dim=2))


@dataclass(slots=True)
class ContiguousKVCache:
    """A static KV cache ``[B, Hkv, max_len, D]`` per layer for batched generation.

    All rows advance together: each forward writes its ``T`` new keys at slots
    ``[num_filled, num_filled + T)`` of every row, and after the last layer ``num_filled += T``.

    Usage (left-padded prompts ``input_ids [B, T]`` with ``prompt_mask [B, T]``, True = real):

    1. ``cache.set_padding(prompt_mask)`` before the prefill forward (skip it when no row is padded);
    2. prefill: ``model(input_ids, positions, attn=cache)`` with
       ``positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)``: 0 on each row's first real token
       (the value at padded slots does not matter, they are never attended);
    3. decode: ``model(next_ids[:, None], cache.next_positions(), attn=cache)``, one token per row.
       ``next_positions()`` is each row's count of real tokens so far (``[B, 1]``), which equals
       ``positions[:, -1:] + 1 + i`` at decode step ``i``. Decoded tokens are always real (rows that
       already finished keep decoding junk the caller ignores).

    The cache never computes positions itself; it only decides which slots each query may see.
    Keys at padded slots are never attended by real queries. A sliding window counts slots, which
    equals positions for real tokens because padding only sits before them.
    """

    num_layers: int
    batch: int
    max_len: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    device: torch.device | str = "cpu"
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] | None = None
    num_filled: int = field(default=0, init=False)
    k: torch.Tensor = field(init=False, repr=False)  # [num_layers, B, Hkv, max_len, D]
    v: torch.Tensor = field(init=False, repr=False)
    is_real: torch.Tensor = field(init=False, repr=False)  # [B, max_len] bool
    _pending_padding: torch.Tensor | None = field(default=None, init=False, repr=False)
    _masks: dict[bool, torch.Tensor] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        shape = (self.num_layers, self.batch, self.num_kv_heads, self.max_len, self.head_dim)
        self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.is_real = torch.zeros(self.batch, self.max_len, dtype=torch.bool, device=self.device)

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        batch: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> ContiguousKVCache:
        """A cache shaped for a ``ModelConfig``, with the checkpoint's sliding window."""
        return cls(
            num_layers=config.num_hidden_layers,
            batch=batch,
            max_len=max_len,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            dtype=dtype,
            device=device,
            sliding_window=config.sliding_window,
            sliding_window_layers=config.sliding_window_layers,
        )

    def set_padding(self, key_padding_mask: torch.Tensor) -> None:
        """Mark which of the next forward's ``T`` tokens are real: bool ``[B, T]``, True = real."""
        self._pending_padding = key_padding_mask

    def next_positions(self) -> torch.Tensor:
        """``[B, 1]`` long: the position of each row's next token (its number of real tokens)."""
        return self.is_real.sum(-1, keepdim=True)

    def reset(self) -> None:
        self.num_filled = 0
        self.is_real.zero_()
        self._pending_padding = None
        self._masks.clear()

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        num_new = q.shape[1]
        start, end = self.num_filled, self.num_filled + num_new
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} tokens > max_len={self.max_len}")
        if layer_idx == 0:
            self._begin_step(start, end)
        self.k[layer_idx, :, :, start:end] = _to_heads_first(k)  # k: [B, T, Hkv, D] -> [B, Hkv, T, D]
        self.v[layer_idx, :, :, start:end] = _to_heads_first(v)
        is_windowed = _is_windowed(layer_idx, self.sliding_window, self.sliding_window_layers)
        if is_windowed not in self._masks:
            slots = torch.arange(start, end, device=q.device)
            window = self.sliding_window if is_windowed else None
            self._masks[is_windowed] = _causal_mask(slots, end, window, self.is_real[:, :end])
        out = sdpa(_to_heads_first(q), self.k[layer_idx, :, :, :end], self.v[layer_idx, :, :, :end],
                   mask=self._masks[is_windowed])  # fmt: skip
        if layer_idx == self.num_layers - 1:
            self.num_filled = end
            self._masks.clear()
        return _to_heads_first(out)

    def _begin_step(self, start: int, end: int) -> None:
        if self._pending_padding is None:
            self.is_real[:, start:end] = True
        else:
            self.is_real[:, start:end] = self._pending_padding.to(self.is_real.device)
        self._pending_padding = None
        self._masks.clear()
