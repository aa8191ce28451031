"""``tether demo``: learn arithmetic from nothing on a laptop CPU, with no download.

1. build the character tokenizer and a small Qwen2-shaped model from scratch;
2. SFT warm start on the built-in ``arith`` task, imitating a sloppy teacher (``teacher_repeat_error``:
   it often writes the last digit of an even-ending answer twice) for a short run, so the model
   inherits the teacher's habit and is still weak at carries;
3. held-out greedy accuracy (before RL);
4. GRPO with the task's verifiable reward (the exact answer), which unlearns what the verifier
   rejects and improves the arithmetic; asynchronous by default (``MODES``: generator process and
   trainer overlap within a staleness of 2, faster than sync on 2 cores at the same reward, see
   docs/benchmarks.md), ``--mode sync`` for the on-policy loop;
5. held-out greedy accuracy again (after RL).
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import torch

from tether.builders import build_generator, build_model_and_tokenizer, build_prompt_data, eos_token_ids
from tether.config import ExperimentConfig, load_config
from tether.data.tokenize import tokenize_prompt
from tether.evaluation import AccuracyResult, evaluate_accuracy
from tether.recipes.grpo import reward_text, run_grpo, start_generator_process_server
from tether.recipes.sft import run_sft
from tether.runs import claim_new_run_dir, create_run_dir, release_run_dir

NUM_HELD_OUT = 200

# Shared by both stages: the task and its held-out set.
TASK = ["data.task=arith", "data.task_options={num_digits: 2, num_terms: 2, operators: '+', teacher_repeat_error: 0.6}",
        f"data.num_eval={NUM_HELD_OUT}"]
# The model SFT builds from scratch; GRPO starts from SFT's checkpoint (`init_from`), whose shape this is.
SHAPE = ["model.scratch.hidden_size=96", "model.scratch.intermediate_size=256", "model.scratch.num_layers=3",
         "model.scratch.num_heads=4", "model.scratch.num_kv_heads=2"]
COMMON = [*TASK, *SHAPE]  # both stages on a model built from scratch (the benches in bench/)
SFT = ["recipe=sft", "name=demo-sft", "trainer.lr=3e-3", "trainer.batch_size=64", "trainer.warmup_steps=20",
       "trainer.schedule=cosine", "trainer.min_lr_ratio=0.1", "data.num_train=20000"]
GRPO = ["recipe=grpo", "name=demo-grpo", "trainer.lr=3e-4", "trainer.warmup_steps=10", "trainer.schedule=cosine",
        "trainer.min_lr_ratio=0.1", "rollout.group_size=16",
        "rollout.prompts_per_step=16", "rollout.max_new_tokens=6", "rollout.temperature=1.0",
        "data.num_train=2000"]
STEPS = {False: {"sft": 800, "grpo": 200}, True: {"sft": 800, "grpo": 60}}
MODES = {"sync": ["rollout.mode=sync"], "async": ["rollout.mode=async", "rollout.max_staleness=2"]}


def demo_configs(quick: bool, seed: int, sft_final: Path,
                 mode: str = "async") -> tuple[ExperimentConfig, ExperimentConfig]:
    """The two stages' configs; the GRPO stage starts from ``sft_final``, the SFT stage's checkpoint."""
    steps = STEPS[quick]
    sft = load_config(None, [*COMMON, *SFT, f"seed={seed}", f"trainer.max_steps={steps['sft']}"])
    grpo = load_config(None, [*TASK, *GRPO, f"seed={seed}", f"trainer.max_steps={steps['grpo']}", *MODES[mode],
                              f"init_from={sft_final.resolve()}"])
    return sft, grpo


def held_out_accuracy(model: torch.nn.Module, tokenizer, config: ExperimentConfig) -> AccuracyResult:
    data = build_prompt_data(config.data, config.seed)
    assert data.task is not None
    return evaluate_accuracy(
        build_generator(model, tokenizer, config.engine), data.eval, lambda r: tokenize_prompt(r, tokenizer),
        functools.partial(reward_text, tokenizer), data.task.is_correct,
        max_new_tokens=config.rollout.max_new_tokens, stop_token_ids=eos_token_ids(tokenizer))


def run_demo(quick: bool = False, out: str | None = None, seed: int = 0, mode: str = "async") -> float:
    """Runs the demo, prints progress and the result; returns the accuracy gain in points."""
    start = time.perf_counter()
    # The root holds one run directory per stage, each self-describing; no config of its own.
    root = Path(out) if out else claim_new_run_dir(load_config(None, []).logging.run_root, "demo")
    # The GRPO stage's config.yaml names the SFT checkpoint, so its run directory reruns alone.
    sft_config, grpo_config = demo_configs(quick, seed, root / "sft" / "final", mode)
    start_generator_process_server(grpo_config)  # imports while the SFT stage runs
    model, tokenizer = build_model_and_tokenizer(sft_config.model, None, seed)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"demo: {num_params / 1e6:.2f}M-parameter model, character tokenizer, task arith", flush=True)

    sft_dir = create_run_dir(sft_config, root / "sft")
    try:
        run_sft(sft_config, sft_dir, model, tokenizer)
    finally:
        release_run_dir(sft_dir)
    before = held_out_accuracy(model, tokenizer, grpo_config)
    print(f"demo: after SFT warm start ({time.perf_counter() - start:.0f}s): held-out accuracy "
          f"{before.accuracy:.1%}", flush=True)

    grpo_dir = create_run_dir(grpo_config, root / "grpo")
    try:
        run_grpo(grpo_config, grpo_dir, model, tokenizer)
    finally:
        release_run_dir(grpo_dir)
    after = held_out_accuracy(model, tokenizer, grpo_config)
    result = {"held_out_accuracy": {"after_sft": before.accuracy, "after_grpo": after.accuracy},
              "num_correct": {"after_sft": before.num_correct, "after_grpo": after.num_correct},
              "num_held_out": after.num_total, "seed": seed, "mode": mode, "quick": quick,
              "seconds": round(time.perf_counter() - start, 1)}
    (root / "result.json").write_text(json.dumps(result, indent=1) + "\n")  # the figures printed below
    print(f"demo: run directory {root} ({time.perf_counter() - start:.0f}s in all)", flush=True)
    print(f"demo: accuracy {before.accuracy:.1%} -> {after.accuracy:.1%} ({after.num_total} held-out problems)",
          flush=True)
    return 100 * (after.accuracy - before.accuracy)
