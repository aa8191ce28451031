"""Clipped policy-gradient losses (registry ``POLICY_LOSSES``).

Shapes: ``logp``, ``logp_old``, ``advantages``, ``mask`` are ``[B, T]`` (``advantages`` may also be
``[B]``, one per sequence, broadcast over tokens) -> ``(loss_tokens: FloatTensor[B, T], stats)``.
``loss_tokens`` is 0 where ``mask`` is False; reduce it with ``tether.algorithms.aggregation``.
Every loss has the signature of ``PolicyLossFn`` so the trainer calls whichever the config names.

Three policies appear in asynchronous RL (Hilton et al. 2022, "Batch size-invariance for policy
optimization"; Fu et al. 2025, "AReaL"): the *behaviour* policy that sampled the tokens (log-probs
reported by the engine), the *proximal* policy the update is clipped around (``logp_old``: the
trainer's weights before this optimizer step), and the *current* policy being optimised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tether.algorithms.registry import POLICY_LOSSES


@dataclass(slots=True)
class PolicyLossStats:
    """Diagnostics over valid tokens, as 0-dim tensors so that computing them never syncs the host."""

    clip_frac: torch.Tensor  # fraction of tokens whose clipped term was the one chosen by the min
    approx_kl: torch.Tensor  # k3 estimate of KL(pi_old || pi): mean of (r - 1) - log r
    ratio_mean: torch.Tensor  # mean of r = pi / pi_old
    behav_weight_mean: torch.Tensor  # mean importance weight applied on top (1 when none)
    num_tokens: torch.Tensor  # the tokens these are means over: in the mask, both log-probs finite


class PolicyLossFn(Protocol):
    def __call__(
        self,
        logp: torch.Tensor,
        logp_old: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        *,
        logp_behav: torch.Tensor | None = None,
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, PolicyLossStats]: ...


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, values, 0.0).sum() / mask.sum().clamp(min=1)


def _clipped_surrogate(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """-w * min(r A, clip(r, 1 - clip_low, 1 + clip_high) A), r = exp(logp - logp_old). All [B, T]."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)  # [B] -> [B, 1], broadcast over tokens
    # A token outside the top-k/top-p set of the proximal or the current policy (the set moved since
    # the engine sampled it, or a near-tie at its edge) has probability 0 there and no ratio
    # (-inf - -inf is NaN, and one NaN step ruins the weights): it adds nothing, as its gradient
    # (pi = 0) would. Padding may hold -inf too; zeroing the log-ratio and the weights outside the
    # mask first keeps NaN out of the backward (where() sends 0 to the other branch, and 0 * NaN).
    mask = mask & torch.isfinite(logp_old.detach()) & torch.isfinite(logp.detach())
    log_ratio = torch.where(mask, logp - logp_old.detach(), 0.0)  # [B, T]
    ratio = log_ratio.exp()
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    surrogate = torch.minimum(unclipped, clipped)
    loss = torch.where(mask, -torch.where(mask, weights.detach(), 0.0) * surrogate, 0.0)  # [B, T]
    with torch.no_grad():
        stats = PolicyLossStats(
            clip_frac=_masked_mean((clipped < unclipped).float(), mask),
            approx_kl=_masked_mean(ratio - 1.0 - log_ratio, mask),
            ratio_mean=_masked_mean(ratio, mask),
            behav_weight_mean=_masked_mean(weights.expand_as(ratio), mask),
            num_tokens=mask.sum(),
        )
    return loss, stats


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    logp_behav: torch.Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """PPO clipped surrogate, per token: -w * min(r A, clip(r, 1 - clip_low, 1 + clip_high) A).

    Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7, with r = pi / pi_old
    = exp(logp - logp_old). Asymmetric bounds (``clip_high`` > ``clip_low``) are the clip-higher of
    Yu et al. 2025, "DAPO", section 3.1. ``is_weights`` [B, T] (detached; e.g. truncated
    pi_old / pi_behav from ``tether.algorithms.corrections``) multiply each token's term; default 1.
    ``logp_behav`` is not used: plain PPO treats ``logp_old`` as the policy that sampled the data.
    """
    weights = torch.ones_like(logp) if is_weights is None else is_weights
    return _clipped_surrogate(logp, logp_old, advantages, mask, weights, clip_low, clip_high)


@POLICY_LOSSES.register("decoupled_ppo")
def decoupled_ppo(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    logp_behav: torch.Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """Decoupled PPO, per token: -(pi_prox / pi_behav) * min(r A, clip(r) A), r = pi / pi_prox.

    Hilton et al. 2022, "Batch size-invariance for policy optimization", section 3 (the decoupled
    PPO-clip objective); Fu et al. 2025, "AReaL", section 5.2. ``logp_old`` is the proximal
    policy; ``logp_behav`` (required) is the engine's behaviour log-prob. The behaviour weight
    exp(logp_old - logp_behav) is detached: it corrects the sampling distribution, no gradient.

    ``is_weights``, when given, *replaces* the raw behaviour weight: pass the truncated or masked
    version of the same ratio from ``tether.algorithms.corrections`` (computed with ``logp_old`` as
    the proximal log-probs) to bound its variance (AReaL caps it too). Proximal log-probs come from a
    forward pass with the pre-update weights, from ``approx_proximal_logprobs``, or, in *bypass*
    mode, are the behaviour log-probs themselves (``logp_old = logp_behav``): the weight is then 1
    and the loss is exactly ``ppo_clip`` over behaviour log-probs.
    """
    if logp_behav is None:
        raise ValueError(
            "decoupled_ppo needs logp_behav (the engine's log-probs); for bypass pass logp_old=logp_behav"
        )
    if is_weights is None:
        is_weights = torch.where(mask, logp_old - logp_behav, 0.0).exp()  # [B, T], detached below
    return _clipped_surrogate(logp, logp_old, advantages, mask, is_weights, clip_low, clip_high)


def approx_proximal_logprobs(
    logp_behav: torch.Tensor,
    logp_current: torch.Tensor,
    behav_version: torch.Tensor,
    prox_version: int | torch.Tensor,
    current_version: int | torch.Tensor,
) -> torch.Tensor:
    """Proximal log-probs interpolated log-linearly by policy version, saving a forward pass. -> [B, T].

    logp_prox = logp_behav + alpha * (logp_current - logp_behav), alpha = (v_prox - v_behav) /
    (v_current - v_behav), clamped to [0, 1]: the proximal policy is assumed to sit on the log-linear
    path between the policy that sampled a token and the current one (AReaL's "loglinear" proximal
    approximation). Tokens sampled by the current version (v_current == v_behav) get alpha = 0.

    logp_behav, logp_current: [B, T]; behav_version: [B, T] (per token, as the engine reports) or
    [B] (per sequence); prox_version, current_version: ints or tensors broadcasting to those.
    ``logp_current`` is detached: proximal log-probs are a constant of the loss.
    """
    if behav_version.dim() == 1:
        behav_version = behav_version.unsqueeze(-1)  # [B] -> [B, 1]
    v_behav = behav_version.to(torch.float32)
    v_prox = torch.as_tensor(prox_version, dtype=torch.float32, device=logp_behav.device)
    v_current = torch.as_tensor(current_version, dtype=torch.float32, device=logp_behav.device)
    span = v_current - v_behav
    is_stale = span > 0
    alpha = torch.where(is_stale, (v_prox - v_behav) / torch.where(is_stale, span, 1.0), 0.0).clamp(0.0, 1.0)
    logp_current = logp_current.detach()
    # Interpolate only where both log-probs are finite (padding may be -inf on either side).
    delta = torch.where(
        torch.isfinite(logp_current) & torch.isfinite(logp_behav), logp_current - logp_behav, 0.0
    )
    return logp_behav + alpha * delta
