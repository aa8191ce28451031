"""Prefill of long prompts: tether's engine (batch invariant or not) against a transformers forward.

    python bench/long_prompt_prefill.py [--lengths 500,1500,3000] [--threads 2] [--repeats 2] [--quick]

For each length L: ``num_prompts`` random prompts of L tokens on the engine bench's Qwen2-shaped
checkpoint (~38M parameters, vocabulary 32000, fp32, CPU), each prompt's first token sampled (so the
work is the prompt's prefill and one vocabulary projection per prompt). Systems, each timed
``repeats`` times (best kept: other processes only ever slow a run down), in one process:

* tether ``LLMEngine.generate`` with ``max_new_tokens=1``, prefix cache flushed before every run,
  chunked prefill under the engine's default step budget (2,048 tokens), with the default
  ``engine.batch_invariant: auto`` (on here where the compiled kernel builds: every prompt token
  attends through the compiled kernel, query blocks sharing each pass over the keys) and with
  ``batch_invariant: false`` (the same kernel for attention since 2026-12-07; before, SDPA over the
  gathered context; MKL's linears and ``F.silu`` instead of oneDNN's and the invariant SiLU);
* transformers: one forward of the ``[num_prompts, L]`` batch (sdpa attention, causal), logits of
  the last position only (``logits_to_keep=1``), under ``torch.inference_mode``.

Prints prompt tokens per second for each and the ratios tether / transformers and
invariant / not (time, so above 1 means invariance costs that much).
"""

from __future__ import annotations

import argparse
import functools
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from common import machine_info, set_threads  # noqa: E402
from helpers.hf_tiny import make_hf_model  # noqa: E402
from tether.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from tether.models.checkpoint import load_model  # noqa: E402

SHAPE = dict(vocab_size=32000, hidden_size=384, num_layers=6, num_heads=6, num_kv_heads=2, intermediate_size=1536)
QUICK_SHAPE = dict(vocab_size=1024, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
BLOCK_SIZE = 16


def best_time(run: Callable[[], object], repeats: int) -> float:
    run()  # warm-up: allocator, thread pool, the kernel's first call
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def tether_engine(model: torch.nn.Module, num_prompts: int, length: int, batch_invariant: bool | str) -> LLMEngine:
    num_blocks = num_prompts * (-(-(length + 1) // BLOCK_SIZE)) + 1
    config = EngineConfig(block_size=BLOCK_SIZE, num_kv_blocks=num_blocks, max_model_len=length + 2,
                          max_num_seqs=num_prompts, batch_invariant=batch_invariant)
    return LLMEngine(model, config=config)


def run_tether(engine: LLMEngine, prompts: list[list[int]]) -> None:
    engine.block_manager.flush_prefix_cache()  # every run prefills its prompts
    completions = engine.generate(prompts, SamplingParams(max_new_tokens=1, seed=0))
    assert all(c.finish_reason == "length" for c in completions), [c.error for c in completions]


def run_hf(model: torch.nn.Module, input_ids: torch.Tensor) -> None:
    with torch.inference_mode():
        model(input_ids=input_ids, logits_to_keep=1)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="500,1500,3000", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--threads", type=int, default=2, help="torch threads (0: torch default)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per system, best kept")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a tiny model and short prompts: a smoke test")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    set_threads(args.threads)
    lengths = [64, 128] if args.quick else [int(x) for x in args.lengths.split(",")]
    shape = QUICK_SHAPE if args.quick else SHAPE
    num_prompts = 2 if args.quick else args.num_prompts
    print(f"machine: {machine_info().describe()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        hf = make_hf_model("qwen2", seed=args.seed, max_position_embeddings=max(lengths) + 8, **shape)
        hf.save_pretrained(tmp)
        tether = load_model(tmp).eval()
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="sdpa").eval()
    print(f"model: qwen2 {sum(p.numel() for p in tether.parameters()) / 1e6:.1f}M parameters, hidden "
          f"{shape['hidden_size']} x {shape['num_layers']} layers, vocab {shape['vocab_size']}, fp32; "
          f"{num_prompts} prompts per length, first token sampled", flush=True)
    rng = random.Random(args.seed)
    for length in lengths:
        prompts = [[rng.randrange(3, shape["vocab_size"]) for _ in range(length)] for _ in range(num_prompts)]
        num_tokens = num_prompts * length
        invariant = tether_engine(tether, num_prompts, length, "auto")
        plain = tether_engine(tether, num_prompts, length, False)
        input_ids = torch.tensor(prompts)
        seconds = {
            "tether": best_time(functools.partial(run_tether, invariant, prompts), args.repeats),
            "tether_plain": best_time(functools.partial(run_tether, plain, prompts), args.repeats),
            "transformers": best_time(functools.partial(run_hf, hf, input_ids), args.repeats),
        }
        names = {"tether": f"tether (batch invariant: {'on' if invariant.is_batch_invariant else 'off'})",
                 "tether_plain": "tether (batch_invariant: false)", "transformers": "transformers forward (sdpa)"}
        for key, name in names.items():
            rate = num_tokens / seconds[key]
            print(f"L={length:5d} {name:38} {seconds[key]:7.3f} s = {rate:8.1f} prompt tokens/s")
        speedup = seconds["transformers"] / seconds["tether"]
        print(f"L={length:5d} ratio tether / transformers (tokens/s): {speedup:.2f}")
        print(f"L={length:5d} ratio invariant / not (time): {seconds['tether'] / seconds['tether_plain']:.2f}",
              flush=True)


if __name__ == "__main__":
    main()
