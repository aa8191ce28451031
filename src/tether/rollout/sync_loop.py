"""The synchronous (on-policy) RL loop: one step reads top to bottom.

    generate -> score -> advantages -> train (loss, optimizer step) -> weight sync

Everything the loop needs is handed in as components; all of its state (step, policy version,
prompt cursor) lives in ``LoopState`` and the components' own ``state_dict``s, nothing in closures.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tether.algorithms.mismatch import staleness_metrics
from tether.data.cursor import DataCursor
from tether.data.records import PromptRecord
from tether.engine.types import Completion, Generator, SamplingParams
from tether.errors import RequestError
from tether.rewards import RewardComputer
from tether.rollout.buffer import oldest_token_version
from tether.training.batch import RolloutBatch
from tether.training.policy import PolicyTrainer

# Batches in a row of which every group fails before a sync run stops with an error; the async
# driver stops once this many batches' worth of groups failed and none finished.
MAX_EMPTY_DRAWS = 3


@dataclass(slots=True)
class LoopState:
    step: int = 0
    policy_version: int = 0
    num_samples: int = 0  # samples trained on so far
    num_stale_dropped: int = 0  # groups dropped as too stale (async); their prompts were re-issued
    num_failed_groups: int = 0  # groups left out because the engine failed one of their samples (sync)
    first_failure: str | None = None  # the first such failure, for the log
    first_reward_errors: dict[str, str] = field(default_factory=dict)  # each reward's first failure (scored 0)
    num_empty_draws: int = 0  # batches in a row of which the engine failed every group (sync)
    num_generated_tokens: int = 0  # the generator's count at the end of the last step (async driver)

    def note_reward_errors(self, first_errors: dict[str, str]) -> None:
        """Keep each reward function's first failure of the run (``RewardResult.first_errors``)."""
        for name, message in first_errors.items():
            self.first_reward_errors.setdefault(name, message)


@dataclass(slots=True)
class RLComponents:
    generator: Generator
    trainer: PolicyTrainer
    rewards: RewardComputer
    prompts: DataCursor[PromptRecord]
    encode: Callable[[PromptRecord], list[int]]  # prompt record -> token ids
    decode: Callable[[list[int]], str]  # completion ids -> text for reward functions (decoded alone, as TRL)
    advantage_fn: Callable[..., torch.Tensor]  # registry entry: (rewards[B], group_size, lengths=[B]) -> [B]
    sampling: SamplingParams  # with n = group size
    prompts_per_step: int


def build_rollout_batch(prompt_ids: list[list[int]], completions: list[Completion], rewards: torch.Tensor,
                        advantages: torch.Tensor, group_size: int) -> RolloutBatch:
    """Pad completions into ``[B, T]`` tensors (B = prompts x group size, grouped consecutively)."""
    num_cols = max((c.num_tokens for c in completions), default=0) or 1
    lengths = torch.tensor([c.num_tokens for c in completions], dtype=torch.long)  # [B]
    mask = torch.arange(num_cols) < lengths[:, None]  # [B, T]; its True cells in row order = the tokens
    ids = torch.zeros(mask.shape, dtype=torch.long)
    logps = torch.zeros(mask.shape, dtype=torch.float32)
    versions = torch.zeros(mask.shape, dtype=torch.long)
    # One tensor per field for the whole batch: per-row copies cost ~10 ms for 256 rows.
    flat_logps = [x for c in completions for x in c.logprobs]
    flat_versions = [v for c in completions for v in c.versions]
    num_tokens = int(lengths.sum())
    if len(flat_logps) != num_tokens or len(flat_versions) != num_tokens:
        raise ValueError(f"completions carry {len(flat_logps)} log-probs and {len(flat_versions)} versions "
                         f"for {num_tokens} tokens")
    ids[mask] = torch.tensor([t for c in completions for t in c.token_ids], dtype=torch.long)
    logps[mask] = torch.tensor(flat_logps, dtype=torch.float32)
    versions[mask] = torch.tensor(flat_versions, dtype=torch.long)
    rows_prompt_ids = [prompt_ids[c.prompt_index] for c in completions]
    return RolloutBatch(rows_prompt_ids, ids, mask, logps, versions, rewards, advantages, group_size)


def rl_step(c: RLComponents, state: LoopState) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One synchronous RL step; returns (metrics, samples)."""
    start = time.perf_counter()
    records = c.prompts.take(c.prompts_per_step)
    prompt_ids = [c.encode(r) for r in records]

    first = state.step * c.prompts_per_step  # a fresh, reproducible seed for every request of the run
    params = [c.sampling.for_request(first + i) for i in range(len(prompt_ids))]
    completions = c.generator.generate(prompt_ids, params)  # generate
    gen_s = time.perf_counter() - start
    # A sample the engine failed (finish_reason "error") is not a sample of the policy: its group
    # is left out of the batch, and counted.
    failed = {comp.prompt_index for comp in completions if comp.finish_reason == "error"}
    if failed:
        state.num_failed_groups += len(failed)
        first = next(comp for comp in completions if comp.finish_reason == "error")
        state.first_failure = state.first_failure or f"record {records[first.prompt_index].index}: {first.error}"
        kept = sorted(set(range(len(records))) - failed)
        renumber = {old: new for new, old in enumerate(kept)}
        records, prompt_ids = [records[i] for i in kept], [prompt_ids[i] for i in kept]
        completions = [comp for comp in completions if comp.prompt_index not in failed]
        for comp in completions:
            comp.prompt_index = renumber[comp.prompt_index]
    if not completions:  # nothing to train on: draw the next prompts (the step is not used up)
        state.num_empty_draws += 1
        if state.num_empty_draws >= MAX_EMPTY_DRAWS:
            raise RequestError(f"the engine failed every prompt of {MAX_EMPTY_DRAWS} batches in a row "
                               f"(step {state.step + 1}); first failure: {state.first_failure}")
        return rl_step(c, state)
    state.num_empty_draws = 0
    texts = [c.decode(comp.token_ids) for comp in completions]
    rows = [records[comp.prompt_index] for comp in completions]

    scored = c.rewards.score([r.prompt for r in rows], texts, [r.fields for r in rows])  # score
    state.note_reward_errors(scored.first_errors)
    rewards = torch.tensor(scored.totals, dtype=torch.float32)
    group_size = c.sampling.n
    lengths = torch.tensor([comp.num_tokens for comp in completions])  # [B] completion tokens
    advantages = c.advantage_fn(rewards, group_size, lengths=lengths)  # advantages

    batch = build_rollout_batch(prompt_ids, completions, rewards, advantages, group_size)
    lags = state.policy_version - torch.tensor([oldest_token_version(comp, state.policy_version)
                                                for comp in completions])  # [B], all 0 on-policy
    train_metrics = c.trainer.train_on(batch)  # loss -> optimizer step

    state.policy_version += 1
    state.step += 1
    state.num_samples += len(completions)
    c.generator.update_weights(c.trainer.model.named_parameters(), state.policy_version)  # weight sync

    num_gen_tokens = int(lengths.sum())
    step_s = time.perf_counter() - start
    lengths = lengths.float()
    metrics: dict[str, Any] = {
        **scored.metrics(), **train_metrics, **staleness_metrics(lags),
        "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
        "time/gen_s": gen_s, "time/step_s": step_s,
        "throughput/gen_tokens_per_s": num_gen_tokens / max(gen_s, 1e-9),  # the generation phase's rate
        "throughput/step_tokens_per_s": num_gen_tokens / max(step_s, 1e-9),  # the run's: as the async loop's
        "policy_version": state.policy_version, "rollout/num_failed": state.num_failed_groups,
        "num_samples": state.num_samples,
    }
    samples = [{"prompt": rows[i].prompt, "completion": texts[i], "reward": scored.totals[i]}
               for i in range(0, len(completions), max(group_size, 1))]
    return metrics, samples
