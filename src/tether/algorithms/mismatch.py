"""Train-inference mismatch and staleness metrics, for logging.

Samples come from the engine (behaviour policy), so with log ratio d = logp_trainer - logp_engine
= log(pi_trainer / pi_engine) per sampled token:

* ``mismatch/k1`` = mean(-d) and ``mismatch/k3`` = mean(exp(d) - d - 1) both estimate
  KL(pi_engine || pi_trainer) (Schulman 2020, "Approximating KL divergence"); k3 is never negative;
* ``mismatch/abs_logp_diff`` = mean |d|;
* ``is/mean``, ``is/ess``: mean and normalised effective sample size (sum w)^2 / (N sum w^2) of the
  importance weights over the kept valid tokens (Kong 1992; 1 = all weights equal);
* ``is/clip_frac``: fraction of kept valid tokens whose weight sits at ``cap`` (truncated);
* ``is/masked_frac``: fraction of valid tokens the correction dropped;
* ``mismatch/outside_support_frac``: fraction of valid tokens the trainer gives probability 0
  (outside its top-k/top-p set: stale samples, near-ties at the set's edge); the means above
  leave them out, and so does the policy loss;
* ``mismatch/lag0_k1``, ``mismatch/lag0_k3``, ``mismatch/lag0_frac`` (``lag0_mismatch_metrics``):
  k1 and k3 over the tokens of the samples the trainer's own pre-update version sampled whole (a
  sample continued across a weight update computed its later tokens over KV of the older
  weights), and their fraction of the valid tokens. With a lag the means above also hold the
  policy's drift since a token's version; these hold the engine/trainer numerics alone (0 when no
  sample has lag 0).

All reductions stay on the device; the one host sync is the final ``.tolist()``.
"""

from __future__ import annotations

import math

import torch

MISMATCH_KEYS = (
    "mismatch/k1",
    "mismatch/k3",
    "mismatch/abs_logp_diff",
    "is/mean",
    "is/ess",
    "is/clip_frac",
    "is/masked_frac",
    "mismatch/outside_support_frac",
)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, values, 0.0).sum() / mask.sum().clamp(min=1)


def mismatch_metrics(
    logp_trainer: torch.Tensor,
    logp_engine: torch.Tensor,
    mask: torch.Tensor,
    is_weights: torch.Tensor | None = None,
    keep_mask: torch.Tensor | None = None,
    cap: float | None = None,
) -> dict[str, float]:
    """Mismatch between trainer and engine log-probs of the same tokens. All inputs [B, T].

    ``is_weights`` default to the raw token ratios exp(d); ``keep_mask`` defaults to ``mask``;
    without ``cap`` nothing counts as clipped. An empty mask gives all zeros, not NaN.
    """
    with torch.no_grad():
        valid = mask
        mask = valid & torch.isfinite(logp_trainer) & torch.isfinite(logp_engine)
        log_ratio = torch.where(mask, logp_trainer.float() - logp_engine.float(), 0.0)  # [B, T]
        kept = mask if keep_mask is None else keep_mask & mask
        weights = log_ratio.exp() if is_weights is None else is_weights.float()
        weights = torch.where(kept, weights, 0.0)
        num_kept = kept.sum().clamp(min=1)
        sum_w = weights.sum()
        sum_w_sq = weights.square().sum()
        is_clipped = weights >= cap if cap is not None else torch.zeros_like(kept)
        values = torch.stack(
            [
                _masked_mean(-log_ratio, mask),
                _masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
                _masked_mean(log_ratio.abs(), mask),
                sum_w / num_kept,
                # All-zero weights (nothing kept) give ess 0, not 0/0.
                sum_w.square() / (num_kept * sum_w_sq).clamp(min=torch.finfo(torch.float32).tiny),
                _masked_mean(is_clipped.float(), kept),
                (mask.sum() - kept.sum()) / mask.sum().clamp(min=1),
                (valid.sum() - mask.sum()) / valid.sum().clamp(min=1),
            ]
        )
    return dict(zip(MISMATCH_KEYS, values.tolist()))  # the one host sync


def lag0_mismatch_metrics(logp_trainer: torch.Tensor, logp_engine: torch.Tensor, mask: torch.Tensor,
                          is_lag0: torch.Tensor) -> dict[str, float]:
    """``mismatch/lag0_k1``, ``mismatch/lag0_k3``: ``mismatch_metrics``' k1 and k3 over the valid tokens
    with ``is_lag0`` (sampled by the weights the trainer scored them with), and
    ``mismatch/lag0_frac``, their share of the valid tokens. All inputs [B, T]."""
    fresh = mask & is_lag0
    num_fresh = float(fresh.sum())
    if num_fresh:
        out = mismatch_metrics(logp_trainer, logp_engine, fresh)
        k1, k3 = out["mismatch/k1"], out["mismatch/k3"]
    else:  # nothing to measure: NaN, not a 0 that reads as "no numeric mismatch" in a run's mean
        k1 = k3 = math.nan
    return {"mismatch/lag0_k1": k1, "mismatch/lag0_k3": k3,
            "mismatch/lag0_frac": num_fresh / max(float(mask.sum()), 1.0)}


def staleness_metrics(lags: torch.Tensor) -> dict[str, float | dict[int, int]]:
    """How many policy versions behind each sample was. lags: LongTensor[B] (current - behaviour version).

    Returns ``staleness/mean``, ``staleness/max`` and ``staleness/hist`` ({lag: count}, sorted by lag).
    """
    values = lags.reshape(-1).tolist()  # the one host sync; B is small
    hist: dict[int, int] = {}
    for lag in sorted(values):
        hist[lag] = hist.get(lag, 0) + 1
    return {
        "staleness/mean": sum(values) / len(values) if values else 0.0,
        "staleness/max": max(values) if values else 0,
        "staleness/hist": hist,
    }
