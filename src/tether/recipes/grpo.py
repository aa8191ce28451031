"""The GRPO recipe: config in, trained policy in ``RUN_DIR/final`` out.

``rollout.mode=sync`` runs ``rl_step`` (generate a batch, train, sync weights); with over-sampling
or dynamic sampling it runs the asynchronous driver in-process with staleness 0, which gives the
same on-policy guarantee. ``rollout.mode=async`` runs the generator in its own process
(``tether.rollout.local_backend``) and the trainer here, within ``rollout.max_staleness``; while
that process starts, this one generates (``rollout.generate_during_boot``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tether.algorithms.registry import ADVANTAGES
from tether.builders import (
    PromptData,
    build_generator,
    build_model_and_tokenizer,
    build_prompt_data,
    build_rewards,
    eos_token_ids,
    seed_everything,
    torch_threads,
)
from tether.config import ExperimentConfig
from tether.data.cursor import DataCursor
from tether.data.records import PromptRecord
from tether.data.tokenize import tokenize_prompt
from tether.engine.config import EngineConfig
from tether.engine.engine import LLMEngine
from tether.engine.requests import resolve_max_model_len
from tether.engine.types import SamplingParams
from tether.errors import ConfigError, DataError, TetherError
from tether.metrics import MetricsWriter
from tether.models.checkpoint import save_checkpoint
from tether.models.config import ModelConfig
from tether.progress import make_progress
from tether.rewards.compute import RewardComputer
from tether.rewards.loader import check_called_per_sample
from tether.rollout.async_loop import AsyncRLComponents, async_rl_step
from tether.rollout.buffer import RolloutBuffer
from tether.rollout.generator_worker import GeneratorSettings, GeneratorWorker
from tether.rollout.local_backend import (
    GeneratorCrashedError,
    GeneratorTransport,
    HandoverTransport,
    InProcessTransport,
    ProcessTransport,
)
from tether.rollout.process_server import start_process_server
from tether.rollout.sync_loop import LoopState, RLComponents, rl_step
from tether.rollout.weights import SharedWeights, decoder_from_weights
from tether.runs import GENERATOR_ERROR_LOG
from tether.training.optim import build_optimizer, build_scheduler
from tether.training.policy import PolicyLossSettings, PolicyTrainer
from tether.training.scoring import SamplingView


@dataclass(slots=True)
class GRPOResult:
    run_dir: Path
    final_dir: Path
    history: list[dict[str, Any]]
    model: Any
    tokenizer: Any


def resolved_policy_loss(config: ExperimentConfig) -> str:
    """``auto``: ppo_clip on-policy (sync), decoupled PPO when samples may be stale (async)."""
    if config.algorithm.policy_loss != "auto":
        return config.algorithm.policy_loss
    return "decoupled_ppo" if config.rollout.mode == "async" else "ppo_clip"


def is_partial_rollouts(config: ExperimentConfig) -> bool:
    """``rollout.partial_rollouts``, by default on where samples may be stale: the bound in force
    (``max_staleness``: 0 in sync mode, whatever ``rollout.max_staleness`` says) or oversampling."""
    r = config.rollout
    return r.partial_rollouts if r.partial_rollouts is not None else (max_staleness(config) > 0 or r.oversample > 0)


def max_staleness(config: ExperimentConfig) -> int:
    """The staleness bound in force: ``rollout.max_staleness`` in async mode; sync is on-policy (0)."""
    return config.rollout.max_staleness if config.rollout.mode == "async" else 0


def uses_async_driver(config: ExperimentConfig) -> bool:
    r = config.rollout
    return r.mode == "async" or r.oversample > 0 or r.dynamic_sampling


def policy_settings(config: ExperimentConfig) -> PolicyLossSettings:
    a, t = config.algorithm, config.trainer
    return PolicyLossSettings(
        policy_loss=resolved_policy_loss(config), proximal=a.proximal, loss_agg=a.loss_agg,
        clip_low=a.clip_low, clip_high=a.clip_high,
        kl_coef=a.kl_coef, kl_estimator=a.kl_estimator, epochs_per_batch=a.epochs_per_batch,
        correction=a.correction, correction_cap=a.correction_cap, micro_batch_tokens=t.micro_batch_tokens,
        grad_clip=t.grad_clip, share_prompts=t.share_prompts, max_completion_len=config.rollout.max_new_tokens)


def checkpoint_of(config: ExperimentConfig) -> str | None:
    """The checkpoint directory the policy starts from (None: built from scratch)."""
    return config.init_from or config.model.path


def sampling_params(config: ExperimentConfig, tokenizer: Any) -> SamplingParams:
    r = config.rollout
    return SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
                          max_new_tokens=r.max_new_tokens, n=r.group_size,
                          stop_token_ids=eos_token_ids(tokenizer, checkpoint_of(config)), seed=config.seed)


def build_trainer(config: ExperimentConfig, model: Any) -> PolicyTrainer:
    t, r = config.trainer, config.rollout
    optimizer = build_optimizer(model.parameters(), t.lr, t.weight_decay, t.betas)
    scheduler = build_scheduler(optimizer, warmup_steps=t.warmup_steps, max_steps=t.max_steps,
                                schedule=t.schedule, min_lr_ratio=t.min_lr_ratio)
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if config.algorithm.kl_coef > 0 else None
    return PolicyTrainer(model, optimizer, scheduler, policy_settings(config),
                         SamplingView(r.temperature, r.top_k, r.top_p), ref_model=ref_model)


def engine_context_len(config: ExperimentConfig, model: Any) -> int:
    """Prompt + completion tokens the rollout engine will hold per sequence, as the engine resolves it."""
    return resolve_max_model_len(EngineConfig(**config.engine.model_dump()), model.config.context_length)


def rl_prompt_data(config: ExperimentConfig, model: Any, tokenizer: Any) -> tuple[PromptData, list[PromptRecord], int]:
    """The run's prompts without the training prompts that leave no room for a completion (empty
    once tokenized, or as long as the engine's context): (the data, the prompts skipped, the longest
    prompt kept in tokens). verl's ``filter_overlong_prompts`` does the same; the engine would fail
    each of them, every epoch."""
    context = engine_context_len(config, model)
    if config.rollout.max_new_tokens >= context:  # every sample would be cut short, silently
        raise ConfigError(f"rollout.max_new_tokens={config.rollout.max_new_tokens} leaves no room for a prompt in "
                          f"the engine's context of {context} tokens (engine.max_model_len, else the model's "
                          "max_position_embeddings)")
    data = build_prompt_data(config.data, config.seed)
    kept: list[PromptRecord] = []
    skipped: list[PromptRecord] = []
    longest = 0
    for record in data.train:
        try:
            num_tokens = len(tokenize_prompt(record, tokenizer))
        except TetherError as error:  # e.g. chat prompts for a tokenizer without a chat template
            where = record.where or f"{_train_source(config)}: record {record.index}"
            raise DataError(f"{where}: {error}") from None
        if 0 < num_tokens < context:
            kept.append(record)
            longest = max(longest, num_tokens)
        else:
            skipped.append(record)
    if not kept:
        raise DataError(f"{_train_source(config)}: none of the {len(data.train)} training prompts leaves room for "
                        f"a completion in the engine's context of {context} tokens (engine.max_model_len)")
    return dataclasses.replace(data, train=kept), skipped, longest


def rollout_kv_tokens(config: ExperimentConfig, longest_prompt: int) -> int:
    """The most KV tokens the run's rollouts hold at once, which caps the engine's pool
    (``EngineConfig.max_kv_tokens``): every sequence that may be running (the groups started within
    the staleness window and over-sampling, times the group size) at the longest prompt plus
    ``rollout.max_new_tokens``, in whole blocks, and no more sequences than ``engine.max_num_seqs``.
    Sharing a group's prompt only lowers it. The pool was sized from free memory alone: 3.2 GB of
    zeros for a run that needed 60 tokens of KV."""
    r, block = config.rollout, config.engine.block_size
    num_seqs = ((max_staleness(config) + 1) * r.prompts_per_step + r.oversample) * r.group_size
    num_seqs = min(num_seqs, config.engine.max_num_seqs)  # the most the scheduler runs at once
    return num_seqs * -(-(longest_prompt + r.max_new_tokens) // block) * block


def _train_source(config: ExperimentConfig) -> str:
    return f"data.task={config.data.task}" if config.data.task else f"data.train={config.data.train}"


@dataclass(frozen=True, slots=True)
class RunInputs:
    """What ``check_run_inputs`` resolved; the components built in the same process reuse it."""

    data: PromptData
    rewards: RewardComputer
    longest_prompt: int  # tokens: with the rollout settings, the most KV the engine can hold


def reward_text(tokenizer: Any, token_ids: list[int]) -> str:
    """The completion text reward functions get: its ids decoded alone, special tokens left out, as
    TRL and verl give it (a format reward ported from them, ``^<think>``, matches the same text). It
    can differ from the text stop strings match and ``tether generate`` writes (``completion_text``,
    vLLM's) by the first word's space under a Llama 2 or Mistral tokenizer."""
    return tokenizer.decode(token_ids, skip_special_tokens=True)


def _data_and_longest(config: ExperimentConfig, model: Any, tokenizer: Any,
                      inputs: RunInputs | None) -> tuple[PromptData, int]:
    if inputs is not None:
        return inputs.data, inputs.longest_prompt
    data, _, longest = rl_prompt_data(config, model, tokenizer)
    return data, longest


def check_run_inputs(config: ExperimentConfig, model: Any, tokenizer: Any) -> RunInputs:
    """The run's prompts, resolved with the reward functions here, in the caller's process, before
    any generator process starts: a bad data file or reward spec is a one-line error at once, and
    skipped prompts are reported once. The components built in this process reuse the result."""
    data, skipped, longest = rl_prompt_data(config, model, tokenizer)
    rewards = build_rewards(config, data.task)  # imports the user's reward modules, once here
    field_names = dict.fromkeys(key for record in data.train for key in record.fields)  # of every row
    for index, (spec, reward) in enumerate(zip(config.rewards, rewards.rewards, strict=True)):
        check_called_per_sample(reward.fn, f"rewards.{index}.fn={spec.fn}", field_names)
    if skipped:
        context = engine_context_len(config, model)
        print(f"warning: {_train_source(config)}: skipped {len(skipped)} of {len(skipped) + len(data.train)} "
              f"training prompts that leave no room for a completion in the engine's context of {context} "
              f"tokens (empty, or {context} tokens or more); the first is "
              f"{skipped[0].where or f'record {skipped[0].index}'}",
              file=sys.stderr)
    return RunInputs(data, rewards, longest)


def _report_first_failures(state: LoopState, components: Any, reported: set[str]) -> None:
    """One warning line, the first time each kind of failure happens, each reward function's apart
    (the metrics count them all)."""
    engine_failure = state.first_failure
    if isinstance(components, AsyncRLComponents):
        engine_failure = components.transport.counters.first_failure
    messages = {
        "engine": engine_failure and f"a sample failed in the engine, its group is left out of training "
                                     f"(rollout/num_failed counts them): {engine_failure}",
        **{f"reward {name}": f"a reward function failed, that score is 0 (reward/errors counts them): {message}"
           for name, message in state.first_reward_errors.items()},
    }
    for kind, message in messages.items():
        if message and kind not in reported:
            reported.add(kind)
            print(f"warning: {message}", file=sys.stderr)


def build_components(config: ExperimentConfig, model: Any, tokenizer: Any,
                     inputs: RunInputs | None = None) -> RLComponents:
    data, longest = _data_and_longest(config, model, tokenizer, inputs)
    return RLComponents(
        generator=_rollout_engine(config, model, tokenizer, longest),
        trainer=build_trainer(config, model),
        rewards=inputs.rewards if inputs is not None else build_rewards(config, data.task),
        prompts=DataCursor(data.train, seed=config.seed),
        encode=lambda record: tokenize_prompt(record, tokenizer),
        decode=functools.partial(reward_text, tokenizer),
        advantage_fn=ADVANTAGES.get(config.algorithm.advantage),
        sampling=sampling_params(config, tokenizer), prompts_per_step=config.rollout.prompts_per_step)


def build_generator_worker(config: ExperimentConfig, model: Any, tokenizer: Any,
                           inputs: RunInputs | None = None, *, owns_model: bool = False,
                           is_startup: bool = False) -> GeneratorWorker:
    """The generator role from config (``inputs``: the prompts and rewards when this process has
    resolved them already; ``owns_model``: the engine may keep ``model`` rather than copy it;
    ``is_startup``: the trainer's worker that generates until the generator process is ready)."""
    data, longest = _data_and_longest(config, model, tokenizer, inputs)
    r = config.rollout
    settings = GeneratorSettings(
        sampling=sampling_params(config, tokenizer), groups_per_batch=r.prompts_per_step,
        max_staleness=max_staleness(config), num_extra_groups=r.oversample,
        is_partial_rollouts=is_partial_rollouts(config), is_dynamic_sampling=r.dynamic_sampling)
    return GeneratorWorker(
        # the start-up worker lives seconds; the process's engine is the one whose pool counts
        _rollout_engine(config, model, tokenizer, longest, owns_model=owns_model, warn=not is_startup),
        DataCursor(data.train, seed=config.seed),
        inputs.rewards if inputs is not None else build_rewards(config, data.task),
        lambda record: tokenize_prompt(record, tokenizer),
        functools.partial(reward_text, tokenizer), settings)


def _rollout_engine(config: ExperimentConfig, model: Any, tokenizer: Any, longest_prompt: int, *,
                    owns_model: bool = False, warn: bool = True) -> LLMEngine:
    """The rollouts' engine, its KV pool capped at what they can hold at once; ``warn``: one line when
    the memory budget gives less, since the sequences are then preempted and recomputed (correct,
    slower), which nothing else would show."""
    need = rollout_kv_tokens(config, longest_prompt)
    engine = build_generator(model, tokenizer, config.engine, checkpoint_of(config), owns_model=owns_model,
                             max_kv_tokens=need)
    have = engine.block_manager.num_blocks * engine.config.block_size
    if warn and have < need:
        print(f"warning: the KV pool holds {have} tokens; the rollouts may need up to {need} at once (their "
              "sequences at the longest prompt + rollout.max_new_tokens): some will be preempted and recomputed, "
              "which is slower; raise engine.kv_cache_bytes or engine.kv_cache_memory_fraction", file=sys.stderr)
    return engine


def build_process_generator_worker(config: ExperimentConfig, model_config: ModelConfig, device: torch.device,
                                   tokenizer: Any, weights: SharedWeights) -> GeneratorWorker:
    """The generator process's worker (module-level and picklable: the process calls it): its model
    is built from the weights' version 0, the trainer's weights at the start; no copy of the model
    is pickled to the process."""
    model = decoder_from_weights(model_config, weights, device)
    return build_generator_worker(config, model, tokenizer, owns_model=True)


def generator_process_modules(tokenizer: Any = None) -> list[str]:
    """What a generator process imports to unpickle and build its worker: this recipe (and through it
    the engine, rewards and data) and the tokenizer's class (the character tokenizer's if None)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer_class = PreTrainedTokenizerFast if tokenizer is None else type(tokenizer)
    return [__name__, tokenizer_class.__module__]


def start_generator_process_server(config: ExperimentConfig, tokenizer: Any = None) -> None:
    """For an asynchronous run, start the server its generator process forks from
    (``tether.rollout.process_server.start_process_server``) now, so that its imports overlap the
    caller's own set-up (model, data, an SFT stage) instead of delaying the generator's start."""
    if config.rollout.mode == "async":
        start_process_server(generator_process_modules(tokenizer))


def thread_split(config: ExperimentConfig) -> tuple[int, int]:
    """(trainer threads, generator threads) for async mode: 0 means half of the cores each."""
    half = max(1, (os.cpu_count() or 2) // 2)
    return config.trainer.num_threads or half, config.rollout.generator_threads or half


def build_async_components(config: ExperimentConfig, model: Any, tokenizer: Any,
                           inputs: RunInputs | None = None) -> AsyncRLComponents:
    r = config.rollout
    transport: GeneratorTransport
    if r.mode == "async":
        start_generator_process_server(config, tokenizer)  # a no-op when the caller started it sooner
        weights = SharedWeights(model.named_parameters(), int(r.weight_bucket_mb * (1 << 20)))
        make_worker = functools.partial(build_process_generator_worker, config, model.config,
                                        next(model.parameters()).device, tokenizer, weights)
        remote = ProcessTransport(make_worker, weights, num_threads=thread_split(config)[1],
                                  wait_for_handover=r.generate_during_boot)
        # Started first, so that it boots while the trainer's process builds its own worker.
        try:
            transport = (HandoverTransport(build_generator_worker(config, model, tokenizer, inputs, is_startup=True),
                                           remote)
                         if r.generate_during_boot else remote)
            trainer = build_trainer(config, model)
        except BaseException:
            remote.close()  # not left waiting for a hand-over that will never come
            raise
    else:
        transport = InProcessTransport(build_generator_worker(config, model, tokenizer, inputs))
        trainer = build_trainer(config, model)
    return AsyncRLComponents(transport, trainer, RolloutBuffer(max_staleness(config)),
                             ADVANTAGES.get(config.algorithm.advantage), groups_per_batch=r.prompts_per_step,
                             group_size=r.group_size)


def run_grpo(config: ExperimentConfig, run_dir: Path, model: Any = None, tokenizer: Any = None) -> GRPOResult:
    seed_everything(config.seed)
    if model is None:
        model, tokenizer = build_model_and_tokenizer(config.model, config.init_from, config.seed)
    state = LoopState()
    history: list[dict[str, Any]] = []
    progress = make_progress(config.logging.progress, config.trainer.max_steps, "grpo",
                             config.logging.log_every)
    inputs = check_run_inputs(config, model, tokenizer)
    if uses_async_driver(config):
        components: Any = build_async_components(config, model, tokenizer, inputs)
        step_fn: Any = async_rl_step
    else:
        components, step_fn = build_components(config, model, tokenizer, inputs), rl_step
    # The trainer's threads (async: its share of the cores; the generator process has the rest).
    trainer_threads = thread_split(config)[0] if config.rollout.mode == "async" else config.trainer.num_threads
    try:
        with torch_threads(trainer_threads), MetricsWriter(run_dir, progress) as writer:
            reported: set[str] = set()
            while state.step < config.trainer.max_steps:
                metrics, samples = step_fn(components, state)
                writer.log(state.step, metrics)
                _report_first_failures(state, components, reported)
                writer.log_samples(state.step, samples[: config.logging.samples_per_step])
                history.append(metrics)
    except GeneratorCrashedError as error:
        if not error.traceback:
            raise
        log = run_dir / GENERATOR_ERROR_LOG  # the whole traceback; the error stays one line
        log.write_text(error.traceback)
        raise GeneratorCrashedError(f"{error} (its traceback: {log})", error.traceback) from None
    finally:
        if isinstance(components, AsyncRLComponents):
            components.transport.close()
    final_dir = run_dir / "final"
    save_checkpoint(model, tokenizer, final_dir, source=checkpoint_of(config))
    return GRPOResult(run_dir, final_dir, history, model, tokenizer)
