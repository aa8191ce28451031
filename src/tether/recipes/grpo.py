"""The GRPO recipe (synchronous, on-policy): config in, trained policy in ``RUN_DIR/final`` out."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tether.algorithms.registry import ADVANTAGES
from tether.builders import (
    build_generator,
    build_model_and_tokenizer,
    build_prompt_data,
    build_rewards,
    seed_everything,
)
from tether.config import ExperimentConfig
from tether.data.cursor import DataCursor
from tether.data.tokenize import tokenize_prompt
from tether.engine.types import SamplingParams
from tether.metrics import MetricsWriter
from tether.models.checkpoint import save_model
from tether.progress import make_progress
from tether.rollout.sync_loop import LoopState, RLComponents, rl_step
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


def policy_settings(config: ExperimentConfig) -> PolicyLossSettings:
    a, t = config.algorithm, config.trainer
    return PolicyLossSettings(
        policy_loss=a.policy_loss, loss_agg=a.loss_agg, clip_low=a.clip_low, clip_high=a.clip_high,
        kl_coef=a.kl_coef, kl_estimator=a.kl_estimator, epochs_per_batch=a.epochs_per_batch,
        correction=a.correction, correction_cap=a.correction_cap, micro_batch_tokens=t.micro_batch_tokens,
        grad_clip=t.grad_clip)


def sampling_params(config: ExperimentConfig, tokenizer: Any) -> SamplingParams:
    r = config.rollout
    return SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
                          max_new_tokens=r.max_new_tokens, n=r.group_size,
                          stop_token_ids=(tokenizer.eos_token_id,), seed=config.seed)


def build_components(config: ExperimentConfig, model: Any, tokenizer: Any) -> RLComponents:
    data = build_prompt_data(config.data, config.seed)
    t, r = config.trainer, config.rollout
    optimizer = build_optimizer(model.parameters(), t.lr, t.weight_decay, t.betas)
    scheduler = build_scheduler(optimizer, warmup_steps=t.warmup_steps, max_steps=t.max_steps,
                                schedule=t.schedule, min_lr_ratio=t.min_lr_ratio)
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if config.algorithm.kl_coef > 0 else None
    trainer = PolicyTrainer(model, optimizer, scheduler, policy_settings(config),
                            SamplingView(r.temperature, r.top_k, r.top_p), ref_model=ref_model)
    return RLComponents(
        generator=build_generator(model, tokenizer), trainer=trainer,
        rewards=build_rewards(config, data.task), prompts=DataCursor(data.train, seed=config.seed),
        encode=lambda record: tokenize_prompt(record, tokenizer),
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        advantage_fn=ADVANTAGES.get(config.algorithm.advantage),
        sampling=sampling_params(config, tokenizer), prompts_per_step=r.prompts_per_step)


def run_grpo(config: ExperimentConfig, run_dir: Path, model: Any = None, tokenizer: Any = None) -> GRPOResult:
    seed_everything(config.seed)
    if model is None:
        model, tokenizer = build_model_and_tokenizer(config.model, config.init_from, config.seed)
    components = build_components(config, model, tokenizer)
    state = LoopState()
    history: list[dict[str, Any]] = []
    progress = make_progress(config.logging.progress, config.trainer.max_steps, "grpo",
                             config.logging.log_every)
    with MetricsWriter(run_dir, progress) as writer:
        while state.step < config.trainer.max_steps:
            metrics, samples = rl_step(components, state)
            writer.log(state.step, metrics)
            writer.log_samples(state.step, samples[: config.logging.samples_per_step])
            history.append(metrics)
    final_dir = run_dir / "final"
    save_model(model, final_dir)
    tokenizer.save_pretrained(final_dir)
    return GRPOResult(run_dir, final_dir, history, model, tokenizer)
