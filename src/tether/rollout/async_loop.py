"""The trainer-side driver of asynchronous RL: one step reads top to bottom.

    collect a batch within the staleness bound -> advantages -> train -> publish weights

The generator role runs elsewhere (``GeneratorTransport``: another process, or the same thread
in tests and sync mode) and never waits for the trainer beyond what the capacity controller
allows; the trainer waits only for data. Lag, the staleness bound and the capacity rule are
defined in ``tether.rollout.buffer`` and ``tether.rollout.staleness``; the timeline is drawn in
``docs/async.md``. All loop state lives in ``LoopState``, the buffer and the components'
``state_dict``s.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tether.algorithms.mismatch import staleness_metrics
from tether.errors import RequestError, RolloutStalledError
from tether.rewards.compute import RewardResult
from tether.rollout.buffer import GroupRollout, RolloutBuffer
from tether.rollout.generator_worker import MAX_FILTERED_DRAWS
from tether.rollout.local_backend import GeneratorTransport
from tether.rollout.sync_loop import MAX_EMPTY_DRAWS, LoopState, build_rollout_batch
from tether.training.batch import RolloutBatch
from tether.training.policy import PolicyTrainer


@dataclass(slots=True)
class AsyncRLComponents:
    transport: GeneratorTransport
    trainer: PolicyTrainer
    buffer: RolloutBuffer
    advantage_fn: Callable[..., torch.Tensor]  # registry entry: (rewards[B], group_size, lengths=[B]) -> [B]
    groups_per_batch: int
    group_size: int
    poll_timeout_s: float = 0.5
    max_wait_s: float = 600.0  # no finished group for this long: the generator is stuck


def collect_batch(c: AsyncRLComponents, state: LoopState) -> list[GroupRollout]:
    """Wait until ``groups_per_batch`` groups are consumable at the current version.

    Groups too stale to train on are dropped and their prompts re-issued, never silently skipped.
    """
    last_progress = time.monotonic()
    failed_at_progress = c.transport.counters.num_failed  # failures before the last finished group
    while True:
        take = c.buffer.take_batch(c.groups_per_batch, state.policy_version)
        if take.stale:
            state.num_stale_dropped += len(take.stale)
            c.transport.reissue([g.record for g in take.stale])
        if take.groups is not None:
            return take.groups
        groups = c.transport.poll(c.poll_timeout_s)
        counters = c.transport.counters
        if groups:
            c.buffer.add(groups)
            last_progress = time.monotonic()
            failed_at_progress = counters.num_failed
            continue
        # Dynamic sampling that finds no group with signal: after as many groups as MAX_FILTERED_DRAWS
        # batches, the run stops with the reason (verl's max_num_gen_batches), not after max_wait_s.
        # Counted by the generator, which then starts no more groups.
        num_filtered = counters.num_filtered_in_a_row
        if num_filtered >= MAX_FILTERED_DRAWS * c.groups_per_batch:
            reward_error = next(iter(counters.filtered_reward_errors.values()), None)
            cause = f"; a reward function failed (scored 0): {reward_error}" if reward_error else ""
            raise RolloutStalledError(
                f"dynamic sampling filtered {num_filtered} groups in a row (every sample of each scored the "
                f"same, so no advantage{cause}): check the reward functions, or set rollout.dynamic_sampling=false")
        # Failing groups with none finishing in between: from the start, or mid-run (weights gone
        # NaN), a run stops after 3 batches' worth, as the sync loop does, not after max_wait_s.
        num_in_a_row = counters.num_failed - failed_at_progress
        if num_in_a_row >= MAX_EMPTY_DRAWS * c.groups_per_batch:
            if not counters.num_finished:
                raise RequestError(f"the engine failed the first {counters.num_failed} groups and finished none; "
                                   f"first failure: {counters.first_failure}")
            raise RequestError(f"the engine failed {num_in_a_row} groups in a row since the last one finished; "
                               f"first failure of the run: {counters.first_failure}")
        if time.monotonic() - last_progress > c.max_wait_s:
            failed = f"; first failure: {counters.first_failure}" if counters.first_failure else ""
            raise RolloutStalledError(
                f"no rollout group finished in {c.max_wait_s:.0f}s (buffer holds {len(c.buffer)}, need "
                f"{c.groups_per_batch}; {counters.num_filtered} groups filtered by dynamic sampling, "
                f"{counters.num_failed} failed in the engine{failed}); the generator is stuck, or a reward "
                "function it calls does not return")


def merge_scores(groups: list[GroupRollout]) -> RewardResult:
    """The groups' rewards as one ``RewardResult`` over all their samples, in group order."""
    return RewardResult.concatenate([g.scores for g in groups])


def groups_to_batch(groups: list[GroupRollout], advantage_fn: Callable[..., torch.Tensor], group_size: int,
                    scores: RewardResult) -> RolloutBatch:
    completions = []
    for index, group in enumerate(groups):
        for completion in group.completions:
            completion.prompt_index = index  # rows of group i point at prompt i
            completions.append(completion)
    rewards = torch.tensor(scores.totals, dtype=torch.float32)  # [B * G]
    lengths = torch.tensor([comp.num_tokens for comp in completions])  # [B * G] completion tokens
    advantages = advantage_fn(rewards, group_size, lengths=lengths)  # [B * G], groups consecutive
    return build_rollout_batch([g.prompt_ids for g in groups], completions, rewards, advantages, group_size)


def async_rl_step(c: AsyncRLComponents, state: LoopState) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One trainer step of asynchronous RL; returns (metrics, samples)."""
    start = time.perf_counter()
    groups = collect_batch(c, state)  # the only wait: for data
    wait_s = time.perf_counter() - start
    scores = merge_scores(groups)
    state.note_reward_errors(scores.first_errors)
    state.note_reward_errors(c.transport.counters.filtered_reward_errors)  # in groups dynamic sampling dropped
    batch = groups_to_batch(groups, c.advantage_fn, c.group_size, scores)  # advantages
    lags = torch.tensor([lag for g in groups for lag in g.lags(state.policy_version)])  # [B * G]
    train_metrics = c.trainer.train_on(batch, policy_version=state.policy_version)  # loss -> optimizer step

    state.policy_version += 1
    state.step += 1
    state.num_samples += batch.num_seqs
    c.transport.publish_weights(c.trainer.model.named_parameters(), state.policy_version)  # weight sync

    lengths = batch.mask.sum(dim=1).float()  # [B * G]
    step_s = time.perf_counter() - start
    counters = c.transport.counters
    # Generation: inside the polls when the generator runs in this thread, else beside the whole step.
    gen_s = wait_s if c.transport.is_in_process else step_s
    num_generated = counters.num_generated_tokens - state.num_generated_tokens
    state.num_generated_tokens = counters.num_generated_tokens
    metrics: dict[str, Any] = {
        **scores.metrics(), **train_metrics, **staleness_metrics(lags),
        "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
        "time/wait_s": wait_s, "time/gen_s": gen_s, "time/step_s": step_s,
        "throughput/gen_tokens_per_s": num_generated / max(gen_s, 1e-9),  # every token the engine sampled
        "throughput/step_tokens_per_s": float(lengths.sum()) / max(step_s, 1e-9),  # tokens trained on
        "rollout/num_stale_dropped": state.num_stale_dropped, "rollout/num_filtered": counters.num_filtered,
        "rollout/num_filtered_reward_errors": counters.num_filtered_reward_errors,
        "rollout/num_failed": counters.num_failed,
        "rollout/num_aborted": counters.num_aborted, "rollout/num_reissued": counters.num_reissued,
        "rollout/buffer_size": len(c.buffer), "policy_version": state.policy_version,
        "num_samples": state.num_samples,
    }
    samples = [{"prompt": g.record.prompt, "completion": g.texts[0], "reward": g.scores.totals[0],
                "lag": g.lags(state.policy_version - 1)[0]} for g in groups]
    return metrics, samples
