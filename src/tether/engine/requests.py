"""What the engine accepts: a request's prompt and settings checked before it is queued, and the
sequence length a config allows.

A request the engine cannot serve gets one line saying why (``request_error``), which
``LLMEngine.add_request`` turns into error completions for that request alone.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Iterable
from collections.abc import Sequence as SequenceLike

from tether.engine.config import EngineConfig
from tether.engine.types import SamplingParams
from tether.errors import ConfigError, RequestError


def batch_params(
    prompts: Iterable[SequenceLike[int]], params: SamplingParams | Iterable[SamplingParams] | None
) -> tuple[list[SequenceLike[int]], list[SamplingParams]]:
    """``LLMEngine.generate``'s prompts as a list and a ``SamplingParams`` for each: ``params`` is one
    for all, one per prompt, or None (the defaults); a ``RequestError`` for anything else."""
    prompts = list(prompts)
    params = SamplingParams() if params is None else params
    params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    if not all(isinstance(sp, SamplingParams) for sp in params_list):
        raise RequestError("generate: params must be a SamplingParams, a sequence of them, or None")
    if len(params_list) != len(prompts):
        raise RequestError(f"generate got {len(params_list)} SamplingParams for {len(prompts)} prompts")
    return prompts, params_list


def as_request_ids(request_ids: object) -> list[int]:
    """``LLMEngine.abort``'s argument, one request id or several, as a list; a ``TypeError`` naming
    anything that is no id (a bool, a string, a float)."""
    ids = [request_ids] if isinstance(request_ids, numbers.Integral) else request_ids
    if isinstance(ids, str | bytes) or not isinstance(ids, Iterable):
        raise TypeError(f"abort: give a request id, several, or None (all), got {request_ids!r}")
    ids = list(ids)
    for request_id in ids:
        if isinstance(request_id, bool) or not isinstance(request_id, numbers.Integral):
            raise TypeError(f"abort: request ids are ints, got {request_id!r}")
    return [int(request_id) for request_id in ids]


def prompt_token_ids(prompt_ids: SequenceLike[int]) -> tuple[list[int], str | None]:
    """The prompt as a list of ints, or why it is not one (a float or None among the ids: no
    silent truncation of 6.9 to 6)."""
    if isinstance(prompt_ids, (str, bytes)) or not hasattr(prompt_ids, "__iter__"):
        return [], f"the prompt is {type(prompt_ids).__name__}, not a sequence of token ids"
    prompt = []
    for position, token in enumerate(prompt_ids):
        try:
            prompt.append(operator.index(token))
        except TypeError:
            return [], f"the token at position {position} is {token!r}, not an integer token id"
    return prompt, None


def request_error(
    prompt: list[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
    block_size: int,
    num_blocks: int,
    has_tokenizer: bool,
) -> str | None:
    """Why an engine with these limits cannot serve this request, as one line; None when it can."""
    if not prompt:
        return "the prompt is empty"
    low, high = min(prompt), max(prompt)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        position = prompt.index(bad)
        return f"token id {bad} at position {position} is not in the vocabulary [0, {vocab_size})"
    outside = [t for t in params.stop_token_ids if t >= vocab_size]
    if outside:
        return f"stop token id {outside[0]} is not in the vocabulary [0, {vocab_size})"
    if len(prompt) >= max_model_len:
        return f"the prompt has {len(prompt)} tokens; max_model_len={max_model_len} leaves no room"
    if params.stop_strings and not has_tokenizer:
        return "stop_strings need a tokenizer: pass tokenizer= to LLMEngine"
    if any(not s for s in params.stop_strings):
        return "stop_strings contains an empty string"
    # The last token is sampled, never run through the model: it needs no KV.
    num_kv_tokens = min(len(prompt) + params.max_new_tokens, max_model_len) - 1
    num_blocks_needed = -(-num_kv_tokens // block_size)
    if num_blocks_needed > num_blocks:
        return (f"the KV of up to {num_kv_tokens} tokens needs {num_blocks_needed} KV blocks, the pool has "
                f"{num_blocks} (the KV memory budget sizes it: engine.kv_cache_bytes, or tether generate's "
                "--kv-cache-bytes; or ask fewer tokens)")
    return None


def resolve_max_model_len(config: EngineConfig, max_positions: int) -> int:
    """Prompt + completion tokens a sequence may hold: ``config.max_model_len``, else the model's
    ``max_positions``; a ConfigError when that cannot work."""
    max_model_len = config.max_model_len if config.max_model_len is not None else max_positions
    if max_model_len > max_positions:
        raise ConfigError(
            f"engine.max_model_len={max_model_len} exceeds the model's context of {max_positions} positions "
            "(max_position_embeddings, or as its rope_scaling extends it)"
        )
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
        raise ConfigError(
            f"engine.max_num_batched_tokens={config.max_num_batched_tokens} must be >= max_model_len="
            f"{max_model_len} when enable_chunked_prefill is false (a whole prompt runs in one step)"
        )
    return max_model_len
