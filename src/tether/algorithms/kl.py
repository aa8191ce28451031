"""Per-token estimators of KL(pi || pi_ref) from samples of pi (registry ``KL_ESTIMATORS``).

Schulman 2020, "Approximating KL divergence" (http://joschu.net/blog/kl-approx.html). With
x ~ pi and log ratio d = logp_ref - logp = log(pi_ref / pi):

* k1 = -d: unbiased, high variance, can be negative per token;
* k2 = d^2 / 2: biased, low variance, always >= 0;
* k3 = exp(d) - d - 1: unbiased and always >= 0 (the "low_var_kl" of verl, GRPO's KL term in
  Shao et al. 2024, "DeepSeekMath", eq. 4).

Shapes: ``logp``, ``logp_ref``: [B, T] (or any matching shape) -> [B, T] fp32. With ``mask``,
invalid positions are 0 and their log-probs (possibly -inf in padding) never enter the arithmetic,
so they cannot put NaN into the backward either.
"""

from __future__ import annotations

from typing import Protocol

import torch

from tether.algorithms.registry import KL_ESTIMATORS


class KLEstimatorFn(Protocol):
    def __call__(
        self, logp: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor: ...


def _log_ratio(logp: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """d = logp_ref - logp in fp32, zeroed where mask is False. [B, T] -> [B, T]."""
    log_ratio = logp_ref.float() - logp.float()
    return log_ratio if mask is None else torch.where(mask, log_ratio, 0.0)


@KL_ESTIMATORS.register("k1")
def k1(logp: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """k1 = log(pi / pi_ref) = logp - logp_ref. [B, T] -> [B, T]."""
    return -_log_ratio(logp, logp_ref, mask)


@KL_ESTIMATORS.register("k2")
def k2(logp: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """k2 = (logp - logp_ref)^2 / 2. [B, T] -> [B, T]."""
    return 0.5 * _log_ratio(logp, logp_ref, mask).square()


@KL_ESTIMATORS.register("k3")
def k3(logp: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """k3 = exp(logp_ref - logp) - (logp_ref - logp) - 1. [B, T] -> [B, T]."""
    log_ratio = _log_ratio(logp, logp_ref, mask)
    # expm1(d) - d is the same quantity without cancellation when d is tiny (policy close to ref).
    return torch.expm1(log_ratio) - log_ratio
