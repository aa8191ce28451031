"""Asynchronous vs synchronous GRPO on the demo task: wall-clock to the same trained samples, reward reached.

    python bench/async_rl.py [--sft-steps 600] [--rl-steps 40] [--variants sync,s1,...] [--repeats N]
                             [--out results.json]

One SFT warm start of the demo's model on ``arith`` (``tether.demo``'s configs), then every variant
starts GRPO from a copy of the same warm-started weights, with the same seed, prompts per step
(16), group size (16), learning rate and number of RL steps, so every variant trains on the same
number of samples. Reported per variant: wall-clock of the whole GRPO run (process spawn and
weight shipping included; async variants generate in the trainer's process while the generator
process starts, ``rollout.generate_during_boot``; ``*_noboot`` variants wait for it instead),
speed-up over sync, mean reward over the last quarter of the steps, held-out greedy accuracy
after RL, and the reward at step checkpoints (the curves side by side).

Async variants run generator and trainer as two processes with one torch thread each; ``sync``
runs one process with torch's default threads (every core), ``sync_1t`` with one thread. Speed-ups
are against the faster of the two sync variants of the same repeat; ``--repeats N`` runs every
variant N times, round-robin, with RL seeds seed, seed + 1, ... (one warm start), and reports the
median speed-up, the median wall-clock and the reward averaged over the seeds.

``--task copy`` runs the same comparison on a generation-heavier workload (copy strings of 10-30
characters, ~20-token completions, a 2-layer 128-wide model; use ``--sft-steps 1500``).

``--sft-cache DIR`` keeps the warm-started model between invocations (the SFT stage dominates the
run on a small machine).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine_info  # noqa: E402
from tether.builders import build_model_and_tokenizer  # noqa: E402
from tether.config import load_config  # noqa: E402
from tether.demo import COMMON, GRPO, SFT, held_out_accuracy  # noqa: E402
from tether.recipes.grpo import generator_process_modules, run_grpo  # noqa: E402
from tether.recipes.sft import run_sft  # noqa: E402
from tether.rollout.process_server import start_process_server  # noqa: E402

# The workloads: the demo task (the issue's, completions ~3 tokens, training dominates a step) and a
# generation-heavy one (copy strings of 10-30 characters: completions ~20 tokens), where generation
# is most of a step, as in RL on long reasoning traces. (common, SFT, GRPO) overrides each.
COPY_COMMON = ["data.task=copy", "data.task_options={min_chars: 10, max_chars: 30}",
               "model.scratch.hidden_size=128", "model.scratch.intermediate_size=384",
               "model.scratch.num_layers=2", "model.scratch.num_heads=4", "model.scratch.num_kv_heads=2",
               "data.num_eval=100"]
COPY_SFT = ["recipe=sft", "name=copy-sft", "trainer.lr=1e-3", "trainer.batch_size=32", "trainer.warmup_steps=20",
            "trainer.schedule=cosine", "trainer.min_lr_ratio=0.1", "data.num_train=20000"]
COPY_GRPO = ["recipe=grpo", "name=copy-grpo", "trainer.lr=1e-5", "rollout.group_size=8",
             "rollout.prompts_per_step=16", "rollout.max_new_tokens=40", "rollout.temperature=1.0",
             "data.num_train=2000"]
WORKLOADS: dict[str, tuple[list[str], list[str], list[str]]] = {
    "arith": (COMMON, SFT, GRPO), "copy": (COPY_COMMON, COPY_SFT, COPY_GRPO)}

ASYNC = ["rollout.mode=async", "rollout.generator_threads=1", "trainer.num_threads=1"]
VARIANTS: dict[str, list[str]] = {
    "sync": [],
    "sync_1t": ["trainer.num_threads=1"],
    "s1": [*ASYNC, "rollout.max_staleness=1"],
    "s2": [*ASYNC, "rollout.max_staleness=2"],
    "s4": [*ASYNC, "rollout.max_staleness=4"],
    "s2_cut": [*ASYNC, "rollout.max_staleness=2", "rollout.oversample=4"],
    "s4_cut": [*ASYNC, "rollout.max_staleness=4", "rollout.oversample=4"],
    "s1_noboot": [*ASYNC, "rollout.max_staleness=1", "rollout.generate_during_boot=false"],
    "s2_noboot": [*ASYNC, "rollout.max_staleness=2", "rollout.generate_during_boot=false"],
    "s4_ppo_behav": [*ASYNC, "rollout.max_staleness=4", "algorithm.policy_loss=ppo_clip",
                     "algorithm.proximal=bypass"],
    # Decoupled PPO with its behaviour weight pi_prox / pi_behav truncated at the cap (2.0).
    "s4_tis": [*ASYNC, "rollout.max_staleness=4", "algorithm.correction=tis_token"],
    # Oversubscribed: the trainer takes both cores, the generator's one thread time-slices with it
    # (run with OMP_WAIT_POLICY=PASSIVE so idle OpenMP threads sleep instead of spinning).
    "s1_t2": ["rollout.mode=async", "rollout.generator_threads=1", "trainer.num_threads=2",
              "rollout.max_staleness=1"],
}


@dataclass(slots=True)
class VariantResult:
    name: str
    seed: int  # the RL run's seed
    overrides: list[str]
    wall_s: float
    num_samples: int
    final_reward: float  # mean reward/mean over the last quarter of the steps
    accuracy: float  # held-out greedy accuracy after RL
    reward_curve: list[float]  # reward/mean per step
    mean_staleness: float
    steady_step_s: float  # mean time/step_s after the first step (no process start, no first batch)


def start_generator_server(names: list[str]) -> None:
    """Start the server generator processes fork from, if a variant is asynchronous, and wait until
    it has imported, before any clock (so that its imports slow no variant): as ``tether train``
    and ``tether demo`` start it first thing, where it imports while they build the model and data
    (and the demo runs its SFT stage). Each async variant's clock then holds its generator
    process's fork and engine build (~0.5 s), not a fresh interpreter's imports (~3.5 s)."""
    if any("rollout.mode=async" in VARIANTS[name] for name in names):
        start_process_server(generator_process_modules(), wait=True)


def timed_grpo(config, run_dir: Path, model, tokenizer):
    """(``run_grpo``'s result, its wall-clock in seconds). ``run_grpo`` restores the torch threads
    it changes, so variants run one after another see the same setting."""
    start = time.perf_counter()
    result = run_grpo(config, run_dir, model, tokenizer)
    return result, time.perf_counter() - start


def run_variant(name: str, base_model, tokenizer, rl_steps: int, seed: int, root: Path,
                task: str = "arith") -> VariantResult:
    common, _, grpo = WORKLOADS[task]
    overrides = [*common, *grpo, f"seed={seed}", f"trainer.max_steps={rl_steps}", "logging.progress=none",
                 *VARIANTS[name]]
    config = load_config(None, overrides)
    model = copy.deepcopy(base_model)
    result, wall_s = timed_grpo(config, root / name, model, tokenizer)
    curve = [m["reward/mean"] for m in result.history]
    tail = curve[-max(1, len(curve) // 4):]
    accuracy = held_out_accuracy(model, tokenizer, config).accuracy
    return VariantResult(name, seed, VARIANTS[name], wall_s, int(result.history[-1].get("num_samples", 0)) or
                         rl_steps * config.rollout.prompts_per_step * config.rollout.group_size,
                         statistics.fmean(tail), accuracy, curve,
                         statistics.fmean(m["staleness/mean"] for m in result.history),
                         statistics.fmean(m["time/step_s"] for m in result.history[1:]))


def warm_start(sft_steps: int, seed: int, root: Path, cache: Path | None, task: str = "arith"):
    common, sft, _ = WORKLOADS[task]
    config = load_config(None, [*common, *sft, f"seed={seed}", f"trainer.max_steps={sft_steps}",
                                "logging.progress=none"])
    model, tokenizer = build_model_and_tokenizer(config.model, None, seed)
    # torch imports dynamo (~1 s) on the first optimizer built in a process. A cached warm start
    # builds none, so without this the first variant's clock would pay it and the others not.
    # (Here, not at the top: spawned generator processes re-import this module.)
    importlib.import_module("torch._dynamo")
    name = f"sft-{sft_steps}-seed{seed}.pt" if task == "arith" else f"sft-{task}-{sft_steps}-seed{seed}.pt"
    weights = cache / name if cache else None
    if weights is not None and weights.exists():
        model.load_state_dict(torch.load(weights))
        return model, tokenizer
    run_sft(config, root / "sft", model, tokenizer)
    if weights is not None:
        weights.parent.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), weights)
    return model, tokenizer


def paired_difference(differences: list[float]) -> str:
    """Mean of per-repeat differences against the same seed's sync run, with its standard error
    (the seeds' spread in final reward, ~0.03, is far wider than the gap between variants, so only
    the paired difference says whether a variant is behind)."""
    mean = statistics.fmean(differences)
    if len(differences) < 2:
        return f"{mean:+.3f}"
    return f"{mean:+.3f} ± {statistics.stdev(differences) / len(differences) ** 0.5:.3f}"


def print_tables(runs: dict[str, list[VariantResult]], checkpoints: list[int]) -> None:
    """One row per variant over its repeats. A speed-up is taken within a repeat, against that
    repeat's fastest synchronous run (two threads win on an idle machine, one on a busy one), then
    the median over repeats is reported: a repeat's variants run minutes apart, repeats further."""
    num_repeats = len(next(iter(runs.values())))
    sync_names = [n for n in runs if n in ("sync", "sync_1t")] or [next(iter(runs))]
    baselines = [min((runs[n][rep] for n in sync_names), key=lambda r: r.wall_s) for rep in range(num_repeats)]
    print(f"speed-ups against the fastest synchronous variant ({', '.join(sync_names)}) of each repeat; "
          f"{num_repeats} repeat(s), RL seeds {', '.join(str(r.seed) for r in baselines)}")
    print("| variant | overrides | wall-clock s (median) | speed-up vs sync (median) | per repeat "
          "| steady s/step | steady speed-up | final reward (mean) | reward - sync (paired) "
          "| held-out acc (mean) | mean lag |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, rs in runs.items():
        extra = " ".join(o for o in rs[0].overrides if o not in ASYNC) or "(sync)"
        ratios = [b.wall_s / r.wall_s for b, r in zip(baselines, rs)]
        steady = [b.steady_step_s / r.steady_step_s for b, r in zip(baselines, rs)]
        print(f"| {name} | `{extra}` | {statistics.median(r.wall_s for r in rs):.1f} | "
              f"{statistics.median(ratios):.2f}x | {' '.join(f'{x:.2f}' for x in ratios)} | "
              f"{statistics.median(r.steady_step_s for r in rs):.3f} | {statistics.median(steady):.2f}x | "
              f"{statistics.fmean(r.final_reward for r in rs):.3f} | "
              f"{paired_difference([r.final_reward - b.final_reward for b, r in zip(baselines, rs)])} | "
              f"{statistics.fmean(r.accuracy for r in rs):.1%} | "
              f"{statistics.fmean(r.mean_staleness for r in rs):.2f} |")
    print("\nreward/mean at step (mean of the 5 steps ending there, averaged over repeats):")
    print("| variant | " + " | ".join(str(c) for c in checkpoints) + " |")
    print("|---|" + "---|" * len(checkpoints))
    for name, rs in runs.items():
        cells = [statistics.fmean(statistics.fmean(r.reward_curve[max(0, c - 5):c]) for r in rs)
                 for c in checkpoints]
        print(f"| {name} | " + " | ".join(f"{v:.3f}" for v in cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft-steps", type=int, default=600)
    parser.add_argument("--rl-steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0, help="warm start seed; RL seed of the first repeat")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run every variant this many times (RL seeds seed, seed+1, ...), round-robin")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--sft-cache", default=None, help="directory keeping the warm-started weights")
    parser.add_argument("--task", default="arith", choices=sorted(WORKLOADS),
                        help="arith: the demo task; copy: a generation-heavy workload (~20-token completions)")
    args = parser.parse_args()
    if args.sft_steps < 1 or args.rl_steps < 2 or args.repeats < 1:
        parser.error("--sft-steps must be >= 1, --rl-steps >= 2 (the first step is left out of the step time) "
                     "and --repeats >= 1")
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    info = machine_info()
    print(f"machine: {info.describe()}, load average {info.load_average:.2f}", flush=True)
    start_generator_server(names)  # after the matmul measurement, which it would slow
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        start = time.perf_counter()
        model, tokenizer = warm_start(args.sft_steps, args.seed, root,
                                      Path(args.sft_cache) if args.sft_cache else None, args.task)
        print(f"SFT warm start: {args.sft_steps} steps in {time.perf_counter() - start:.0f}s", flush=True)
        runs: dict[str, list[VariantResult]] = {name: [] for name in names}
        for rep in range(args.repeats):  # round-robin: drift on the host spreads over all variants
            for name in names:
                r = run_variant(name, model, tokenizer, args.rl_steps, args.seed + rep, root / str(rep), args.task)
                runs[name].append(r)
                print(f"{name} (seed {r.seed}): {r.wall_s:.2f}s, final reward {r.final_reward:.3f}, "
                      f"accuracy {r.accuracy:.1%}", flush=True)
    checkpoints = sorted({max(5, args.rl_steps * k // 4) for k in range(1, 5)})
    print_tables(runs, checkpoints)
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": asdict(info), "args": vars(args),
                                              "results": {n: [asdict(r) for r in rs] for n, rs in runs.items()}},
                                             indent=1))


if __name__ == "__main__":
    main()
