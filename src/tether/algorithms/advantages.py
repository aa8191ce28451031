"""Sequence-level advantage estimators for group-sampled rollouts (registry ``ADVANTAGES``).

Shapes: ``rewards: FloatTensor[B]`` with ``B = num_groups * group_size`` and the samples of one
prompt in consecutive rows -> ``advantages: FloatTensor[B]`` (fp32). The trainer broadcasts a
sequence's advantage over its completion tokens. Every estimator has the signature
``fn(rewards, group_size, *, lengths=None, **kw)`` so the loop can call whichever the config names;
``lengths: LongTensor[B]`` are the completions' token counts, which only the estimators that
normalise over tokens (``reinforce_pp``, ``reinforce_pp_baseline``) read.

With a group baseline (all but ``reinforce_pp``), a group whose rewards are all equal carries no
learning signal: its advantages are exactly 0 (never NaN, never eps-amplified rounding noise from
``r - mean``). ``reinforce_pp`` has no group baseline and is 0 only for a constant batch.
"""

from __future__ import annotations

from typing import Protocol

import torch

from tether.algorithms.registry import ADVANTAGES
from tether.errors import ConfigError

DEFAULT_EPS = 1e-6


class AdvantageFn(Protocol):
    def __call__(self, rewards: torch.Tensor, group_size: int, *, lengths: torch.Tensor | None = None,
                 **kw: float | bool) -> torch.Tensor: ...


def _grouped(rewards: torch.Tensor, group_size: int, *, min_group_size: int = 1) -> torch.Tensor:
    """rewards [B] -> fp32 [num_groups, G], checking that B splits into whole groups."""
    if group_size < min_group_size:
        raise ConfigError(
            f"group_size must be >= {min_group_size} for this advantage estimator, got {group_size}"
        )
    if rewards.dim() != 1 or rewards.shape[0] % group_size != 0:
        raise ValueError(
            f"rewards must be [B] with B a multiple of group_size={group_size}, got {tuple(rewards.shape)}"
        )
    return rewards.float().reshape(-1, group_size)


def _centered(grouped: torch.Tensor) -> torch.Tensor:
    """r - mean over the group, exactly 0 in groups whose rewards are all equal. [N, G] -> [N, G]."""
    is_constant = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)  # [N, 1]
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    return centered.masked_fill(is_constant, 0.0)


@ADVANTAGES.register("grpo")
def grpo(
    rewards: torch.Tensor, group_size: int, *, eps: float = DEFAULT_EPS, scale_by_std: bool = True,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """GRPO: A_i = (r_i - mean_g(r)) / (std_g(r) + eps). rewards [B] -> [B].

    Shao et al. 2024, "DeepSeekMath", section 4.1.2 (outcome supervision): r~_i = (r_i - mean(r)) /
    std(r). The paper does not say which std; we use the unbiased (Bessel-corrected, /(G-1)) one,
    as TRL's GRPOTrainer and verl's ``compute_grpo_outcome_advantage`` do (both call
    ``torch.std``), with verl's eps=1e-6 so results match verl. ``scale_by_std=False`` is Dr. GRPO.
    """
    grouped = _grouped(rewards, group_size, min_group_size=2 if scale_by_std else 1)
    centered = _centered(grouped)
    if scale_by_std:
        centered = centered / (grouped.std(dim=1, unbiased=True, keepdim=True) + eps)
    return centered.reshape(-1)


@ADVANTAGES.register("dr_grpo")
def dr_grpo(rewards: torch.Tensor, group_size: int, *, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Dr. GRPO: A_i = r_i - mean_g(r), no std division. rewards [B] -> [B].

    Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective", section 3.1:
    dividing by std up-weights questions that are too easy or too hard (a difficulty bias).
    """
    return _centered(_grouped(rewards, group_size)).reshape(-1)


@ADVANTAGES.register("rloo")
def rloo(rewards: torch.Tensor, group_size: int, *, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """RLOO: A_i = r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean_g(r)). rewards [B] -> [B].

    Leave-one-out baseline of Kool et al. 2019, "Buy 4 REINFORCE samples, get a baseline for free!",
    applied to LLMs by Ahmadian et al. 2024, "Back to Basics" (eq. 9). Needs G >= 2.
    """
    grouped = _grouped(rewards, group_size, min_group_size=2)
    return (_centered(grouped) * (group_size / (group_size - 1))).reshape(-1)


def _whiten(values: torch.Tensor, lengths: torch.Tensor | None, eps: float) -> torch.Tensor:
    """(x - mean) / (std + eps) over the batch's completion tokens; a constant batch gives exactly 0.

    values [B], lengths [B] or None -> [B]. A sequence's value stands for each of its ``lengths``
    tokens, so the mean and the (Bessel-corrected) std are over tokens, as verl's and OpenRLHF's
    ``masked_whiten`` of token-level advantages under the response mask; a row without tokens weighs
    nothing. ``lengths=None`` weighs every sequence once."""
    values = values.float()
    weights = torch.ones_like(values) if lengths is None else lengths.to(values.device, torch.float32)
    if weights.shape != values.shape:
        raise ValueError(f"lengths must be [B] like rewards, got {tuple(weights.shape)} for {tuple(values.shape)}")
    count = weights.sum()
    if count < 2:
        return torch.zeros_like(values)
    counted = weights > 0
    mean = (weights * values).sum() / count
    centered = values - mean
    std = ((weights * centered.square()).sum() / (count - 1)).sqrt()
    is_constant = values[counted].amax() == values[counted].amin()
    scaled = centered / (std + eps)
    return torch.where(is_constant, torch.zeros_like(scaled), scaled)


@ADVANTAGES.register("reinforce_pp")
def reinforce_pp(rewards: torch.Tensor, group_size: int, *, eps: float = DEFAULT_EPS,
                 lengths: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE++: rewards whitened over the batch's tokens, (r - mean) / (std + eps). [B] -> [B].

    Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models",
    section 3 (global advantage normalisation): the advantages normalised are per token, so a
    sequence counts once per completion token (``lengths``), as in OpenRLHF and verl. ``group_size``
    only checks the batch layout.
    """
    return _whiten(_grouped(rewards, group_size).reshape(-1), lengths, eps)


@ADVANTAGES.register("reinforce_pp_baseline")
def reinforce_pp_baseline(
    rewards: torch.Tensor, group_size: int, *, eps: float = DEFAULT_EPS, lengths: torch.Tensor | None = None
) -> torch.Tensor:
    """REINFORCE++-baseline: subtract the group mean, then whiten over the batch's tokens. [B] -> [B].

    Hu 2025, REINFORCE++ (v3+), "REINFORCE++-baseline" for group sampling: the group mean (over
    sequences) removes the prompt's difficulty, the batch std over tokens (as ``reinforce_pp``)
    keeps the scale stable without GRPO's per-group std.
    """
    return _whiten(_centered(_grouped(rewards, group_size)).reshape(-1), lengths, eps)
