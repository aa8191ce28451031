"""Padding-free batches: several sequences packed into one row, with per-sequence positions.

Packing puts sequences end to end in a single ``[1, T]`` row; ``positions`` restart at 0 for
each sequence, which is what a packed attention backend (``tether.models.attention``) uses, with
``seq_lens`` / ``cu_seqlens``, to keep attention inside each sequence.

Loss-mask convention (the same as ``SFTExample``): ``loss_mask[0, t]`` is True when token ``t``
is a *target*, predicted from the logits at position ``t - 1`` of the same sequence. A token that
starts a sequence is never a target. ``shift_targets`` turns this into the per-position form a
trainer multiplies with its log-probs::

    logits = model(batch.input_ids, batch.positions)        # [1, T, V]
    targets, target_mask = shift_targets(batch)             # [1, T], [1, T]
    # logits[0, t] predicts targets[0, t] wherever target_mask[0, t]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


class TokenExample(Protocol):
    """Anything with token ids and a target mask of the same length (``SFTExample``, a rollout)."""

    input_ids: list[int]
    loss_mask: list[bool]


@dataclass(slots=True)
class PackedBatch:
    input_ids: torch.Tensor  # LongTensor [1, T]
    positions: torch.Tensor  # LongTensor [1, T], 0..len-1 within each sequence
    seq_lens: list[int]  # [S], sum == T
    loss_mask: torch.Tensor  # BoolTensor [1, T]; token t is a target predicted from t-1
    num_loss_tokens: int  # host-side count, so normalising the loss needs no device sync
    example_indices: list[int]  # [S], position of each sequence in the packed example list

    def __post_init__(self) -> None:
        num_tokens = sum(self.seq_lens)
        for name in ("input_ids", "positions", "loss_mask"):
            shape = tuple(getattr(self, name).shape)
            if shape != (1, num_tokens):
                raise ValueError(f"{name} must have shape (1, {num_tokens}) to match seq_lens, got {shape}")
        if len(self.example_indices) != len(self.seq_lens):
            raise ValueError(
                f"{len(self.example_indices)} example indices for {len(self.seq_lens)} sequences"
            )

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens)

    @property
    def num_sequences(self) -> int:
        return len(self.seq_lens)

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """Int32 [S + 1] cumulative sequence lengths (flash-attention varlen convention), on device."""
        offsets = [0]
        for seq_len in self.seq_lens:
            offsets.append(offsets[-1] + seq_len)
        return torch.tensor(offsets, dtype=torch.int32, device=self.input_ids.device)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        return PackedBatch(
            input_ids=self.input_ids.to(device, non_blocking=non_blocking),
            positions=self.positions.to(device, non_blocking=non_blocking),
            seq_lens=list(self.seq_lens),
            loss_mask=self.loss_mask.to(device, non_blocking=non_blocking),
            num_loss_tokens=self.num_loss_tokens,
            example_indices=list(self.example_indices),
        )


def pack(examples: Sequence[TokenExample], example_indices: Sequence[int] | None = None) -> PackedBatch:
    """Concatenate ``examples`` into one packed row (built on the CPU)."""
    if not examples:
        raise ValueError("cannot pack an empty list of examples")
    input_ids: list[int] = []
    positions: list[int] = []
    loss_mask: list[bool] = []
    for example in examples:
        if len(example.input_ids) != len(example.loss_mask) or not example.input_ids:
            raise ValueError("each example needs a non-empty input_ids and a loss_mask of the same length")
        input_ids.extend(example.input_ids)
        positions.extend(range(len(example.input_ids)))
        # A sequence's first token has no predecessor inside the sequence: never a target.
        loss_mask.append(False)
        loss_mask.extend(example.loss_mask[1:])
    return PackedBatch(
        input_ids=torch.tensor([input_ids], dtype=torch.long),
        positions=torch.tensor([positions], dtype=torch.long),
        seq_lens=[len(example.input_ids) for example in examples],
        loss_mask=torch.tensor([loss_mask], dtype=torch.bool),
        num_loss_tokens=sum(loss_mask),
        example_indices=list(range(len(examples)) if example_indices is None else example_indices),
    )


def pack_by_token_budget(examples: Sequence[TokenExample], max_tokens_per_batch: int) -> list[PackedBatch]:
    """Greedy first-fit packing, in order, into batches of at most ``max_tokens_per_batch`` tokens.

    Each example goes into the first batch (oldest first) that still has room, else opens a new
    one; an example longer than the budget gets a batch of its own (it is never split or cut).
    Batches come out in the order they were opened; ``example_indices`` maps back to ``examples``.
    """
    if max_tokens_per_batch < 1:
        raise ValueError(f"max_tokens_per_batch must be >= 1, got {max_tokens_per_batch}")
    bins: list[list[int]] = []
    room: list[int] = []  # tokens still free in each bin; an oversized example's bin has none
    for i, example in enumerate(examples):
        num_tokens = len(example.input_ids)
        target = next((b for b, free in enumerate(room) if free >= num_tokens), None)
        if target is None:
            bins.append([i])
            room.append(max(max_tokens_per_batch - num_tokens, 0))
        else:
            bins[target].append(i)
            room[target] -= num_tokens
    return [pack([examples[i] for i in indices], indices) for indices in bins]


def shift_targets(batch: PackedBatch, fill_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token targets for a packed batch, never crossing a sequence boundary.

    Returns ``targets`` LongTensor [1, T] with ``targets[0, t] = input_ids[0, t + 1]`` and
    ``target_mask`` BoolTensor [1, T], True where ``t + 1`` is a target of the same sequence. The
    last position of each sequence is masked (its next token belongs to another sequence) and the
    final position holds ``fill_id``, a valid id so ``gather``/``cross_entropy`` need no special case.
    Runs on the batch's device without host syncs.
    """
    targets = torch.full_like(batch.input_ids, fill_id)  # [1, T]
    targets[:, :-1] = batch.input_ids[:, 1:]
    target_mask = torch.zeros_like(batch.loss_mask)  # [1, T]
    is_same_sequence = batch.positions[:, 1:] != 0  # [1, T-1]; position 0 starts a new sequence
    target_mask[:, :-1] = batch.loss_mask[:, 1:] & is_same_sequence
    return targets, target_mask
