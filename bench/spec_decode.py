"""Speculative decoding in tether's engine: plain greedy decoding vs prompt lookup vs a draft model.

    python bench/spec_decode.py [--steps 1500] [--draft-steps 1000] [--k 4] [--num-prompts 8] [--threads 1]
                                [--cache-dir DIR] [--device cpu]

A small Qwen2-shaped model is SFT-trained from scratch (``SFTTrainer``, as ``tether sft`` does) on
the built-in ``copy`` task until it copies well; a narrower one is trained the same way
to serve as the draft model. Then, batch 1, greedy, on held-out copy prompts, in the same run:

* plain decoding;
* prompt lookup (``EngineConfig(speculative="ngram")``): the answer is in the prompt, the best case;
* the draft model (``speculative="draft"``).

For each: tokens/s (generated tokens over the wall time of each request's ``generate``, its prompt's
prefill included, one request at a time, after a warm-up request), the speed-up over plain, the
acceptance rate; the script asserts that the greedy outputs of all three are identical (speculation
is exact) and prints the copy accuracy. ``--device cuda`` runs the three on a GPU (the models are
trained, or loaded from ``--cache-dir``, on the CPU and then moved there).
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import DEVICES, check_device, machine_info, set_threads  # noqa: E402
from tether.builders import build_model_and_tokenizer, seed_everything  # noqa: E402
from tether.config.schema import ModelSection, ScratchModelConfig  # noqa: E402
from tether.data.cursor import DataCursor  # noqa: E402
from tether.data.tasks import get_task  # noqa: E402
from tether.data.tokenize import tokenize_prompt, tokenize_sft  # noqa: E402
from tether.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from tether.models.checkpoint import load_model, save_model  # noqa: E402
from tether.models.tokenizer import load_tokenizer  # noqa: E402
from tether.training.optim import build_optimizer, build_scheduler  # noqa: E402
from tether.training.sft import SFTTrainer  # noqa: E402

MAX_SEQ_LEN = 256
COPY_CHARS = (10, 30)  # shorter than the task's default, so a few hundred CPU steps learn to copy
TARGET_SHAPE = (2, 128)  # (layers, hidden size): two layers, the least that can learn to copy (induction)
DRAFT_SHAPE = (1, 64)
LR = 1e-3  # 5e-3 never formed the copy circuit
BATCH = 32
NUM_EXAMPLES = 4000


@dataclass(frozen=True, slots=True)
class RunResult:
    name: str
    tokens_per_s: float
    num_tokens: int
    acceptance_rate: float
    outputs: list[list[int]]


def train_copy_model(num_layers: int, hidden_size: int, num_steps: int, seed: int):
    """A from-scratch decoder SFT-trained on ``copy``; returns (model, tokenizer, final train loss)."""
    seed_everything(seed)
    scratch = ScratchModelConfig(
        hidden_size=hidden_size, intermediate_size=3 * hidden_size, num_layers=num_layers, num_heads=4,
        num_kv_heads=2, max_position_embeddings=MAX_SEQ_LEN,
    )  # fmt: skip
    model, tokenizer = build_model_and_tokenizer(ModelSection(scratch=scratch), None, seed)
    task = get_task("copy", min_chars=COPY_CHARS[0], max_chars=COPY_CHARS[1])
    examples = [tokenize_sft(r, tokenizer, MAX_SEQ_LEN) for r in task.sft(NUM_EXAMPLES, seed=seed)]
    optimizer = build_optimizer(model.parameters(), lr=LR, weight_decay=0.0)
    scheduler = build_scheduler(optimizer, warmup_steps=20, max_steps=num_steps, schedule="cosine",
                                min_lr_ratio=0.1)  # fmt: skip
    trainer = SFTTrainer(model, optimizer, scheduler, micro_batch_tokens=1 << 16, grad_clip=1.0)
    cursor = DataCursor(examples, seed=seed)
    loss = float("nan")
    for step in range(1, num_steps + 1):
        loss = trainer.train_step(cursor.take(BATCH))["loss/sft"]
        if step % 500 == 0 or step == num_steps:
            print(f"  [{num_layers} layer(s), h={hidden_size}] step {step}: loss {loss:.3f}", flush=True)
    model.eval()
    return model, tokenizer, loss


def trained_copy_model(shape: tuple[int, int], num_steps: int, seed: int, cache_dir: Path | None,
                       require_cache: bool = False):
    """``train_copy_model``, or its saved result from an earlier run with the same settings (with
    ``require_cache``, only that: exits with one line when it is not there)."""
    num_layers, hidden_size = shape
    # Named by the training recipe (this function's code and its constants): a change to it trains anew.
    source = inspect.getsource(train_copy_model) + repr((COPY_CHARS, MAX_SEQ_LEN, LR, BATCH, NUM_EXAMPLES))
    recipe = hashlib.sha1(source.encode()).hexdigest()[:8]
    name = f"copy-l{num_layers}-h{hidden_size}-s{num_steps}-seed{seed}-{recipe}"
    path = None if cache_dir is None else cache_dir / name
    if path is not None and (path / "config.json").is_file():
        print(f"  loading {path}")
        return load_model(path).eval(), load_tokenizer(path)
    if require_cache:
        sys.exit(f"error: --require-cache: no {name} in --cache-dir {cache_dir} (make device-cache writes it)")
    model, tokenizer, loss = train_copy_model(num_layers, hidden_size, num_steps, seed)
    print(f"  trained {num_layers} layer(s), h={hidden_size}: final loss {loss:.3f}")
    if path is not None:
        save_model(model, path)
        tokenizer.save_pretrained(path)
    return model, tokenizer


def run_engine(name: str, model, prompts: list[list[int]], max_new: int, eos: int, **kwargs) -> RunResult:
    """Greedy, one request at a time (batch 1); the first prompt warms up and is not timed."""
    draft_model = kwargs.pop("draft_model", None)
    config = EngineConfig(max_num_seqs=1, stop_token_ids=(eos,), **kwargs)
    engine = LLMEngine(model, config=config, draft_model=draft_model)
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new)
    engine.generate([prompts[0]], params)  # warm-up: allocator, first-call overheads
    engine.stats.num_draft_tokens = engine.stats.num_accepted_tokens = 0
    outputs, num_tokens, elapsed_s = [], 0, 0.0
    for prompt in prompts[1:]:
        start = time.perf_counter()
        completion = engine.generate([prompt], params)[0]
        elapsed_s += time.perf_counter() - start
        outputs.append(completion.token_ids)
        num_tokens += completion.num_tokens
    return RunResult(name, num_tokens / elapsed_s, num_tokens, engine.stats.acceptance_rate, outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500, help="SFT steps for the target model")
    parser.add_argument("--draft-steps", type=int, default=1000, help="SFT steps for the draft model")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--num-prompts", type=int, default=8, help="held-out prompts timed (plus one warm-up)")
    # One thread: these models are a few hundred thousand parameters, so every op is overhead-bound,
    # and on a shared machine intra-op threads spin-wait on each other (20x slower measured).
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="save the trained models here, and reuse them on later runs")  # fmt: skip
    parser.add_argument("--require-cache", action="store_true",
                        help="exit instead of training when --cache-dir lacks a model (a GPU machine's run)")
    parser.add_argument("--device", choices=DEVICES, default="cpu",
                        help="where the engine runs, training staying on the CPU (auto: the GPU where torch sees one)")
    args = parser.parse_args()
    if args.require_cache and args.cache_dir is None:
        parser.error("--require-cache needs --cache-dir")
    args.device = check_device(parser, args.device)
    set_threads(args.threads)
    machine = machine_info(device=args.device)
    print(f"machine: {machine.describe()}; load average {machine.load_average:.1f}; {machine.date_utc}")

    t0 = time.perf_counter()
    target, tokenizer = trained_copy_model(TARGET_SHAPE, args.steps, 0, args.cache_dir, args.require_cache)
    draft, _ = trained_copy_model(DRAFT_SHAPE, args.draft_steps, 1, args.cache_dir, args.require_cache)
    print(f"models ready in {time.perf_counter() - t0:.0f} s")
    target, draft = target.to(args.device), draft.to(args.device)

    task = get_task("copy", min_chars=COPY_CHARS[0], max_chars=COPY_CHARS[1])
    records = task.prompts(args.num_prompts + 1, seed=123, split="test")
    prompts = [tokenize_prompt(r, tokenizer) for r in records]
    max_new = COPY_CHARS[1] + 2
    eos = tokenizer.eos_token_id
    with torch.inference_mode():
        plain = run_engine("plain", target, prompts, max_new, eos)
        ngram = run_engine("ngram", target, prompts, max_new, eos, speculative="ngram",
                           num_speculative_tokens=args.k)  # fmt: skip
        drafted = run_engine("draft", target, prompts, max_new, eos, speculative="draft",
                             num_speculative_tokens=args.k, draft_model=draft)  # fmt: skip
    for result in (ngram, drafted):
        assert result.outputs == plain.outputs, f"{result.name}: greedy output differs from plain decoding"
    num_correct = sum(
        task.is_correct(tokenizer.decode(out, skip_special_tokens=True), **r.fields)
        for out, r in zip(plain.outputs, records[1:])
    )
    print(f"copy accuracy (greedy, held-out): {num_correct}/{len(plain.outputs)}; "
          f"outputs identical across the three runs ({plain.num_tokens} tokens each)")  # fmt: skip
    print(f"{'method':<8} {'tokens/s':>10} {'speed-up':>9} {'acceptance':>11}")
    for result in (plain, ngram, drafted):
        speedup = result.tokens_per_s / plain.tokens_per_s
        rate = f"{result.acceptance_rate:.1%}" if result.name != "plain" else "-"
        print(f"{result.name:<8} {result.tokens_per_s:>10.1f} {speedup:>8.2f}x {rate:>11}")


if __name__ == "__main__":
    main()
