"""``tether generate``: sample completions for a JSONL file of prompts with the rollout engine.

Output: one JSON line per sample with ``prompt_index``, ``sample_index``, ``text``, ``token_ids``,
``logprobs``, ``finish_reason`` (plus ``error`` for a request that could not be served). A prompts
line may override ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed`` and
``n``, and give ``stop`` (or ``stop_strings``: a string or a list of strings, its stop strings in
place of ``--stop``) and ``stop_token_ids`` (a list of token ids, in addition to the tokenizer's EOS
and ``--stop-token-id``). Sampling settings named as in other tools (``temp``, ``max_tokens``,
``repetition_penalty``, camelCase ``topP``, ...) are refused with the line and the name, never silently
ignored; the line's other fields are its own, and those that look like settings are named in one
warning. A null field is a setting not given (a table file has every column in every row). ``text``
is the completion as it reads after its prompt (``completion_text``).
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
import re
import sys
from pathlib import Path
from typing import Any

import torch

from tether.builders import DTYPES, eos_token_ids, resolve_device
from tether.data.loading import load_prompts
from tether.data.records import PromptRecord
from tether.data.tokenize import encode_prompt
from tether.engine.config import EngineConfig
from tether.engine.engine import LLMEngine
from tether.engine.sampler import completion_text
from tether.engine.types import SamplingParams
from tether.errors import DataError, RequestError, TetherError
from tether.models.checkpoint import load_model, read_model_config
from tether.models.tokenizer import check_tokenizer_fits, load_tokenizer

OVERRIDABLE = {"max_new_tokens": int, "temperature": float, "top_p": float, "top_k": int, "min_p": float,
               "seed": int, "n": int}
STOP_FIELDS = ("stop", "stop_strings", "stop_token_ids")
# Sampling settings of other tools (vLLM, OpenAI, transformers): tether's name, or None (no such setting).
FOREIGN_FIELDS = {"temp": "temperature", "max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens",
                  "stop_sequences": "stop", "num_return_sequences": "n", "random_seed": "seed",
                  "best_of": None, "do_sample": None, "repetition_penalty": None, "presence_penalty": None,
                  "frequency_penalty": None, "ignore_eos": None, "length_penalty": None, "max_length": None,
                  "min_length": None, "min_tokens": None, "min_new_tokens": None, "typical_p": None,
                  "num_beams": None, "use_beam_search": None, "logit_bias": None, "bad_words": None,
                  "bad_words_ids": None, "no_repeat_ngram_size": None, "epsilon_cutoff": None, "eta_cutoff": None,
                  "top_a": None, "logprobs": None, "prompt_logprobs": None, "include_stop_str_in_output": None,
                  # transformers' generate, llama.cpp, vLLM, OpenAI, TGI
                  "eos_token_id": "stop_token_ids", "n_predict": "max_new_tokens", "num_samples": "n",
                  "max_new_token": "max_new_tokens", "early_stopping": None, "penalty_alpha": None,
                  "repeat_penalty": None, "repeat_last_n": None, "mirostat": None, "mirostat_tau": None,
                  "mirostat_eta": None, "tfs_z": None, "n_probs": None, "min_keep": None, "dry_multiplier": None,
                  "skip_special_tokens": None, "truncate_prompt_tokens": None, "top_logprobs": None,
                  "return_full_text": None, "spaces_between_special_tokens": None, "guided_json": None,
                  "guided_regex": None, "response_format": None,
                  # TRL, OpenAI's Responses API, Ollama, Llama's reference code, Anthropic, others
                  "num_generations": "n", "max_completion_length": "max_new_tokens",
                  "max_output_tokens": "max_new_tokens", "num_predict": "max_new_tokens",
                  "max_gen_len": "max_new_tokens", "max_tokens_to_sample": "max_new_tokens",
                  "stop_words": "stop", "stop_sequence": "stop", "stop_ids": "stop_token_ids", "n_samples": "n",
                  "num_completions": "n", "sampling_seed": "seed",
                  "prompt_token_ids": None, "input_ids": None}
# Other fields are the user's own; these look like sampling settings all the same (warned about once).
_SETTING_LIKE = re.compile(r"^(max|min)_\w*(tokens?|len|length)$|^top_?[a-z]$|^min_?p$|^stop|seed|penalt"
                           r"|^temp(erature)?(_|$)|^num_\w*(samples|generations|sequences|completions|return)")
# Settings nested under one field, as other tools' request bodies hold them (a mapping with a sampling
# setting's name in it; any other mapping there is the user's own field): tether reads flat fields.
NESTED_FIELDS = ("sampling_params", "generation_config", "generation_kwargs", "parameters", "options")


def request_params(record: PromptRecord, base: dict[str, Any], where: str) -> SamplingParams:
    """The CLI's sampling settings, overridden by the prompt line's own fields; a line without a
    seed of its own gets one derived from the base seed and its position."""
    where = _line(record, where)
    values = dict(base)
    # A null is a setting not given: a Parquet or table file has every column in every row.
    fields = {key: value for key, value in record.fields.items() if value is not None}
    # Other fields are the user's own (an answer, an id): kept, unused; but not other tools' names for
    # sampling settings, which would silently not apply.
    for key in fields:
        nested = fields[key]
        if key in NESTED_FIELDS and isinstance(nested, dict) and any(
                name in OVERRIDABLE or name in STOP_FIELDS or name in FOREIGN_FIELDS for name in nested):
            raise DataError(f"{where}: field '{key}' nests sampling settings; tether reads them as fields of the "
                            f"line ({', '.join(OVERRIDABLE)}, stop, stop_token_ids)")
        snake = _snake_case(key)  # vLLM/OpenAI names in camelCase (Gemini's topP, Bedrock's maxTokens)
        if snake in FOREIGN_FIELDS or (snake != key and (snake in OVERRIDABLE or snake in STOP_FIELDS)):
            ours = FOREIGN_FIELDS.get(snake, snake)
            hint = (f"tether's name is '{ours}'" if ours else "prompts are text or chat messages in 'prompt'"
                    if "ids" in snake else "tether generate has no such setting")
            raise DataError(f"{where}: field '{key}' is not a tether sampling setting ({hint})")
        close = difflib.get_close_matches(key, [*OVERRIDABLE, *STOP_FIELDS], n=1, cutoff=0.8)
        if key not in OVERRIDABLE and key not in STOP_FIELDS and close:
            raise DataError(f"{where}: unknown field '{key}' (did you mean '{close[0]}'?)")
    for key, kind in OVERRIDABLE.items():
        if key in fields:
            value = fields[key]
            if isinstance(value, float) and not math.isfinite(value):
                raise DataError(f"{where}: field '{key}' must be a finite number, got {value!r}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
                raise DataError(f"{where}: field '{key}' must be {kind.__name__}, got {value!r}")
            try:
                values[key] = kind(value)
            except OverflowError:  # an integer with hundreds of digits for a float field
                raise DataError(f"{where}: field '{key}' is out of range ({str(value)[:20]}...)") from None
    if "stop" in fields and "stop_strings" in fields:
        raise DataError(f"{where}: give 'stop' or 'stop_strings', not both")
    for key in ("stop", "stop_strings"):
        if key in fields:
            stop = fields[key]
            stops = [stop] if isinstance(stop, str) else stop
            if not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops):
                raise DataError(f"{where}: field '{key}' must be a non-empty string or a list of them, got {stop!r}")
            values["stop_strings"] = tuple(stops)
    if "stop_token_ids" in fields:
        ids = fields["stop_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ids):
            raise DataError(f"{where}: field 'stop_token_ids' must be a list of token ids (ints >= 0), got {ids!r}")
        values["stop_token_ids"] = (*values.get("stop_token_ids", ()), *ids)
    try:
        params = SamplingParams(**values)
    except ValueError as exc:
        raise DataError(f"{where}: {exc}") from None
    return params if "seed" in fields else params.for_request(record.index)


def _snake_case(key: str) -> str:
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", key).lower()


def setting_like_fields(records: list[PromptRecord]) -> list[str]:
    """The lines' own fields (not read by ``tether generate``) whose names look like sampling settings."""
    return sorted({key for r in records for key in r.fields if key not in OVERRIDABLE and key not in STOP_FIELDS
                   and _SETTING_LIKE.search(_snake_case(key))})


def _encode(tokenizer: Any, record: PromptRecord, where: str) -> list[int]:
    """The line's prompt as token ids; a prompt the tokenizer cannot render names its line."""
    try:
        return encode_prompt(tokenizer, record.prompt)
    except DataError as error:  # a chat prompt its template refuses, or a tokenizer without one
        raise DataError(f"{_line(record, where)}: {error}") from None


def _line(record: PromptRecord, path: str) -> str:
    """Where a prompts line is, for its errors: ``file:line`` as read, else its index in ``path``."""
    return record.where or f"{path}:{record.index + 1}"


def build_engine(args: argparse.Namespace, tokenizer: Any, device: torch.device,
                 max_kv_tokens: int | None = None) -> LLMEngine:
    """The engine for the flags; ``max_kv_tokens`` (what the prompts and their samples can hold at
    once) caps its pool: 3.5 GB of zeros for two prompts of a 124M model, before."""
    dtype = DTYPES[args.dtype]
    model = load_model(args.model, dtype=dtype, device=device)
    draft = load_model(args.draft_model, dtype=dtype, device=device) if args.draft_model else None
    speculative = "draft" if draft is not None else args.speculative
    config = EngineConfig(stop_token_ids=eos_token_ids(tokenizer, args.model), seed=args.seed, speculative=speculative,
                          num_speculative_tokens=args.num_speculative_tokens, max_model_len=args.max_model_len,
                          kv_cache_bytes=args.kv_cache_bytes, kv_cache_memory_fraction=args.kv_cache_memory_fraction,
                          max_num_seqs=args.max_num_seqs, max_kv_tokens=max_kv_tokens)
    return LLMEngine(model, tokenizer=tokenizer, config=config, draft_model=draft)


def run_generate(args: argparse.Namespace) -> Path:
    device = resolve_device(args.device, "--device")  # a bad device fails before anything is read or written
    model_config = read_model_config(args.model)  # a bad config.json is named as such, not as a tokenizer failure
    _check_flags(args, model_config.vocab_size, model_config.context_length)
    tokenizer = load_tokenizer(args.model)
    check_tokenizer_fits(tokenizer, model_config.vocab_size, args.model)
    records = load_prompts(args.prompts, allow_empty=True)  # an empty prompt fails alone, in the engine
    base = {"n": args.n, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
            "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p, "seed": args.seed,
            "stop_strings": tuple(args.stop), "stop_token_ids": tuple(args.stop_token_id)}
    if any(not stop for stop in args.stop):
        raise TetherError("--stop: a stop string must not be empty")
    try:
        SamplingParams(**base)
    except ValueError as exc:
        raise TetherError(f"command line: {exc}") from None
    params = [request_params(r, base, args.prompts) for r in records]
    if unread := setting_like_fields(records):
        print(f"warning: {args.prompts}: field(s) {', '.join(repr(k) for k in unread)} are not tether sampling "
              f"settings and are not read (tether's: {', '.join([*OVERRIDABLE, *STOP_FIELDS])})", file=sys.stderr)
    out = Path(args.output)
    target, is_regular = _output_target(out)
    partial = target.with_name(target.name + ".partial") if is_regular else target
    _check_not_an_input(target, args)
    _check_writable(out, partial, is_regular)  # before generating: nothing computed is lost to a bad path
    prompt_ids = [_encode(tokenizer, r, args.prompts) for r in records]  # before the engine: a bad line fails fast
    # Every sample at its prompt + max_new_tokens (+ the speculative lookahead), in whole blocks.
    lookahead = args.num_speculative_tokens if args.speculative or args.draft_model else 0
    block = EngineConfig().block_size
    max_kv_tokens = sum(p.n * -(-(len(ids) + p.max_new_tokens + lookahead) // block) * block
                        for p, ids in zip(params, prompt_ids, strict=True))
    engine = build_engine(args, tokenizer, device, max(max_kv_tokens, block))
    completions = engine.generate(prompt_ids, params)
    num_failed = sum(1 for c in completions if c.error)
    all_failed = bool(completions) and num_failed == len(completions)
    try:
        with partial.open("w") as f:
            for c in completions:
                line = {"prompt_index": c.prompt_index, "sample_index": c.sample_index,
                        "text": completion_text(tokenizer, c.prompt_ids, c.token_ids), "token_ids": c.token_ids,
                        "logprobs": c.logprobs, "finish_reason": c.finish_reason}
                if c.error:
                    line["error"] = c.error
                f.write(json.dumps(line) + "\n")
        if is_regular and not all_failed:
            os.replace(partial, target)  # only a complete file replaces what --output held
    except OSError as exc:  # a full disk, a vanished directory: the earlier --output stays as it was
        raise TetherError(f"--output {out}: writing failed ({exc.strerror or exc})") from None
    if all_failed:  # a script's `&&` must not go on; nothing replaces what --output held
        kept = f"; --output {out} is left as it was, the errors are in {partial}" if is_regular else ""
        raise RequestError(f"every request failed{kept}; the first: {completions[0].error}")
    failed = f" ({num_failed} failed: see their 'error')" if num_failed else ""
    # On stderr: --output /dev/stdout gets the JSON lines alone.
    print(f"wrote {len(completions)} samples for {len(records)} prompts to {out}{failed}", file=sys.stderr,
          flush=True)
    return out


def _check_flags(args: argparse.Namespace, vocab_size: int, context: int) -> None:
    """Flags that cannot work together or with this model, before anything is read or written."""
    if args.max_model_len is not None and not 2 <= args.max_model_len <= context:
        raise TetherError(f"--max-model-len {args.max_model_len}: must be in [2, {context}] (the model's "
                          "context: max_position_embeddings, or as its rope_scaling extends it)")
    if args.speculative and args.draft_model:
        raise TetherError(f"--speculative {args.speculative} and --draft-model: give one (a draft model is its "
                          "own kind of speculative decoding)")
    if args.num_speculative_tokens < 1:
        raise TetherError(f"--num-speculative-tokens must be >= 1, got {args.num_speculative_tokens}")
    if not 0 < args.kv_cache_memory_fraction <= 1:
        raise TetherError(f"--kv-cache-memory-fraction must be in (0, 1], got {args.kv_cache_memory_fraction}")
    for flag, value in (("--kv-cache-bytes", args.kv_cache_bytes), ("--max-num-seqs", args.max_num_seqs)):
        if value is not None and value < 1:
            raise TetherError(f"{flag} must be >= 1, got {value}")
    for token_id in args.stop_token_id:
        if not 0 <= token_id < vocab_size:
            raise TetherError(f"--stop-token-id {token_id}: not in the model's vocabulary [0, {vocab_size})")


def _check_not_an_input(target: Path, args: argparse.Namespace) -> None:
    """``--output`` must not be the prompts file or a checkpoint file of the model's (or draft's)
    directory: it replaced the prompts with completions, or a config.json, exit 0 (an earlier output
    kept there, a ``.jsonl``, may be written again)."""
    if not target.exists():
        return
    inputs = [("the --prompts file", Path(args.prompts))]
    for flag, directory in (("--model", args.model), ("--draft-model", args.draft_model)):
        if directory and Path(directory).is_dir():
            inputs += [(f"a file of {flag}", path) for path in Path(directory).iterdir() if path.suffix != ".jsonl"]
    for what, path in inputs:
        if path.exists() and os.path.samefile(target, path):
            raise TetherError(f"--output {args.output}: is {what}; write the samples elsewhere")


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
        if out.is_symlink() and not path.parent.is_dir():  # a dangling link makes no directories
            raise FileNotFoundError(2, f"the link's target directory {path.parent} does not exist")
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
