"""``tether generate``: sample completions for a JSONL file of prompts with the rollout engine.

Output: one JSON line per sample with ``prompt_index``, ``sample_index``, ``text``, ``token_ids``,
``logprobs``, ``finish_reason`` (plus ``error`` for a request that could not be served). A prompts
line may override ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed`` and
``n``, and give ``stop`` (a string or a list of strings: its stop strings, in place of ``--stop``).
A line without a ``seed`` samples with its own seed derived from ``--seed`` and its position
(``SamplingParams.for_request``): two lines with the same prompt give different samples, and the
run repeats exactly.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from tether.builders import DTYPES, eos_token_ids
from tether.data.loading import load_prompts
from tether.data.records import PromptRecord
from tether.engine.config import EngineConfig
from tether.engine.engine import LLMEngine
from tether.engine.types import SamplingParams
from tether.errors import DataError, TetherError
from tether.models.checkpoint import load_model, read_model_config
from tether.models.tokenizer import encode_prompt, load_tokenizer

OVERRIDABLE = {"max_new_tokens": int, "temperature": float, "top_p": float, "top_k": int, "min_p": float,
               "seed": int, "n": int}


def request_params(record: PromptRecord, base: dict[str, Any], where: str) -> SamplingParams:
    """The CLI's sampling settings, overridden by the prompt line's own fields; a line without a
    seed of its own gets one derived from the base seed and its position."""
    where = record.where or f"{where}:{record.index + 1}"
    values = dict(base)
    for key in record.fields:  # other fields are the user's own (an answer, an id): kept, unused
        close = difflib.get_close_matches(key, [*OVERRIDABLE, "stop"], n=1, cutoff=0.8)
        if key not in OVERRIDABLE and key != "stop" and close:
            raise DataError(f"{where}: unknown field '{key}' (did you mean '{close[0]}'?)")
    for key, kind in OVERRIDABLE.items():
        if key in record.fields:
            value = record.fields[key]
            if isinstance(value, float) and not math.isfinite(value):
                raise DataError(f"{where}: field '{key}' must be a finite number, got {value!r}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
                raise DataError(f"{where}: field '{key}' must be {kind.__name__}, got {value!r}")
            try:
                values[key] = kind(value)
            except OverflowError:  # an integer with hundreds of digits for a float field
                raise DataError(f"{where}: field '{key}' is out of range ({str(value)[:20]}...)") from None
    if "stop" in record.fields:
        stop = record.fields["stop"]
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops):
            raise DataError(f"{where}: field 'stop' must be a non-empty string or a list of them, got {stop!r}")
        values["stop_strings"] = tuple(stops)
    try:
        params = SamplingParams(**values)
    except ValueError as exc:
        raise DataError(f"{where}: {exc}") from None
    return params if "seed" in record.fields else params.for_request(record.index)


def build_engine(args: argparse.Namespace, tokenizer: Any) -> LLMEngine:
    dtype = DTYPES[args.dtype]
    model = load_model(args.model, dtype=dtype)
    draft = load_model(args.draft_model, dtype=dtype) if args.draft_model else None
    speculative = "draft" if draft is not None else args.speculative
    config = EngineConfig(stop_token_ids=eos_token_ids(tokenizer), seed=args.seed, speculative=speculative,
                          num_speculative_tokens=args.num_speculative_tokens)
    return LLMEngine(model, tokenizer=tokenizer, config=config, draft_model=draft)


def run_generate(args: argparse.Namespace) -> Path:
    read_model_config(args.model)  # a bad config.json is named as such, not as a tokenizer failure
    tokenizer = load_tokenizer(args.model)
    records = load_prompts(args.prompts)
    base = {"n": args.n, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
            "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p, "seed": args.seed,
            "stop_strings": tuple(args.stop)}
    if any(not stop for stop in args.stop):
        raise TetherError("--stop: a stop string must not be empty")
    try:
        SamplingParams(**base)
    except ValueError as exc:
        raise TetherError(f"command line: {exc}") from None
    params = [request_params(r, base, args.prompts) for r in records]
    out = Path(args.output)
    target, is_regular = _output_target(out)
    partial = target.with_name(target.name + ".partial") if is_regular else target
    _check_writable(out, partial, is_regular)  # before generating: nothing computed is lost to a bad path
    engine = build_engine(args, tokenizer)
    completions = engine.generate([encode_prompt(tokenizer, r.prompt) for r in records], params)
    with partial.open("w") as f:
        for c in completions:
            line = {"prompt_index": c.prompt_index, "sample_index": c.sample_index,
                    "text": tokenizer.decode(c.token_ids, skip_special_tokens=True), "token_ids": c.token_ids,
                    "logprobs": c.logprobs, "finish_reason": c.finish_reason}
            if c.error:
                line["error"] = c.error
            f.write(json.dumps(line) + "\n")
    if is_regular:
        os.replace(partial, target)
    # On stderr: --output /dev/stdout gets the JSON lines alone.
    print(f"wrote {len(completions)} samples for {len(records)} prompts to {out}", file=sys.stderr, flush=True)
    return out


def _check_writable(out: Path, path: Path, is_regular: bool) -> None:
    """``path`` (what ``--output`` is written through, see ``_output_target``) can be written, its
    directory made if missing; one-line error if not."""
    if out.is_dir():
        raise TetherError(f"--output {out}: is a directory")
    try:
        if not is_regular:  # a pipe or terminal: written in place
            if not os.access(path, os.W_OK):
                raise PermissionError(13, "Permission denied")
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
        path.unlink()
    except OSError as exc:
        raise TetherError(f"--output {out}: cannot write there ({exc.strerror or exc})") from None


def _output_target(out: Path) -> tuple[Path, bool]:
    """(the path to write, whether it is a regular file). A regular file (or a new one) is written
    beside itself and renamed over, so a reader never sees half a file; through a symlink, its
    target is. Anything else (``/dev/stdout``, a pipe, a terminal) is written in place."""
    if out.exists() and not out.is_file():
        return out, False
    return (out.resolve() if out.is_symlink() else out), True
