"""The ``tether`` command: ``train``, ``generate``, ``demo``.

User errors (``TetherError``) print one line on stderr and exit 2; Ctrl-C prints "interrupted"
(130) and SIGTERM "terminated" (143); nothing else is caught, so a bug in tether still shows its
traceback.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence

from tether.errors import TetherError


def _add_train(sub: argparse._SubParsersAction) -> None:
    from tether.config.loader import config_reference

    epilog = ("config keys (key = default), set in the YAML file or as key.path=value overrides; a list "
              "item's field as key.N.field:\n" + "\n".join(config_reference()))
    p = sub.add_parser("train", help="Run a training job (SFT or GRPO) from a YAML config.",
                       description="Run a training job from a YAML config into a run directory.",
                       epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="YAML config file (see examples/).")
    p.add_argument("overrides", nargs="*", help="Config overrides as key.path=value, e.g. trainer.lr=3e-4")
    p.add_argument("--out", help="Run directory (default: <logging.run_root>/<name>-<timestamp>/).")


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="Sample completions for a JSONL file of prompts.",
                       description="Sample completions with the rollout engine; one JSON line per sample.")
    p.add_argument("--model", required=True, help="Model directory (HF format, with tokenizer).")
    p.add_argument("--prompts", required=True, help="JSONL file: one {'prompt': ...} per line; a line may "
                   "override max_new_tokens, temperature, top_p, top_k, min_p, seed, n, stop (a string or a "
                   "list: its stop strings) and stop_token_ids; a line without a seed gets its own, derived "
                   "from --seed.")
    p.add_argument("--output", required=True, help="Output JSONL file.")
    p.add_argument("--n", type=int, default=1, help="Samples per prompt.")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy.")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="Stop string (repeatable).")
    p.add_argument("--stop-token-id", action="append", type=int, default=[],
                   help="Stop token id (repeatable), besides the tokenizer's EOS and the eos ids of the model's "
                   "generation_config.json.")
    p.add_argument("--max-model-len", type=int, help="Cap on prompt + completion tokens (default: the model's "
                   "context); a prompt that leaves no room fails alone.")
    p.add_argument("--speculative", choices=["ngram"], help="Speculative decoding with prompt lookup.")
    p.add_argument("--draft-model", help="Speculative decoding with this draft model directory.")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="auto (the first GPU torch sees, else the CPU), cpu, "
                   "cuda or cuda:N.")
    p.add_argument("--kv-cache-bytes", type=int, help="KV memory in bytes (default: "
                   "--kv-cache-memory-fraction of free memory); the pool never exceeds what the prompts "
                   "and their samples can hold at once.")
    p.add_argument("--kv-cache-memory-fraction", type=float, default=0.3,
                   help="Share of free memory for the KV memory when --kv-cache-bytes is not given.")
    p.add_argument("--max-num-seqs", type=int, default=256, help="Samples decoding at once.")


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="Train a small model on built-in arithmetic: SFT, then GRPO. "
                       "No downloads.", description="SFT warm start, then RL with a verifiable reward, "
                       "on a model built from scratch; prints held-out accuracy before and after RL.")
    p.add_argument("--quick", action="store_true",
                   help="Fewer RL steps (60 instead of 200; the SFT warm start, most of the time, is the same).")
    p.add_argument("--out", help="Run directory (default: runs/demo-<timestamp>/).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", choices=["sync", "async"], default="async",
                   help="RL loop: async (default; generator process and trainer overlap, staleness <= 2) "
                   "or sync (on-policy).")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tether", description="Asynchronous RL post-training for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_train(sub)
    _add_generate(sub)
    _add_demo(sub)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM (``scancel``, ``docker stop``, ``timeout``) as an exception on the main thread, so a
    run stops through the same ``finally`` blocks as on Ctrl-C: its generator process closed, its
    run directory released, what it wrote kept."""


def _raise_terminated(*_: object) -> None:
    raise Terminated


def main(argv: Sequence[str] | None = None) -> int:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return _run(argv)
    except Terminated:
        print("terminated", file=sys.stderr)
        return 143
    except KeyboardInterrupt:  # also while the parser imports torch, in the first seconds
        print("interrupted", file=sys.stderr)
        return 130


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides after --out (`tether train c.yaml --out run lr=1`): argparse ends the positionals at
    # the first option, and its intermixed parsing does not take subcommands.
    if extra and args.command == "train" and all("=" in arg and not arg.startswith("-") for arg in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if args.command == "train":
            from tether.recipes import run_train

            run_train(args.config, args.overrides, out=args.out)
        elif args.command == "generate":
            from tether.generate import run_generate

            run_generate(args)
        elif args.command == "demo":
            from tether.demo import run_demo

            run_demo(quick=args.quick, out=args.out, seed=args.seed, mode=args.mode)
    except TetherError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
