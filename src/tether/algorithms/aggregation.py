"""Reductions of a per-token loss to the scalar the optimizer steps on (registry ``AGGREGATIONS``).

Shapes: ``loss_tokens: FloatTensor[B, T]``, ``mask: BoolTensor[B, T]`` -> 0-dim tensor. Masked
positions are selected out with ``torch.where`` (not multiplied by 0), so a NaN or inf in padding
cannot leak into the result.

``normalizer`` overrides the denominator: when one optimizer step accumulates gradients over
several micro-batches, pass the count over the whole step (tokens for ``token_mean``, sequences for
the others) so that the sum of micro-batch losses equals the loss of the full batch.
"""

from __future__ import annotations

from typing import Protocol

import torch

from tether.algorithms.registry import AGGREGATIONS

Normalizer = float | int | torch.Tensor | None


class AggregationFn(Protocol):
    def __call__(self, loss_tokens: torch.Tensor, mask: torch.Tensor, **kw: Normalizer) -> torch.Tensor: ...


def _masked_sum_per_seq(loss_tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, loss_tokens, 0.0).sum(dim=-1)  # [B]


@AGGREGATIONS.register("token_mean")
def token_mean(
    loss_tokens: torch.Tensor, mask: torch.Tensor, *, normalizer: Normalizer = None
) -> torch.Tensor:
    """sum over valid tokens / number of valid tokens: every token weighs the same, so long
    sequences weigh more (DAPO, Yu et al. 2025, section 3.3: token-level policy-gradient loss)."""
    denominator = mask.sum().clamp(min=1) if normalizer is None else normalizer
    return torch.where(mask, loss_tokens, 0.0).sum() / denominator


@AGGREGATIONS.register("seq_mean_token_mean")
def seq_mean_token_mean(
    loss_tokens: torch.Tensor, mask: torch.Tensor, *, normalizer: Normalizer = None
) -> torch.Tensor:
    """Mean over each sequence's valid tokens, then mean over sequences: every sequence weighs the
    same (the original GRPO, Shao et al. 2024, eq. 3). Sequences with no valid token are left out
    of the mean (default ``normalizer``: the number of sequences with at least one token)."""
    num_tokens = mask.sum(dim=-1)  # [B]
    per_seq = _masked_sum_per_seq(loss_tokens, mask) / num_tokens.clamp(min=1)  # [B]
    denominator = (num_tokens > 0).sum().clamp(min=1) if normalizer is None else normalizer
    return per_seq.sum() / denominator


@AGGREGATIONS.register("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(
    loss_tokens: torch.Tensor,
    mask: torch.Tensor,
    *,
    max_len: int | None = None,
    normalizer: Normalizer = None,
) -> torch.Tensor:
    """Sum over each sequence's valid tokens / a constant ``max_len``, then mean over sequences.

    Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", section 3.1): dividing by the
    sequence's own length biases towards long wrong answers; a constant (the generation budget)
    does not. ``max_len`` defaults to T; set it to the max completion length so the scale does not
    change with how a batch happened to be padded. Default ``normalizer``: B.
    """
    length = loss_tokens.shape[-1] if max_len is None else max_len
    denominator = max(loss_tokens.shape[0], 1) if normalizer is None else normalizer
    return (_masked_sum_per_seq(loss_tokens, mask) / length).sum() / denominator
