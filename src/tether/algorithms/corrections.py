"""Off-policy / train-inference mismatch corrections (registry ``CORRECTIONS``).

The engine samples with its own kernels (and, asynchronously, possibly older weights), so its
log-probs ``logp_behav`` differ from the trainer's ``logp_old`` for the same tokens. Each correction
turns the ratio pi_old / pi_behav into per-token importance weights (detached) and a keep-mask.
Weights ``None`` mean "no reweighting of my own": the policy loss keeps its default weight (1 for
``ppo_clip``; the raw behaviour weight pi_prox / pi_behav of ``decoupled_ppo``, Hilton et al. 2022).

* ``none``: no weights, keep every valid token;
* ``tis_token`` / ``tis_seq``: truncated IS, w = min(ratio, cap) per token or per sequence
  (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training");
* ``mis_token`` / ``mis_seq``: masked IS, keep w = ratio but drop tokens / sequences whose ratio
  is above ``cap`` (or below ``lo``) instead of truncating (Liu et al. 2025, "When Speed Kills
  Stability: Demystifying RL Collapse from the Training-Inference Mismatch");
* ``geo_mask``: drop sequences whose geometric-mean ratio exp(mean_t log ratio_t) lies outside
  [lo, cap]; no weights of its own (the length-normalised sequence ratio of GSPO, Zheng et al. 2025, used as a
  mask as in verl's rollout-correction ``geo_mask``), so long sequences are not judged by a product
  that grows with length.

Shapes: ``logp_old``, ``logp_behav``: FloatTensor[B, T]; ``mask``: BoolTensor[B, T] ->
``Correction(weights [B, T] or None, keep_mask [B, T])``. Ratios are formed in log space; weights
are 0 wherever ``keep_mask`` is False, and ``keep_mask`` is always within ``mask``. Apply both: pass
``weights`` to the policy loss (``is_weights=``) and aggregate over ``keep_mask`` (corrections that
can drop tokens are marked ``drops_tokens``: the trainer then builds the keep mask for the whole
batch first, so micro-batches still add up to the one-batch loss).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from tether.algorithms.registry import CORRECTIONS
from tether.errors import ConfigError


@dataclass(slots=True)
class Correction:
    weights: torch.Tensor | None  # FloatTensor[B, T], detached, 0 where not kept; None: the loss's own
    keep_mask: torch.Tensor  # BoolTensor[B, T], subset of the valid-token mask


class CorrectionFn(Protocol):
    def __call__(
        self,
        logp_old: torch.Tensor,
        logp_behav: torch.Tensor,
        mask: torch.Tensor,
        *,
        cap: float = 2.0,
        lo: float | None = None,
    ) -> Correction: ...


def drops_tokens(fn: CorrectionFn) -> CorrectionFn:
    """Marks a correction whose keep mask may drop valid tokens. The loss then averages over the
    kept tokens of the whole batch, so the trainer forms the keep mask batch-wide before any
    backward (one no-grad scoring pass when the proximal log-probs are not at hand)."""
    fn.drops_tokens = True  # type: ignore[attr-defined]
    return fn


def _token_log_ratio(logp_old: torch.Tensor, logp_behav: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log(pi_old / pi_behav) per token, detached, 0 outside ``mask``. [B, T] -> fp32 [B, T]."""
    log_ratio = logp_old.detach().float() - logp_behav.detach().float()
    return torch.where(mask, log_ratio, 0.0)


def _log_bounds(cap: float, lo: float | None) -> tuple[float, float]:
    """(log lo, log cap) with the thresholds checked; a missing ``lo`` is no lower bound."""
    if not cap > 0:
        raise ConfigError(f"off-policy correction cap must be > 0, got {cap}")
    if lo is not None and not 0 < lo <= cap:
        raise ConfigError(f"off-policy correction lo must be in (0, cap={cap}], got {lo}")
    return (-math.inf if lo is None else math.log(lo)), math.log(cap)


def _result(weights: torch.Tensor, keep_mask: torch.Tensor) -> Correction:
    return Correction(weights=torch.where(keep_mask, weights, 0.0), keep_mask=keep_mask)


@CORRECTIONS.register("none")
def no_correction(
    logp_old: torch.Tensor,
    logp_behav: torch.Tensor,
    mask: torch.Tensor,
    *,
    cap: float = 2.0,
    lo: float | None = None,
) -> Correction:
    """No correction: every valid token kept, no weights (the policy loss keeps its own)."""
    return Correction(weights=None, keep_mask=mask)


@CORRECTIONS.register("tis_token")
def tis_token(
    logp_old: torch.Tensor,
    logp_behav: torch.Tensor,
    mask: torch.Tensor,
    *,
    cap: float = 2.0,
    lo: float | None = None,
) -> Correction:
    """Token-level truncated IS: w_t = min(pi_old / pi_behav, cap) (Yao et al. 2025, TIS). ``lo`` unused."""
    _log_bounds(cap, None)
    # exp() may overflow to inf for a wild token; clamp() then returns exactly ``cap``.
    return _result(_token_log_ratio(logp_old, logp_behav, mask).exp().clamp(max=cap), mask)


@CORRECTIONS.register("tis_seq")
def tis_seq(
    logp_old: torch.Tensor,
    logp_behav: torch.Tensor,
    mask: torch.Tensor,
    *,
    cap: float = 2.0,
    lo: float | None = None,
) -> Correction:
    """Sequence-level truncated IS: w = min(prod_t ratio_t, cap), the same for every token of a sequence."""
    _log_bounds(cap, None)
    seq_log_ratio = _token_log_ratio(logp_old, logp_behav, mask).sum(dim=-1, keepdim=True)  # [B, 1]
    weights = seq_log_ratio.exp().clamp(max=cap).expand_as(mask)
    return _result(weights, mask)


@CORRECTIONS.register("mis_token")
@drops_tokens
def mis_token(
    logp_old: torch.Tensor,
    logp_behav: torch.Tensor,
    mask: torch.Tensor,
    *,
    cap: float = 2.0,
    lo: float | None = None,
) -> Correction:
    """Token-level masked IS: w_t = ratio_t, tokens with ratio > cap (or < lo) dropped (Liu et al. 2025).

    A ratio exactly at ``cap`` (or ``lo``) is kept.
    """
    log_lo, log_cap = _log_bounds(cap, lo)
    log_ratio = _token_log_ratio(logp_old, logp_behav, mask)
    is_inside = (log_ratio <= log_cap) & (log_ratio >= log_lo)
    return _result(log_ratio.exp(), mask & is_inside)


@CORRECTIONS.register("mis_seq")
@drops_tokens
def mis_seq(
    logp_old: torch.Tensor,
    logp_behav: torch.Tensor,
    mask: torch.Tensor,
    *,
    cap: float = 2.0,
    lo: float | None = None,
) -> Correction:
    """Sequence-level masked IS: w = prod_t ratio_t, whole sequences dropped when it is > cap (or < lo)."""
    log_lo, log_cap = _log_bounds(cap, lo)
    seq_log_ratio = _token_log_ratio(logp_old, logp_behav, mask).sum(dim=-1, keepdim=True)  # [B, 1]
    is_inside = (seq_log_ratio <= log_cap) & (seq_log_ratio >= log_lo)  # [B, 1]
    return _result(seq_log_ratio.exp().expand_as(mask), mask & is_inside)


@CORRECTIONS.register("geo_mask")
@drops_tokens
def geo_mask(
    logp_old: torch.Tensor,
    logp_behav: torch.Tensor,
    mask: torch.Tensor,
    *,
    cap: float = 2.0,
    lo: float | None = None,
) -> Correction:
    """Geometric-mean sequence mask: drop sequences with exp(mean_t log ratio_t) outside [lo, cap].

    ``lo`` defaults to 1 / cap (a symmetric band in log space). A mask only: no weights. Typical
    thresholds are tight, e.g. cap=1.01, since a per-token average drifts far less than a product.
    """
    log_lo, log_cap = _log_bounds(cap, 1.0 / cap if lo is None else lo)
    log_ratio = _token_log_ratio(logp_old, logp_behav, mask)
    num_tokens = mask.sum(dim=-1, keepdim=True).clamp(min=1)  # [B, 1]
    mean_log_ratio = log_ratio.sum(dim=-1, keepdim=True) / num_tokens  # [B, 1]
    is_inside = (mean_log_ratio <= log_cap) & (mean_log_ratio >= log_lo)
    return Correction(weights=None, keep_mask=mask & is_inside)
