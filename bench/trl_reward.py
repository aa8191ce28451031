"""tether against TRL's ``GRPOTrainer`` on the demo task: wall-clock to the same reward.

    python bench/trl_reward.py [--sft-steps 800] [--rl-steps 200] [--variants sync_1t,s1]
                               [--sft-cache DIR] [--target R] [--window 10] [--out results.json] [--quick]
                               [--seed 0 | --seeds 0,1,2]

1. One SFT warm start of the demo's model (``tether.demo`` COMMON + SFT; cached under ``--sft-cache``
   with the same file names as ``bench/async_rl.py``), saved by tether as a Hugging Face checkpoint
   (``config.json`` + safetensors + the char tokenizer) that both frameworks load.
2. tether GRPO from it with the demo's GRPO hyper-parameters, once per variant of ``async_rl.VARIANTS``
   (default ``sync_1t``: synchronous, one torch thread; ``s1``: generator process and trainer with one
   thread each, staleness <= 1).
3. TRL ``GRPOTrainer`` from the same checkpoint with the same hyper-parameters, all read from the same
   tether config: lr and its schedule (the very same ``LambdaLR``: transformers' own warm-up starts
   at lr 0, one step behind tether's), AdamW (tether's ``build_optimizer``), grad clip, group size
   (``num_generations``), prompts per step (``per_device_train_batch_size`` = prompts x group, one
   generation and one optimizer step per batch), ``max_completion_length``, temperature, top-k/p,
   clip epsilon, ``beta=0``, ``loss_type="dapo"`` (tether's default ``token_mean``), fp32 on CPU, no
   gradient checkpointing, one torch thread (``--threads 2``: two for TRL and tether's ``sync``
   variant), the same 2,000 training prompts (bos-prefixed like tether's) and the task's own reward
   (``grpo_step.TaskReward``). Not equal, by design of each framework: the order in which prompts
   are drawn (each shuffles with the seed its own way), GRPO's std epsilon (TRL 1e-4, tether 1e-6),
   and generation (TRL calls ``model.generate`` on the training
   model; tether samples with its engine from a copy of the weights).

Clock: model loading is excluded on both sides; everything the framework does after it counts.
tether's clock runs around ``run_grpo`` (engine copy, generator process spawn, final save included);
``result.history`` has no timestamps, so the end of step i is taken as start-up + the sum of
``time/step_s`` up to i, with start-up = wall-clock of ``run_grpo`` minus the sum of all step times
(the final save lands in the start-up: conservative against tether). TRL's clock starts before
``GRPOTrainer(...)`` is built and a ``TrainerCallback`` stamps every ``on_step_end``; the reward of
a step is the mean of that step's single reward call.

Report: per-step rewards smoothed by a trailing mean over ``--window`` steps (defined from the
window-th step on), a target = 0.95 x the lowest best smoothed reward of all systems (or
``--target``), the first wall-clock at which each system's smoothed reward reaches it and the ratio
TRL / tether per variant; also total wall-clock, mean s/step and final smoothed reward.

``--seeds 0,1,2``: the whole comparison once per seed (each seed its own warm start), a report per
seed, then the same report on the systems' mean curves over the seeds (per step: the mean reward
and the mean wall-clock at its end), whose target and time to target one RL run's noise moves less.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from async_rl import VARIANTS, start_generator_server, timed_grpo, warm_start  # noqa: E402
from common import MachineInfo, machine_info, require_trl, set_threads  # noqa: E402
from grpo_step import TaskReward  # noqa: E402
from tether.builders import build_model_and_tokenizer, build_prompt_data  # noqa: E402
from tether.config import ExperimentConfig, load_config  # noqa: E402
from tether.demo import COMMON, GRPO  # noqa: E402
from tether.models.checkpoint import save_model  # noqa: E402
from tether.training.optim import build_optimizer, build_scheduler  # noqa: E402

TARGET_FRACTION = 0.95  # of the lowest best smoothed reward: every system reaches the target
QUICK = {"sft_steps": 10, "rl_steps": 3, "window": 2}


@dataclass(frozen=True, slots=True)
class Settings:
    sft_steps: int = 800  # the demo's warm start
    rl_steps: int = 200  # the demo's GRPO run
    variants: tuple[str, ...] = ("sync_1t", "s1")
    window: int = 10
    target: float | None = None
    seed: int = 0
    sft_cache: str | None = None
    out: str | None = None
    threads: int = 1  # torch threads of TRL and of tether's ``sync`` variant (``sync_1t``, ``s1``: 1 per process)
    seeds: tuple[int, ...] = ()  # --seeds: one comparison per seed, then the mean curves


@dataclass(slots=True)
class Curve:
    """One system's run: what it reached and when."""

    name: str
    rewards: list[float]  # [steps] mean reward of the samples each step trained on
    ends_s: list[float]  # [steps] wall-clock from the clock's start to the end of each step
    total_s: float  # clock start -> the trainer returned
    startup_s: float  # clock start -> first step began
    completion_tokens: list[float]  # [steps] mean completion length of each step's samples

    def smoothed(self, window: int) -> list[float]:
        """[steps - window + 1] trailing means: entry j covers steps j .. j + window - 1."""
        return [statistics.fmean(self.rewards[i - window + 1:i + 1]) for i in range(window - 1, len(self.rewards))]

    def time_to(self, target: float, window: int) -> float | None:
        """Wall-clock at the end of the first window whose mean reaches ``target`` (None: never)."""
        for j, value in enumerate(self.smoothed(window)):
            if value >= target:
                return self.ends_s[j + window - 1]
        return None

    @property
    def mean_step_s(self) -> float:
        return (self.ends_s[-1] - self.startup_s) / len(self.ends_s)


def parse_args(argv: Sequence[str] | None = None) -> Settings:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = Settings()
    p.add_argument("--sft-steps", type=int, default=d.sft_steps, help="SFT warm-start steps")
    p.add_argument("--rl-steps", type=int, default=d.rl_steps, help="GRPO steps of every system")
    p.add_argument("--variants", default=",".join(d.variants), help=f"tether variants: {', '.join(VARIANTS)}")
    p.add_argument("--window", type=int, default=d.window, help="steps in the reward smoothing window")
    p.add_argument("--target", type=float, default=None, help=f"target smoothed reward (default: "
                   f"{TARGET_FRACTION} x the lowest best smoothed reward)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--seeds", default="", help="comma-separated seeds: a comparison per seed, then one "
                   "over the mean curves (overrides --seed)")
    p.add_argument("--sft-cache", default=None, help="directory keeping the warm-started weights")
    p.add_argument("--out", default=None, help="write curves and settings as JSON here")
    p.add_argument("--quick", action="store_true", help=f"smoke-test size: {QUICK}")
    p.add_argument("--threads", type=int, default=d.threads,
                   help="torch threads for TRL and tether's `sync` variant (compare `sync` with TRL at 2)")
    a = p.parse_args(argv)
    sizes = QUICK if a.quick else {"sft_steps": a.sft_steps, "rl_steps": a.rl_steps, "window": a.window}
    variants = tuple(v for v in a.variants.split(",") if v)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        p.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    if sizes["sft_steps"] < 1 or sizes["rl_steps"] < 1 or not 1 <= sizes["window"] <= sizes["rl_steps"]:
        p.error(f"need --sft-steps >= 1, --rl-steps >= 1, 1 <= --window <= --rl-steps; got {sizes}")
    if a.threads < 1:
        p.error(f"--threads must be >= 1, got {a.threads}")
    try:
        seeds = tuple(int(x) for x in a.seeds.split(",") if x.strip())
    except ValueError:
        p.error(f"--seeds must be comma-separated integers, got {a.seeds!r}")
    return Settings(sizes["sft_steps"], sizes["rl_steps"], variants, sizes["window"], a.target,
                    seeds[0] if seeds else a.seed, a.sft_cache, a.out, a.threads, seeds)


def grpo_config(s: Settings, variant: str) -> ExperimentConfig:
    return load_config(None, [*COMMON, *GRPO, f"seed={s.seed}", f"trainer.max_steps={s.rl_steps}",
                              "logging.progress=none", *VARIANTS[variant]])


def sft_checkpoint(s: Settings, root: Path) -> Path:
    """The warm-started demo model as a Hugging Face directory both frameworks load."""
    model, tokenizer = warm_start(s.sft_steps, s.seed, root, Path(s.sft_cache) if s.sft_cache else None)
    directory = save_model(model, root / "sft-hf")
    tokenizer.save_pretrained(directory)
    return directory


# ---------------------------------------------------------------------------------------------- tether


def run_tether(s: Settings, checkpoint: Path, variant: str, root: Path) -> Curve:
    config = grpo_config(s, variant)
    model, tokenizer = build_model_and_tokenizer(config.model, str(checkpoint), config.seed)  # off the clock
    result, total_s = timed_grpo(config, root / variant, model, tokenizer)
    step_s = [m["time/step_s"] for m in result.history]
    startup_s = total_s - sum(step_s)
    ends_s, elapsed = [], startup_s
    for seconds in step_s:
        elapsed += seconds
        ends_s.append(elapsed)
    return Curve(variant, [float(m["reward/mean"]) for m in result.history], ends_s, total_s, startup_s,
                 [float(m["response_length/mean"]) for m in result.history])


# ------------------------------------------------------------------------------------------------- TRL


class RecordedReward:
    """``TaskReward`` that also keeps the mean reward of every call: one call per step, since every
    step generates its own batch (``steps_per_generation=1``)."""

    __name__ = TaskReward.__name__  # TRL names reward metrics after the function

    def __init__(self, reward: TaskReward) -> None:
        self.reward = reward
        self.means: list[float] = []

    def __call__(self, *args: Any, **kwargs: Any) -> list[float]:
        values = self.reward(*args, **kwargs)
        self.means.append(statistics.fmean(values))
        return values


def trl_args(config: ExperimentConfig, output_dir: Path) -> Any:
    """``GRPOConfig`` with tether's hyper-parameters (TRL's defaults differ: see the module docstring)."""
    from trl import GRPOConfig

    r, t, a = config.rollout, config.trainer, config.algorithm
    return GRPOConfig(
        output_dir=str(output_dir), use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=r.prompts_per_step * r.group_size, gradient_accumulation_steps=1,
        steps_per_generation=1, num_generations=r.group_size, max_completion_length=r.max_new_tokens,
        temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, learning_rate=t.lr,
        # Documentation only: the scheduler passed to the trainer is tether's (same warm-up step).
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": t.min_lr_ratio},
        warmup_steps=t.warmup_steps, max_grad_norm=t.grad_clip, max_steps=t.max_steps, beta=a.kl_coef,
        num_iterations=a.epochs_per_batch, epsilon=a.clip_low, epsilon_high=a.clip_high, loss_type="dapo",
        scale_rewards="group", logging_steps=10**6, report_to="none", save_strategy="no",
        disable_tqdm=True, seed=config.seed, dataloader_num_workers=0)


def run_trl(s: Settings, checkpoint: Path, root: Path) -> Curve:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.begin_s = 0.0
            self.ends_s: list[float] = []

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.begin_s = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.ends_s.append(time.perf_counter())

    config = grpo_config(s, "sync_1t")  # the hyper-parameters; TRL has no async mode
    data = build_prompt_data(config.data, config.seed)
    assert data.task is not None
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    # tether's prompts are [bos] + text; the bos token's text makes TRL's tokenisation the same.
    rows = [{"prompt": tokenizer.bos_token + r.prompt, "answer": r.fields["answer"]} for r in data.train]
    torch.manual_seed(config.seed)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)  # off the clock
    clock, reward = StepClock(), RecordedReward(TaskReward(data.task))
    t = config.trainer
    start = time.perf_counter()
    optimizer = build_optimizer(model.parameters(), t.lr, t.weight_decay, t.betas)
    scheduler = build_scheduler(optimizer, warmup_steps=t.warmup_steps, max_steps=t.max_steps,
                                schedule=t.schedule, min_lr_ratio=t.min_lr_ratio)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=trl_args(config, root / "trl"),
                          train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                          callbacks=[clock], optimizers=(optimizer, scheduler))
    trainer.train()
    total_s = time.perf_counter() - start
    return Curve("trl", reward.means, [e - start for e in clock.ends_s], total_s, clock.begin_s - start,
                 reward.reward.mean_tokens_per_call)


# ------------------------------------------------------------------------------------------------ main


def target_reward(s: Settings, curves: Sequence[Curve]) -> float:
    if s.target is not None:
        return s.target
    return TARGET_FRACTION * min(max(c.smoothed(s.window)) for c in curves)


def fmt(seconds: float | None) -> str:
    return "not reached" if seconds is None else f"{seconds:.1f}"


def ratio(numerator: float | None, denominator: float | None) -> str:
    return "n/a" if numerator is None or denominator is None else f"{numerator / denominator:.2f}x"


def report(s: Settings, machine: MachineInfo, tether: Sequence[Curve], trl: Curve) -> str:
    target = target_reward(s, [*tether, trl])
    trl_time = trl.time_to(target, s.window)
    lines = [f"machine: {machine.describe()}, load average {machine.load_average:.2f}",
             f"date: {machine.date_utc}",
             f"demo task, {s.sft_steps} SFT steps, {s.rl_steps} GRPO steps; smoothing window {s.window}; "
             f"target smoothed reward {target:.3f}", "",
             "| system | time to target s | TRL / tether (target) | total s | TRL / tether (total) | "
             "start-up s | mean s/step | best smoothed | final smoothed | mean completion tokens |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in [*tether, trl]:
        to_target = c.time_to(target, s.window)
        smooth = c.smoothed(s.window)
        is_trl = c is trl
        lines.append(f"| {c.name} | {fmt(to_target)} | {'-' if is_trl else ratio(trl_time, to_target)} | "
                     f"{c.total_s:.1f} | {'-' if is_trl else ratio(trl.total_s, c.total_s)} | "
                     f"{c.startup_s:.1f} | {c.mean_step_s:.3f} | {max(smooth):.3f} | {smooth[-1]:.3f} | "
                     f"{statistics.fmean(c.completion_tokens):.2f} |")
    lines.append("")
    lines.append(f"load average (1 min) at start / end: {machine.load_average:.2f} / "
                 f"{os.getloadavg()[0]:.2f}")
    for c in tether:
        lines.append(f"ratio trl / {c.name} time to target: {ratio(trl_time, c.time_to(target, s.window))}; "
                     f"total: {ratio(trl.total_s, c.total_s)}")
    return "\n".join(lines)


def mean_curve(curves: Sequence[Curve]) -> Curve:
    """One system's runs over several seeds as one curve: per step the mean reward and the mean
    wall-clock at its end (every run has the same number of steps)."""
    def mean(rows: Sequence[Sequence[float]]) -> list[float]:
        return [statistics.fmean(column) for column in zip(*rows, strict=True)]

    return Curve(curves[0].name, mean([c.rewards for c in curves]), mean([c.ends_s for c in curves]),
                 statistics.fmean(c.total_s for c in curves), statistics.fmean(c.startup_s for c in curves),
                 mean([c.completion_tokens for c in curves]))


def compare(s: Settings) -> tuple[MachineInfo, list[Curve], Curve]:
    """One seed's comparison: warm start, every tether variant, then TRL."""
    machine = machine_info()
    print(f"machine: {machine.describe()}; seed {s.seed}", flush=True)
    start_generator_server(list(s.variants))  # after the matmul measurement, which it would slow
    with tempfile.TemporaryDirectory(prefix="tether-trl-reward-") as tmp:
        root = Path(tmp)
        start = time.perf_counter()
        checkpoint = sft_checkpoint(s, root)
        print(f"SFT warm start: {s.sft_steps} steps, {time.perf_counter() - start:.0f}s", flush=True)
        tether = []
        for variant in s.variants:
            tether.append(run_tether(s, checkpoint, variant, root))
            print(f"tether {variant}: {tether[-1].total_s:.1f}s", flush=True)
        trl = run_trl(s, checkpoint, root)
        print(f"trl: {trl.total_s:.1f}s", flush=True)
    return machine, tether, trl


def main(argv: Sequence[str] | None = None) -> None:
    s = parse_args(argv)
    require_trl()
    set_threads(s.threads)  # TRL and `sync`; `sync_1t` and the async variants set their own
    runs = []
    for seed in s.seeds or (s.seed,):
        seeded = dataclasses.replace(s, seed=seed)
        machine, tether, trl = compare(seeded)
        print(f"\n### seed {seed}\n", flush=True)
        print(report(seeded, machine, tether, trl), flush=True)
        runs.append({"seed": seed, "machine": machine, "curves": [*tether, trl]})
    means = None
    if len(runs) > 1:
        means = [mean_curve([run["curves"][i] for run in runs]) for i in range(len(runs[0]["curves"]))]
        print(f"\n### mean curves over seeds {', '.join(str(run['seed']) for run in runs)}\n", flush=True)
        print(report(s, runs[0]["machine"], means[:-1], means[-1]), flush=True)
    if s.out:
        def encode(run: dict[str, Any]) -> dict[str, Any]:
            return {"seed": run["seed"], "machine": asdict(run["machine"]),
                    "curves": [asdict(c) for c in run["curves"]]}

        # "machine" and "curves": the first seed's run, as a single-seed run has always written them.
        payload = {**encode(runs[0]), "settings": asdict(s), "runs": [encode(run) for run in runs]}
        if means is not None:
            payload["mean_curves"] = [asdict(c) for c in means]
        Path(s.out).write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
