"""The policy-gradient trainer: one ``RolloutBatch`` in, one or more optimizer steps, metrics out.

Every piece of math is looked up by name in ``tether.algorithms`` registries (advantage estimators
are applied by the loop; this trainer picks the policy loss, the off-policy correction, the KL
estimator and the loss aggregation); it never branches on a name.

Log-probs of the three policies of decoupled PPO (Hilton et al. 2022):
* behaviour ``logp_behav``: what the engine reported when it sampled the tokens;
* proximal ``logp_old``: the trainer's weights before this batch's first optimizer step (computed
  with no grad when the batch gets several optimizer steps; otherwise it equals the current
  log-probs detached, which costs nothing);
* current ``logp``: with grad.
The engine/trainer mismatch (``mismatch/*``, ``is/*``) is measured on every batch, corrected or not.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tether.algorithms.corrections import Correction
from tether.algorithms.mismatch import lag0_mismatch_metrics, mismatch_metrics
from tether.algorithms.policy_loss import approx_proximal_logprobs
from tether.algorithms.registry import AGGREGATIONS, CORRECTIONS, KL_ESTIMATORS, POLICY_LOSSES
from tether.training.batch import RolloutBatch, split_by_tokens
from tether.training.optim import clipped_step
from tether.training.scoring import SamplingView, completion_logprobs_under


@dataclass(frozen=True, slots=True)
class PolicyLossSettings:
    policy_loss: str = "ppo_clip"
    loss_agg: str = "token_mean"
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    epochs_per_batch: int = 1
    correction: str = "none"
    correction_cap: float = 2.0
    proximal: str = "recompute"  # recompute | loglinear | bypass: see PROXIMAL_MODES
    micro_batch_tokens: int = 4096
    grad_clip: float = 1.0
    share_prompts: bool = True  # a group's prompt goes through the model once per micro-batch (exact)
    # The generation budget (``rollout.max_new_tokens``): the constant of aggregations that take a
    # ``max_len`` (Dr. GRPO's seq_mean_token_sum_norm); None leaves it to the batch's padded length.
    max_completion_len: int | None = None


def aggregation_weights(agg_fn, mask: torch.Tensor) -> torch.Tensor:
    """Per-token coefficients c with ``agg_fn(L, mask) == (c * L).sum()``, for the whole batch.

    Every registered aggregation is linear in the per-token losses, so its gradient with respect
    to them is the coefficient tensor. Computing it once over the full batch lets micro-batches
    accumulate gradients that equal one big batch exactly, whatever the normaliser.
    """
    probe = torch.zeros(mask.shape, dtype=torch.float32, requires_grad=True)
    (coeffs,) = torch.autograd.grad(agg_fn(probe, mask), probe)
    return coeffs  # [B, T]


def _proximal_recompute(logp: torch.Tensor, logp_old_all: torch.Tensor | None, logp_behav: torch.Tensor,
                        versions: torch.Tensor, version: int, progress: float) -> torch.Tensor:
    """Pre-update weights: exact. With one epoch they ARE the current weights (logp detached, free)."""
    return logp.detach() if logp_old_all is None else logp_old_all


def _proximal_loglinear(logp: torch.Tensor, logp_old_all: torch.Tensor | None, logp_behav: torch.Tensor,
                        versions: torch.Tensor, version: int, progress: float) -> torch.Tensor:
    """AReaL's log-linear interpolation between behaviour and current; no forward.

    Versions count published policies (one per batch); the current weights sit ``progress`` =
    epoch / epochs_per_batch of a version past the proximal ones, in the same unit."""
    return approx_proximal_logprobs(logp_behav, logp, versions, version, version + progress)


def _proximal_bypass(logp: torch.Tensor, logp_old_all: torch.Tensor | None, logp_behav: torch.Tensor,
                     versions: torch.Tensor, version: int, progress: float) -> torch.Tensor:
    """The behaviour log-probs themselves: decoupled PPO becomes plain PPO over behaviour log-probs."""
    return logp_behav


@dataclass(frozen=True, slots=True)
class ProximalMode:
    """How the proximal log-probs ``logp_old`` [b, T] of decoupled PPO are obtained."""

    logprobs: Callable[..., torch.Tensor]  # (logp, logp_old_all, logp_behav, versions, version, progress)
    # logp_old are the trainer's own pre-update weights: they need a scoring pass when epochs > 1.
    is_pre_update: bool
    # logp_old are formed from the current log-probs (so a batch-wide value needs a scoring pass).
    reads_current: bool


PROXIMAL_MODES = {  # ``algorithm.proximal``
    "recompute": ProximalMode(_proximal_recompute, is_pre_update=True, reads_current=False),
    "loglinear": ProximalMode(_proximal_loglinear, is_pre_update=False, reads_current=True),
    "bypass": ProximalMode(_proximal_bypass, is_pre_update=False, reads_current=False),
}


class PolicyTrainer:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, settings: PolicyLossSettings,
                 sampling: SamplingView, ref_model: torch.nn.Module | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.settings = settings
        self.sampling = sampling
        self.ref_model = ref_model
        self.policy_loss = POLICY_LOSSES.get(settings.policy_loss)
        self.aggregate = _with_max_len(AGGREGATIONS.get(settings.loss_agg), settings.max_completion_len)
        self.correct = CORRECTIONS.get(settings.correction)
        self.kl = KL_ESTIMATORS.get(settings.kl_estimator)
        self.proximal = PROXIMAL_MODES[settings.proximal]
        if settings.kl_coef > 0 and ref_model is None:
            raise ValueError("kl_coef > 0 needs a reference model")
        # The KL to the reference compares the unfiltered distributions at the sampling temperature
        # (as verl and OpenRLHF do); None where that is the sampling view itself.
        self.kl_view = SamplingView(sampling.temperature) if sampling.is_filtered else None

    def _micro_batches(self, batch: RolloutBatch) -> list[list[int]]:
        return split_by_tokens(batch.prompt_ids, batch.completion_lens, self.settings.micro_batch_tokens,
                               share_prompts=self.settings.share_prompts)

    @torch.no_grad()
    def _score_all(self, model: torch.nn.Module, batch: RolloutBatch, chunks: list[list[int]],
                   view: SamplingView | None = None) -> torch.Tensor:
        out = torch.zeros_like(batch.behaviour_logprobs)  # [B, T]
        for rows in chunks:
            (logp,), _ = self._logprobs(model, batch, rows, [view or self.sampling])
            out[rows] = logp
        return out

    def _logprobs(self, model: torch.nn.Module, batch: RolloutBatch, rows: list[int], views: list[SamplingView]
                  ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        lens = batch.mask[rows].sum(dim=1).tolist()  # one host sync, not one per row
        completions = [ids[:n] for ids, n in zip(batch.completion_ids[rows].tolist(), lens)]
        return completion_logprobs_under(model, [batch.prompt_ids[r] for r in rows], completions, views,
                                         num_cols=batch.mask.shape[1], with_entropy=model is self.model,
                                         share_prompts=self.settings.share_prompts)

    def train_on(self, batch: RolloutBatch, policy_version: int | None = None) -> dict[str, float]:
        """Train on one batch; returns the step's metrics (losses, KL, entropy, grad norm, mismatch).

        ``policy_version``: the trainer's version before this batch (default: the batch's newest token
        version); the ``loglinear`` proximal mode interpolates by version.
        """
        start = time.perf_counter()
        s = self.settings
        chunks = self._micro_batches(batch)
        mask = batch.mask
        # A correction that drops tokens (masked IS) changes what the loss averages over: the
        # aggregation then runs over the batch's kept tokens, so the keep mask is needed for the
        # whole batch before the first micro-batch's backward (``_batch_correction``).
        is_masking = bool(getattr(self.correct, "drops_tokens", False))
        logp_ref = self._score_all(self.ref_model, batch, chunks, self.kl_view) if s.kl_coef > 0 else None
        # The proximal policy: pre-update weights. One epoch never changes them before the loss is
        # built, so the current log-probs (detached) are exact and the extra forward is skipped.
        is_rescored = (s.epochs_per_batch > 1 or is_masking) and self.proximal.is_pre_update
        logp_old = self._score_all(self.model, batch, chunks) if is_rescored else None
        version = int(batch.versions.max()) if policy_version is None else policy_version
        totals: dict[str, float] = {}
        mismatch: dict[str, float] = {}
        weights = None if is_masking else aggregation_weights(self.aggregate, mask)  # [B, T], fixed
        num_skipped = 0
        for epoch in range(s.epochs_per_batch):
            self.optimizer.zero_grad(set_to_none=True)
            correction = None
            if is_masking:  # the kept tokens move with the proximal log-probs: weights per epoch
                correction = self._batch_correction(batch, chunks, logp_old, version, epoch)
                weights = aggregation_weights(self.aggregate, correction.keep_mask)
            parts = [self._accumulate(batch, rows, weights, logp_old, logp_ref, version, epoch, correction)
                     for rows in chunks]
            if epoch == 0:  # the batch as sampled, against the trainer's pre-update weights
                mismatch = self._mismatch(batch, chunks, [inputs for _, inputs in parts], version)
            grad_norm, stepped = clipped_step(self.optimizer, s.grad_clip, "policy update")
            num_skipped += not stepped
            totals = {**_merge([stats for stats, _ in parts]), **mismatch}
            totals["grad_norm"] = grad_norm
        totals["optim/skipped_steps"] = num_skipped
        totals.update(_advantage_metrics(batch))
        totals["lr"] = self.optimizer.param_groups[0]["lr"]  # the rate this batch's steps used
        if num_skipped < s.epochs_per_batch:  # the schedule counts updates made (as DeepSpeed's skips)
            self.scheduler.step()
        totals["time/train_s"] = time.perf_counter() - start
        num_tokens = float(mask.sum()) + sum(len(p) for p in batch.prompt_ids)
        totals["throughput/train_tokens_per_s"] = num_tokens * s.epochs_per_batch / totals["time/train_s"]
        return totals

    def _batch_correction(self, batch: RolloutBatch, chunks: list[list[int]], logp_old_all: torch.Tensor | None,
                          version: int, epoch: int) -> Correction:
        """The correction over the whole batch [B, T] (weights, keep mask), before any backward.

        The proximal log-probs come from ``logp_old_all`` (recompute: pre-update weights), the
        behaviour log-probs (bypass), or a no-grad pass of the current weights (loglinear), which
        equals what this epoch's micro-batches compute with grad."""
        current = self._score_all(self.model, batch, chunks) if self.proximal.reads_current else None
        logp_behav = batch.behaviour_logprobs
        logp_old = self.proximal.logprobs(
            logp_behav if current is None else current, logp_old_all, logp_behav, batch.versions, version,
            epoch / self.settings.epochs_per_batch)
        return self.correct(logp_old, logp_behav, batch.mask, cap=self.settings.correction_cap)

    def _accumulate(self, batch: RolloutBatch, rows: list[int], weights: torch.Tensor,
                    logp_old_all: torch.Tensor | None, logp_ref_all: torch.Tensor | None,
                    version: int = 0, epoch: int = 0, batch_correction: Correction | None = None,
                    ) -> tuple[dict[str, float], tuple[torch.Tensor, ...]]:
        """Forward and backward of one micro-batch; its stats and what the mismatch metrics need."""
        s = self.settings
        index = torch.tensor(rows)
        mask = batch.mask[index]  # [b, T]
        views = [self.sampling] if self.kl_view is None or logp_ref_all is None else [self.sampling, self.kl_view]
        (logp, *logp_kl), entropy = self._logprobs(self.model, batch, rows, views)  # [b, T] with grad
        logp_behav = batch.behaviour_logprobs[index]
        logp_old = self.proximal.logprobs(logp, None if logp_old_all is None else logp_old_all[index], logp_behav,
                                 batch.versions[index], version, epoch / s.epochs_per_batch)
        if batch_correction is None:
            correction = self.correct(logp_old, logp_behav, mask, cap=s.correction_cap)
            is_weights, keep = correction.weights, correction.keep_mask
        else:
            weights_all = batch_correction.weights
            is_weights = None if weights_all is None else weights_all[index]
            keep = batch_correction.keep_mask[index]
        advantages = batch.advantages[index].unsqueeze(-1).expand_as(logp)  # [b, T]
        loss_tokens, stats = self.policy_loss(
            logp, logp_old, advantages, keep, logp_behav=logp_behav, clip_low=s.clip_low,
            clip_high=s.clip_high, is_weights=is_weights)
        kl_tokens = torch.zeros_like(logp)
        if logp_ref_all is not None:
            # Both under ``kl_view`` (temperature only): under top-k/top-p a token outside the
            # reference's kept set has log-prob -inf there, and the KL a drifted policy owes would
            # vanish exactly where it drifted furthest. (A -inf left, at a temperature whose
            # logits underflow, adds no term rather than NaN.)
            logp_pol = logp_kl[0] if logp_kl else logp
            logp_ref = logp_ref_all[index]
            kl_mask = mask & torch.isfinite(logp_pol.detach()) & torch.isfinite(logp_ref)
            kl = self.kl(torch.where(kl_mask, logp_pol, 0.0), torch.where(kl_mask, logp_ref, 0.0))
            kl_tokens = torch.where(kl_mask, kl, 0.0)
            loss_tokens = loss_tokens + s.kl_coef * kl_tokens
        w = weights[index]
        loss = (w * loss_tokens).sum()
        if loss.requires_grad:  # a micro-batch of empty completions has no graph and no gradient
            loss.backward()
        loss_tokens, kl_tokens = loss_tokens.detach(), kl_tokens.detach()
        num_tokens = float(mask.sum())
        # ppo/* are means over the tokens the loss scored: kept, with finite log-probs under both
        # policies (a token outside a top-k/top-p set has none); merged by that count.
        num_kept = float(stats.num_tokens)
        # Mismatch is trainer vs engine: the pre-update trainer weights, whatever the proximal mode
        # (``_mismatch`` reads epoch 0's, when the current weights are the pre-update ones).
        logp_trainer = logp_old if self.proximal.is_pre_update else logp
        inputs = (logp_trainer.detach(), is_weights, keep)
        out = {
            "loss/policy": float((w * loss_tokens).sum() - s.kl_coef * (w * kl_tokens).sum()),
            "kl/ref": float(kl_tokens.sum()) / max(num_tokens, 1.0),
            "entropy": float(torch.where(mask, entropy, 0.0).sum()) / max(num_tokens, 1.0),
            "ppo/clip_frac": float(stats.clip_frac), "ppo/approx_kl": float(stats.approx_kl),
            "ppo/ratio_mean": float(stats.ratio_mean),
        }
        return {"_tokens": num_tokens, "_kept": num_kept, **out}, inputs

    def _mismatch(self, batch: RolloutBatch, chunks: list[list[int]],
                  inputs: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]],
                  version: int) -> dict[str, float]:
        """``mismatch/*`` and ``is/*`` over the whole batch at once: ESS and the kept-token means are
        ratios of batch sums, which no average of micro-batch values reproduces. ``mismatch/lag0_*``:
        over the samples the trainer's pre-update version sampled whole, where engine and trainer ran
        the same weights, KV included (in an asynchronous run the others add the policy's drift since
        their version)."""
        logp_trainer = torch.zeros_like(batch.behaviour_logprobs)  # [B, T]
        keep = torch.zeros_like(batch.mask)
        # One correction for the batch: its weights are None in every micro-batch or in none.
        is_weights = None if inputs[0][1] is None else torch.zeros_like(batch.behaviour_logprobs)
        for rows, (logp, weights, kept) in zip(chunks, inputs):
            index = torch.tensor(rows)
            logp_trainer[index], keep[index] = logp.to(logp_trainer.dtype), kept
            if is_weights is not None:
                is_weights[index] = weights.to(is_weights.dtype)
        # No correction weights: is/* describe the raw ratio pi_old / pi_behav (the weight decoupled
        # PPO applies; plain PPO applies none) and nothing counts as truncated.
        out = mismatch_metrics(logp_trainer, batch.behaviour_logprobs, batch.mask, is_weights=is_weights,
                               keep_mask=keep, cap=None if is_weights is None else self.settings.correction_cap)
        # Lag 0: samples the pre-update version sampled whole. A sample continued across a weight
        # update (partial rollouts) holds KV of the older weights, so its newer tokens are not.
        is_fresh_row = ((batch.versions == version) | ~batch.mask).all(dim=1, keepdim=True)  # [B, 1]
        return {**out, **lag0_mismatch_metrics(logp_trainer, batch.behaviour_logprobs, batch.mask,
                                               (batch.versions == version) & is_fresh_row)}


def _with_max_len(agg_fn: Callable[..., torch.Tensor], max_len: int | None) -> Callable[..., torch.Tensor]:
    """The aggregation with its ``max_len`` constant bound, when it takes one and one is given."""
    if max_len is None or "max_len" not in inspect.signature(agg_fn).parameters:
        return agg_fn
    return functools.partial(agg_fn, max_len=max_len)


def _merge(parts: list[dict[str, float]]) -> dict[str, float]:
    """Token-weighted mean of micro-batch metrics; ``loss/policy`` adds up (weights are global).

    ``ppo/*`` are means over the tokens each micro-batch's loss scored (kept by the correction, with
    finite log-probs: ``PolicyLossStats.num_tokens``), so they are weighted by those; the others by
    valid tokens."""
    counts = {"_tokens": sum(p["_tokens"] for p in parts) or 1.0, "_kept": sum(p["_kept"] for p in parts) or 1.0}
    merged: dict[str, float] = {}
    for key in parts[0]:
        if key in counts:
            continue
        if key == "loss/policy":
            merged[key] = sum(p[key] for p in parts)
        else:
            count = "_kept" if key.startswith("ppo/") else "_tokens"
            merged[key] = sum(p[key] * p[count] for p in parts) / counts[count]
    return merged


def _advantage_metrics(batch: RolloutBatch) -> dict[str, float]:
    """``advantage/*`` over the batch's completion tokens (as verl's ``critic/advantages/*``: a
    sample weighs its length), and the share of samples whose advantage is 0 (a group with no
    signal, under a group baseline)."""
    lengths = batch.mask.sum(dim=1).float()  # [B]
    adv = batch.advantages.float()  # [B]
    num_tokens = float(lengths.sum())
    if not num_tokens:
        return {}
    mean = float((adv * lengths).sum()) / num_tokens
    var = float(((adv - mean) ** 2 * lengths).sum()) / num_tokens
    has_tokens = lengths > 0
    return {"advantage/mean": mean, "advantage/std": var ** 0.5, "advantage/max": float(adv[has_tokens].max()),
            "advantage/min": float(adv[has_tokens].min()), "advantage/zero_frac": float((adv == 0).float().mean())}
