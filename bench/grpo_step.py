"""tether's synchronous GRPO step against TRL's ``GRPOTrainer``: same checkpoint, same work, same run.

    python bench/grpo_step.py [--steps 5] [--warmup 1] [--threads 0] [--rounds 1]

One tiny Qwen2 checkpoint is written by transformers' ``save_pretrained`` (with tether's char
tokenizer); both trainers load it and run ``warmup + steps`` GRPO steps on the built-in ``arith``
task. One step on each side is: generate ``prompts_per_step x group_size`` completions -> score ->
group-normalised advantages -> clipped policy loss over completion tokens (token mean) -> one
AdamW step. Made equal on purpose (TRL's defaults differ):

* completions per optimizer step: TRL's ``per_device_train_batch_size`` counts completions, so it
  is ``prompts_per_step * group_size`` with one accumulation step and one generation per step;
  tether trains the batch as one micro-batch too (a token budget larger than the batch);
* no reference model (``beta=0`` / ``kl_coef=0``), one epoch per batch, no extra "old" log-prob
  forward on either side; TRL's ``loss_type="dapo"`` is tether's ``token_mean`` aggregation;
* fp32 on CPU, no gradient checkpointing (TRL turns it on by default), no bf16 (ditto);
* the optimizer: both get tether's ``build_optimizer`` (torch AdamW, fused) with a constant LR;
* the prompt ids: tether prefixes bos, so the TRL prompts carry the bos token too.

What still differs, by design of each framework: tether samples with its own engine from a copy of
the weights and syncs them after the step (that copy is inside tether's timing); TRL calls
``model.generate`` on the training model and runs the ``Trainer`` machinery (callbacks, metric
gathering). Sampled lengths differ by chance; both means are printed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from common import MachineInfo, StepStats, machine_info, require_trl, set_threads  # noqa: E402
from helpers.hf_tiny import make_hf_checkpoint  # noqa: E402
from tether.builders import build_model_and_tokenizer, seed_everything  # noqa: E402
from tether.config import ExperimentConfig  # noqa: E402
from tether.data.tasks import Task, get_task  # noqa: E402
from tether.recipes.grpo import build_components  # noqa: E402
from tether.rollout.sync_loop import LoopState, rl_step  # noqa: E402
from tether.training.optim import build_optimizer  # noqa: E402

ONE_MICRO_BATCH_TOKENS = 1 << 24  # a token budget no step reaches: the whole batch in one pass


@dataclass(frozen=True, slots=True)
class BenchSettings:
    steps: int = 5
    warmup: int = 1
    threads: int = 0
    prompts_per_step: int = 16
    group_size: int = 8
    max_new_tokens: int = 32
    temperature: float = 1.0
    lr: float = 1e-5
    hidden_size: int = 128
    num_layers: int = 4
    seed: int = 0
    rounds: int = 1

    @property
    def num_total_steps(self) -> int:
        return self.warmup + self.steps

    @property
    def num_train_prompts(self) -> int:
        return self.prompts_per_step * self.num_total_steps


@dataclass(frozen=True, slots=True)
class RunTimes:
    step_s: list[float]  # [steps] wall time of each timed step (warm-up steps dropped)
    gen_s: list[float]  # [steps] the part of each step spent before scoring: prompts -> completions
    completion_tokens: list[float]  # [steps] mean completion length of each step

    @property
    def stats(self) -> StepStats:
        return StepStats.of(self.step_s)

    @property
    def mean_completion_tokens(self) -> float:
        return sum(self.completion_tokens) / len(self.completion_tokens)

    @property
    def mean_gen_s(self) -> float:
        return sum(self.gen_s) / len(self.gen_s)

    @staticmethod
    def pooled(runs: Sequence[RunTimes]) -> RunTimes:
        return RunTimes([x for r in runs for x in r.step_s], [x for r in runs for x in r.gen_s],
                        [x for r in runs for x in r.completion_tokens])


def parse_args(argv: Sequence[str] | None = None) -> BenchSettings:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = BenchSettings()
    p.add_argument("--steps", type=int, default=d.steps, help="timed steps per trainer")
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed steps before them")
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads (0: torch default)")
    p.add_argument("--prompts-per-step", type=int, default=d.prompts_per_step)
    p.add_argument("--group-size", type=int, default=d.group_size, help="completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="max completion length")
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--hidden-size", type=int, default=d.hidden_size)
    p.add_argument("--num-layers", type=int, default=d.num_layers)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--rounds", type=int, default=d.rounds,
                   help="repeat both measurements, alternating which trainer goes first")
    a = p.parse_args(argv)
    if a.steps < 1 or a.warmup < 0 or a.rounds < 1:
        p.error(f"--steps and --rounds must be >= 1, --warmup >= 0; got {a.steps}, {a.rounds}, {a.warmup}")
    if a.threads < 0:
        p.error(f"--threads must be >= 0 (0: torch's default), got {a.threads}")
    if a.group_size < 2:
        p.error(f"--group-size must be >= 2 (GRPO normalises within a group), got {a.group_size}")
    return BenchSettings(a.steps, a.warmup, a.threads, a.prompts_per_step, a.group_size, a.max_new_tokens,
                         a.temperature, a.lr, a.hidden_size, a.num_layers, a.seed, a.rounds)


def make_checkpoint(directory: Path, s: BenchSettings) -> Path:
    """A random Qwen2 (4 heads, 2 kv heads, MLP 2x hidden) saved by transformers with the char tokenizer."""
    return make_hf_checkpoint(directory, "qwen2", hidden_size=s.hidden_size, num_layers=s.num_layers,
                              num_heads=4, num_kv_heads=2, seed=s.seed)


# ---------------------------------------------------------------------------------------------- tether


def tether_config(s: BenchSettings, checkpoint: Path) -> ExperimentConfig:
    return ExperimentConfig.model_validate({
        "seed": s.seed, "init_from": str(checkpoint),
        "data": {"task": "arith", "num_train": s.num_train_prompts},
        "algorithm": {"advantage": "grpo", "policy_loss": "ppo_clip", "loss_agg": "token_mean",
                      "kl_coef": 0.0, "epochs_per_batch": 1},
        "rollout": {"group_size": s.group_size, "prompts_per_step": s.prompts_per_step,
                    "max_new_tokens": s.max_new_tokens, "temperature": s.temperature},
        "trainer": {"max_steps": s.num_total_steps, "lr": s.lr, "warmup_steps": 0, "schedule": "constant",
                    "grad_clip": 1.0, "micro_batch_tokens": ONE_MICRO_BATCH_TOKENS},
    })


def time_tether(s: BenchSettings, checkpoint: Path) -> RunTimes:
    config = tether_config(s, checkpoint)
    seed_everything(config.seed)
    model, tokenizer = build_model_and_tokenizer(config.model, config.init_from, config.seed)
    components = build_components(config, model, tokenizer)
    state = LoopState()
    times = RunTimes([], [], [])
    while state.step < s.num_total_steps:
        start = time.perf_counter()
        metrics, _ = rl_step(components, state)
        if state.step > s.warmup:
            times.step_s.append(time.perf_counter() - start)
            times.gen_s.append(metrics["time/gen_s"])
            times.completion_tokens.append(metrics["response_length/mean"])
    return times


# ------------------------------------------------------------------------------------------------- TRL


class TaskReward:
    """The task's own checker as a TRL reward function; also notes when it is called (generation has
    just ended) and the mean completion length of each call."""

    __name__ = "arith_task"  # TRL names reward metrics after the function

    def __init__(self, task: Task) -> None:
        self.task = task
        self.called_at_s: list[float] = []
        self.mean_tokens_per_call: list[float] = []

    def __call__(self, prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                 answer: list[str], **_: Any) -> list[float]:
        self.called_at_s.append(time.perf_counter())
        self.mean_tokens_per_call.append(sum(map(len, completion_ids)) / max(len(completion_ids), 1))
        return [self.task.reward(p, c, answer=a) for p, c, a in zip(prompts, completions, answer)]


def trl_config(s: BenchSettings, output_dir: Path) -> Any:
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(output_dir), use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=s.prompts_per_step * s.group_size, gradient_accumulation_steps=1,
        steps_per_generation=1, num_generations=s.group_size, max_completion_length=s.max_new_tokens,
        temperature=s.temperature, top_p=1.0, top_k=0, learning_rate=s.lr, lr_scheduler_type="constant",
        warmup_steps=0, max_grad_norm=1.0, max_steps=s.num_total_steps, beta=0.0, num_iterations=1,
        epsilon=0.2, loss_type="dapo", scale_rewards="group", logging_steps=10**6, report_to="none",
        save_strategy="no", disable_tqdm=True, seed=s.seed, dataloader_num_workers=0)


def time_trl(s: BenchSettings, checkpoint: Path, output_dir: Path) -> RunTimes:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    class StepClock(TrainerCallback):
        """Wall time at train start, at the start and at the end of every optimizer step."""

        def __init__(self) -> None:
            self.marks_s: list[float] = []
            self.begins_s: list[float] = []

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.marks_s.append(time.perf_counter())

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.begins_s.append(time.perf_counter())

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.marks_s.append(time.perf_counter())

    task = get_task("arith")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    # tether's prompts are [bos] + text; the bos token's text makes TRL's tokenisation the same.
    rows = [{"prompt": tokenizer.bos_token + r.prompt, "answer": r.fields["answer"]}
            for r in task.prompts(s.num_train_prompts, s.seed, "train")]
    torch.manual_seed(s.seed)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    optimizer = build_optimizer(model.parameters(), s.lr)
    clock, reward = StepClock(), TaskReward(task)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=trl_config(s, output_dir),
                          train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                          callbacks=[clock], optimizers=(optimizer, None))
    trainer.train()
    marks = clock.marks_s  # [1 + total steps]; step i runs from marks[i] to marks[i + 1]
    step_s = [b - a for a, b in zip(marks[s.warmup:], marks[s.warmup + 1:])]
    # Generation runs inside the step, between its begin callback and the reward call.
    gen_s = [c - b for b, c in zip(clock.begins_s, reward.called_at_s)][s.warmup:]
    return RunTimes(step_s, gen_s, reward.mean_tokens_per_call[s.warmup:])


# ------------------------------------------------------------------------------------------------ main


def report(s: BenchSettings, machine: MachineInfo, tether: RunTimes, trl: RunTimes) -> str:
    t, r = tether.stats, trl.stats
    ratio = r.mean_s / t.mean_s
    lines = [f"machine: {machine.describe()}", f"date: {machine.date_utc}",
             f"work per step: {s.prompts_per_step} prompts x {s.group_size} completions, <= "
             f"{s.max_new_tokens} new tokens, qwen2 hidden {s.hidden_size} x {s.num_layers} layers, fp32 CPU;"
             f" {s.rounds} round(s) of {s.warmup} warm-up + {s.steps} timed steps each"]
    for name, run, st in (("tether", tether, t), ("trl", trl, r)):
        # Four decimals: the smoke test's sub-10 ms steps check the ratio against these figures.
        lines.append(f"{name + ':':8}{st.mean_s:.4f} s/step (median {st.median_s:.3f}, min {st.min_s:.3f}; "
                     f"{st.num_steps} steps), generation {run.mean_gen_s:.3f} s/step, "
                     f"mean completion {run.mean_completion_tokens:.1f} tokens")
    for name, run in (("tether", tether), ("trl", trl)):
        lines.append(f"{name} steps (s): " + " ".join(f"{x:.2f}" for x in run.step_s))
    lines.append(f"load average (1 min) at start / end: {machine.load_average:.2f} / "
                 f"{os.getloadavg()[0]:.2f}")
    lines.append(f"ratio trl_s_per_step / tether_s_per_step: {ratio:.2f}")
    lines.append(f"| {machine.date_utc} | {machine.matmul_gflops:.1f} | {machine.num_threads} | "
                 f"{t.mean_s:.2f} ({tether.mean_gen_s:.2f}) | {r.mean_s:.2f} ({trl.mean_gen_s:.2f}) | "
                 f"**{ratio:.2f}** | {tether.mean_completion_tokens:.1f} / "
                 f"{trl.mean_completion_tokens:.1f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    s = parse_args(argv)
    require_trl()
    set_threads(s.threads)
    machine = machine_info()
    tether_runs: list[RunTimes] = []
    trl_runs: list[RunTimes] = []
    with tempfile.TemporaryDirectory(prefix="tether-bench-") as tmp:
        checkpoint = make_checkpoint(Path(tmp) / "ckpt", s)
        for round_index in range(s.rounds):
            # Alternate who goes first (ABBA...) so load that drifts during the run hits both alike.
            if round_index % 2 == 0:
                tether_runs.append(time_tether(s, checkpoint))
                trl_runs.append(time_trl(s, checkpoint, Path(tmp) / "trl"))
            else:
                trl_runs.append(time_trl(s, checkpoint, Path(tmp) / "trl"))
                tether_runs.append(time_tether(s, checkpoint))
    print(report(s, machine, RunTimes.pooled(tether_runs), RunTimes.pooled(trl_runs)), flush=True)


if __name__ == "__main__":
    main()
