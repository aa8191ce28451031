"""Sampling a token per sequence, its log-prob, and deciding when a sequence is done.

The distribution is ``tether.algorithms.logprobs.process_logits`` -- the trainer's own definition
-- so a reported log-prob is exactly what the trainer recomputes with the same settings.

Each sampling row draws one uniform from its sequence's own ``torch.Generator`` and inverts the
row's CDF. A row's sample therefore depends only on its logits and its generator's state, never
on which other sequences share the step (same seed, same sample, whatever the batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tether.algorithms.logprobs import process_logits
from tether.engine.sequence import Sequence
from tether.engine.types import FinishReason, SamplingParams

# Tokens decoded to look for a stop string: enough for its characters plus tokens that decode to
# nothing on their own (partial UTF-8), without decoding the whole completion every step.
_STOP_WINDOW_EXTRA_TOKENS = 8


class Detokenizer(Protocol):
    def decode(self, token_ids: list[int]) -> str: ...


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float]  # fp32 log-prob of each token under process_logits


def _row_param(values: list[float], dtype: torch.dtype, device: torch.device) -> float | torch.Tensor:
    """One number when the batch agrees (lets process_logits skip its sort), else a per-row tensor."""
    first = values[0]
    if all(value == first for value in values):
        return first
    return torch.tensor(values, dtype=dtype, device=device)


class Sampler:
    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
    ) -> SampleResult:
        """logits ``[N, V]`` (row i belongs to params[i], generators[i]) -> a token and log-prob per row."""
        device = logits.device
        temperature = _row_param([p.temperature for p in params], torch.float32, device)
        top_k = _row_param([p.top_k for p in params], torch.long, device)
        top_p = _row_param([p.top_p for p in params], torch.float32, device)
        min_p = _row_param([p.min_p for p in params], torch.float32, device)
        logprobs = process_logits(logits, temperature, top_k, top_p, min_p)  # [N, V] fp32
        token_ids = logprobs.argmax(dim=-1)  # [N]; final for greedy rows
        sampled_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows, device=device)
            token_ids[rows] = _inverse_cdf(logprobs[rows], [generators[i] for i in sampled_rows])
        picked = logprobs.gather(-1, token_ids[:, None]).squeeze(-1)  # [N]
        return SampleResult(token_ids.tolist(), picked.tolist())  # the step's one host sync


def _inverse_cdf(logprobs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """logprobs [M, V] -> LongTensor [M]: one draw per row from its own generator."""
    # 1 - U(0, 1] lies in (0, 1]: the target is never 0, so a leading zero-probability token is
    # never picked; the first index whose CDF reaches the target always has positive mass.
    uniforms = torch.stack([1.0 - torch.rand((), generator=g, dtype=torch.float64) for g in generators])
    cdf = logprobs.double().exp().cumsum(dim=-1)  # [M, V]; fp64 so the tail is not lost
    target = (uniforms.to(cdf.device) * cdf[:, -1])[:, None]  # [M, 1]
    index = torch.searchsorted(cdf, target).squeeze(-1)  # [M]
    return index.clamp_(max=logprobs.shape[-1] - 1)


def finish_reason(seq: Sequence, max_model_len: int, tokenizer: Detokenizer | None) -> FinishReason | None:
    """Why ``seq`` is done after its newest token, or None to go on."""
    if seq.token_ids[-1] in seq.stop_token_ids:
        return "stop"
    if seq.params.stop_strings and tokenizer is not None and _has_stop_string(seq, tokenizer):
        return "stop"
    if seq.num_output_tokens >= seq.params.max_new_tokens or seq.num_tokens >= max_model_len:
        return "length"
    return None


def _has_stop_string(seq: Sequence, tokenizer: Detokenizer) -> bool:
    """Whether the completion's tail contains a stop string (only the tail: earlier ones stopped it)."""
    stop_strings = seq.params.stop_strings
    num_window = max(len(s) for s in stop_strings) + _STOP_WINDOW_EXTRA_TOKENS
    tail = tokenizer.decode(seq.token_ids[max(seq.num_prompt_tokens, seq.num_tokens - num_window) :])
    return any(s in tail for s in stop_strings)
