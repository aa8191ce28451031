"""Sampling a token per sequence, its log-prob, and deciding when a sequence is done.

The distribution is ``tether.algorithms.logprobs.process_logits`` -- the trainer's own definition
-- so a reported log-prob is exactly what the trainer recomputes with the same settings.

Each sampling row draws one uniform from its sequence's own counter-based stream
(``tether.engine.rng``) and inverts the row's CDF. A row's sample therefore depends only on its
logits, its seed and how many draws it made before, never on which other sequences share the step
(same seed, same sample, whatever the batch). The logits themselves are the same bits in any batch
where the runner is batch-invariant (``engine.batch_invariant``, on by default for fp32 on the CPU with
the compiled kernel). Without it the forward's matmuls and attention round differently with the
batch's shape, prefill chunking and speculative spans (~1e-6), and a uniform that falls within that
of a CDF boundary picks the neighbouring token: 3 of 32 seeded samples of 64 tokens diverged somewhere
on the engine benchmark's random model with a near-uniform 32k vocabulary, and log-probs differed in
their last bits everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from tether.algorithms.logprobs import process_logits
from tether.engine.rng import STOP_DRAW, SampleRNG, draw_uniforms, position_uniforms
from tether.engine.sequence import Sequence
from tether.engine.types import FinishReason, SamplingParams

# Tokens decoded to look for a stop string: one per byte of its UTF-8 (a byte-level tokenizer can
# spend a token on each: 3 for a CJK character, 4 for an emoji), plus this many for tokens that decode
# to nothing on their own, without decoding the whole completion every step.
_STOP_WINDOW_EXTRA_TOKENS = 8
_STOP_CONTEXT_TOKENS = 4  # decoded before a text, for its first word (completion_text)
_CDF_CHUNK = 256  # tokens per chunk of the two-level inverse-CDF search
_SAMPLE_ROW_BLOCK = 16  # rows per block of the unfiltered sampler's passes (see _sample_plain)


class Detokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str: ...


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float]  # fp32 log-prob of each token under process_logits


def read_on_host(*tensors: torch.Tensor) -> list[list]:
    """``t.tolist()`` of each of ``tensors`` (one leading size N, each ``[N]`` or ``[N, K]``), in one copy
    from a GPU (a host sync) instead of one per tensor: packed as float64 (integers exact below 2**53)
    and split back, an integer tensor's values as ints."""
    if tensors[0].device.type != "cuda":
        return [t.tolist() for t in tensors]
    num_rows, widths = tensors[0].shape[0], [1 if t.dim() == 1 else t.shape[1] for t in tensors]
    rows = torch.cat([t.double().reshape(num_rows, w) for t, w in zip(tensors, widths)], dim=1).tolist()
    out, start = [], 0
    for t, width in zip(tensors, widths):
        cast = float if t.is_floating_point() else int
        part = [[cast(v) for v in row[start : start + width]] for row in rows]
        out.append([values[0] for values in part] if t.dim() == 1 else part)
        start += width
    return out


def _row_param(values: list[float], dtype: torch.dtype, device: torch.device) -> float | torch.Tensor:
    """One number when the batch agrees (lets process_logits skip its sort), else a per-row tensor."""
    first = values[0]
    if all(value == first for value in values):
        return first
    return torch.tensor(values, dtype=dtype, device=device)


def processed_logprobs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits ``[N, V]`` (row i sampled with params[i]) -> fp32 log-probs ``[N, V]`` under process_logits."""
    device = logits.device
    temperature = _row_param([p.temperature for p in params], torch.float32, device)
    top_k = _row_param([p.top_k for p in params], torch.long, device)
    top_p = _row_param([p.top_p for p in params], torch.float32, device)
    min_p = _row_param([p.min_p for p in params], torch.float32, device)
    return process_logits(logits, temperature, top_k, top_p, min_p)


# (logits [N, V] fp32 CPU contiguous, overwritten with weights, temperature, chunk) -> chunk sums
# [N, C]: ``native.SamplingWeights``, the compiled pass of the plain path where the engine has it.
WeightsKernel = Callable[[torch.Tensor, float, int], torch.Tensor]


class Sampler:
    def __init__(self, weights_kernel: WeightsKernel | None = None) -> None:
        self.weights_kernel = weights_kernel  # the plain path's weights and chunk sums, compiled

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], rngs: list[SampleRNG],
        may_overwrite: bool = False, positions: list[int] | None = None,
    ) -> SampleResult:
        """logits ``[N, V]`` (row i belongs to params[i], rngs[i]) -> a token and log-prob per row.

        Every sampling (non-greedy) row draws exactly one uniform from its stream; greedy rows none.
        With ``positions`` (row i's output position), the draw is the one draft-model speculation
        would make for a token it does not draft (``position_uniforms``, ``STOP_DRAW``) and the
        streams do not advance: rows of such an engine that take a plain step spend no draw that its
        acceptance tests use. ``may_overwrite``: the caller no longer needs ``logits`` (the engine's
        own step output), so the plain path may work in place instead of allocating another
        ``[N, V]`` tensor."""
        sampling = [i for i, p in enumerate(params) if not p.is_greedy]
        uniforms = torch.zeros(len(params))  # [N] greedy rows draw none (their entry is not read)
        if sampling and positions is None:
            uniforms[sampling] = draw_uniforms([rngs[i] for i in sampling])[:, 0]
        elif sampling:
            at = np.array([[positions[i]] for i in sampling])
            uniforms[sampling] = position_uniforms([rngs[i] for i in sampling], at, STOP_DRAW)[:, 0]
        return sample_with_uniforms(logits, params, uniforms.to(logits.device), may_overwrite, self.weights_kernel)


def sample_with_uniforms(
    logits: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor, may_overwrite: bool = False,
    weights_kernel: WeightsKernel | None = None,
) -> SampleResult:
    """``Sampler.sample`` with row i's uniform given (``uniforms`` ``[N]``; greedy rows ignore
    theirs): speculative decoding's coupled test draws what a plain step would, with the rounding of
    the path the row's settings pick (``_path``), given the sampler's ``weights_kernel``."""
    paths = [_path(p) for p in params]
    if len(set(paths)) > 1:
        return _sample_by_path(logits, params, uniforms, paths, weights_kernel)
    temperature = paths[0]
    if temperature is None:
        return _sample_general(logits, params, uniforms)
    return _sample_plain(logits, temperature, uniforms, may_overwrite, weights_kernel)


def _sample_by_path(
    logits: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor, paths: list[float | None],
    weights_kernel: WeightsKernel | None = None,
) -> SampleResult:
    """A step whose rows need different paths (``_path``): each plain row through ``_sample_plain``
    with the rows of its temperature, the rest through the general path. A row's path depends on its
    own settings only, so a seeded row samples the same token whatever shares its step: the two paths
    round their CDFs differently, and a uniform near a boundary picked another token by path."""
    token_ids, logprobs = [0] * len(params), [0.0] * len(params)
    by_path: dict[float | None, list[int]] = {}
    for i, path in enumerate(paths):
        by_path.setdefault(path, []).append(i)
    for temperature, rows in by_path.items():
        index = torch.tensor(rows, device=logits.device)
        rows_params, rows_uniforms = [params[i] for i in rows], uniforms[index]
        if temperature is None:
            result = _sample_general(logits[index], rows_params, rows_uniforms)
        else:  # logits[index] is a copy: the plain path may work in place
            result = _sample_plain(logits[index], temperature, rows_uniforms, True, weights_kernel)
        for i, token_id, logprob in zip(rows, result.token_ids, result.logprobs):
            token_ids[i], logprobs[i] = token_id, logprob
    return SampleResult(token_ids, logprobs)


def _sample_general(logits: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor) -> SampleResult:
    """Any mix of settings: the full ``process_logits`` distribution, argmax for greedy rows."""
    device = logits.device
    logprobs = processed_logprobs(logits, params)  # [N, V] fp32
    sampled_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if len(sampled_rows) == len(params):  # skip the argmax pass: it costs as much as sampling
        token_ids = inverse_cdf(logprobs.exp(), uniforms)
    else:
        token_ids = logprobs.argmax(dim=-1)  # [N]; final for greedy rows
        if sampled_rows:
            rows = torch.tensor(sampled_rows, device=device)
            token_ids[rows] = inverse_cdf(logprobs[rows].exp(), uniforms[rows])
    picked = logprobs.gather(-1, token_ids[:, None]).squeeze(-1)  # [N]
    return SampleResult(*read_on_host(token_ids, picked))  # the path's one host sync


def _path(params: SamplingParams) -> float | None:
    """A row's sampling path: its temperature for ``_sample_plain`` when it samples (not greedy) with
    no top-k/top-p/min-p (the RL default), else None for ``_sample_general``."""
    is_plain = not params.is_greedy and params.top_k <= 0 and params.top_p >= 1.0 and params.min_p <= 0.0
    return params.temperature if is_plain else None


def _sample_plain(logits: torch.Tensor, temperature: float, uniforms: torch.Tensor,
                  may_overwrite: bool = False, weights_kernel: WeightsKernel | None = None) -> SampleResult:
    """``Sampler.sample`` without filters, in three passes over ``[N, V]`` instead of six.

    ``process_logits`` here is ``log_softmax(logits / t)``; its value at the sampled token is
    ``x - max - log(sum(exp(x - max)))``, the same formula ``log_softmax`` evaluates, so only the
    picked tokens need it. The inverse CDF runs on the unnormalised ``exp(x - max)`` (it scales by
    the row total), and that total is the sum the log-prob needs. Same token as the general path
    for the same uniform (up to float rounding at a CDF boundary); log-probs agree to ~1e-6.

    ``x - max`` is not kept: the picked token's is read back as ``log(exp(x - max))``, exact to
    ~1e-7 relative (the sampled token always has positive weight). So the weights can be computed
    in place whenever the logits are ours to overwrite (``may_overwrite``, or a copy made here by
    ``.float()`` or the division): another [N, V] tensor per step cost ~3 ms of a 40 ms decode
    step (128 x 32000 logits, 2 threads).

    The passes run ``_SAMPLE_ROW_BLOCK`` rows at a time, so that a block's logits (2 MB at a 32k
    vocabulary) stay in cache from the max to the chunk sums instead of streaming the whole
    ``[N, V]`` through memory four times: 6.5 -> 5.2 ms per step at 256 x 32000, no change at 128
    rows (their 16 MB of logits already stay in cache).

    ``weights_kernel`` (the compiled ``sampling_weights``, CPU): the same passes, a row per task with
    its ~128 KB in L2, in place (4.65 -> 2.64 ms per step at 128 x 32000 with the search, 2 threads).
    Its exponential rounds unlike torch's (~1 ulp), so an engine samples through one or the other,
    never both: speculative decoding's coupled test takes the engine's too.
    """
    scaled = logits.float()
    is_owned = may_overwrite or scaled is not logits
    if weights_kernel is not None and scaled.device.type == "cpu" and scaled.is_contiguous():
        weights = scaled if is_owned else scaled.clone()  # [N, V] unnormalised probabilities
        chunk_sums = weights_kernel(weights, temperature, _CDF_CHUNK)  # [N, C]
    else:
        weights, chunk_sums = _weights(scaled, temperature, is_owned)
    token_ids, totals = _search(weights, chunk_sums, uniforms)  # [N], [N]
    picked = weights.gather(-1, token_ids[:, None]).squeeze(-1).log() - totals.log()  # [N]
    return SampleResult(*read_on_host(token_ids, picked))  # the path's one host sync


def _weights(scaled: torch.Tensor, temperature: float, is_owned: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``_sample_plain``'s passes by torch ops: (weights ``[N, V]``, in place where ``is_owned``,
    chunk sums ``[N, C]``)."""
    weights = scaled if is_owned else torch.empty_like(scaled)  # [N, V] unnormalised probabilities
    num_rows = scaled.shape[0]
    chunk_sums = scaled.new_empty(num_rows, _num_chunks(scaled.shape[1]))  # [N, C]
    # A GPU takes all rows at once: there a block is ~5 kernel launches, and caches are no matter.
    row_block = _SAMPLE_ROW_BLOCK if scaled.device.type == "cpu" else max(num_rows, 1)
    for first in range(0, num_rows, row_block):
        rows = slice(first, first + row_block)
        block = scaled[rows]
        if temperature != 1.0:  # x / 1.0 == x: skip the pass, as process_logits does
            block = torch.div(block, temperature, out=weights[rows])
        peak = block.amax(dim=-1, keepdim=True)  # [B, 1]
        torch.sub(block, peak, out=weights[rows]).exp_()  # x - max, then exp: max weight 1
        chunk_sums[rows] = _chunk_sums(weights[rows])
    return weights, chunk_sums


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs [M, V] (non-negative, need not sum to 1), uniforms [M] in [0, 1) -> LongTensor [M].

    Two-level search instead of a full ``cumsum`` over the vocabulary (the step's costliest
    elementwise pass): pick a chunk of ``_CDF_CHUNK`` tokens by the CDF of chunk sums, then a token
    by the CDF inside that chunk. Each row is scaled by its own total, so unnormalised rows (a
    speculative-decoding residual) sample their normalised distribution.
    """
    return _search(probs, _chunk_sums(probs), uniforms)[0]


def _num_chunks(vocab_size: int) -> int:
    return -(-vocab_size // _CDF_CHUNK)


def _chunk_sums(probs: torch.Tensor) -> torch.Tensor:
    """probs [M, V] -> [M, C]: the sum of each chunk of ``_CDF_CHUNK`` tokens (the last may be short)."""
    num_rows, vocab_size = probs.shape
    num_full = vocab_size // _CDF_CHUNK
    full = probs[:, : num_full * _CDF_CHUNK].reshape(num_rows, num_full, _CDF_CHUNK).sum(dim=-1)  # [M, C']
    if num_full * _CDF_CHUNK == vocab_size:
        return full
    return torch.cat([full, probs[:, num_full * _CDF_CHUNK :].sum(dim=-1, keepdim=True)], dim=-1)


def _search(probs: torch.Tensor, chunk_sums: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two-level inverse-CDF draw of ``inverse_cdf`` given ``_chunk_sums(probs)``; also
    returns each row's total ``[M]`` (the sum of its probs)."""
    num_rows, vocab_size = probs.shape
    num_chunks = chunk_sums.shape[1]
    chunk_cdf = chunk_sums.cumsum(dim=-1)  # [M, C]
    # 1 - U[0, 1) lies in (0, 1]; scaled by the row's own total it stays inside the CDF.
    target = (1.0 - uniforms.to(probs.dtype)) * chunk_cdf[:, -1]  # [M]
    chunk = torch.searchsorted(chunk_cdf, target[:, None]).clamp_(max=num_chunks - 1)  # [M, 1]
    before = torch.where(chunk > 0, chunk_cdf.gather(-1, (chunk - 1).clamp(min=0)), 0.0)  # [M, 1]
    # The chosen chunk's tokens [M, K], the short last chunk padded with zero mass.
    columns = chunk * _CDF_CHUNK + torch.arange(_CDF_CHUNK, device=probs.device)  # [M, K]
    is_padding = columns >= vocab_size
    inner_probs = probs.gather(-1, columns.clamp(max=vocab_size - 1)).masked_fill_(is_padding, 0.0)
    inner_cdf = inner_probs.cumsum(dim=-1)  # [M, K]
    # A positive residual at most the chunk's total lands on a token with positive mass: the
    # first index whose CDF reaches it is where the CDF rose.
    residual = torch.minimum(
        (target[:, None] - before).clamp(min=torch.finfo(probs.dtype).tiny), inner_cdf[:, -1:]
    )
    inner = torch.searchsorted(inner_cdf, residual).clamp_(max=_CDF_CHUNK - 1)  # [M, 1]
    # A NaN row (non-finite logits) searches past its real tokens into the padding: keep the id in
    # the vocabulary; its NaN total and log-prob tell the engine to fail that row alone.
    token_ids = (chunk * _CDF_CHUNK + inner).squeeze(-1).clamp_(max=vocab_size - 1)
    return token_ids, chunk_cdf[:, -1]


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
    """Whether the completion's tail contains a stop string (only the tail: earlier ones stopped it).
    Special tokens are left out of the text, as in the text ``tether generate`` writes (and vLLM's): a
    stop string "os" does not match ``<eos>``; stop a special token by its id (``stop_token_ids``)."""
    stop_strings = seq.params.stop_strings
    num_window = max(len(s.encode("utf-8")) for s in stop_strings) + _STOP_WINDOW_EXTRA_TOKENS
    start = max(seq.num_prompt_tokens, seq.num_tokens - num_window)
    context = seq.token_ids[max(0, start - _STOP_CONTEXT_TOKENS) : start]  # what completion_text reads of it
    tail = completion_text(tokenizer, context, seq.token_ids[start:])
    return any(s in tail for s in stop_strings)


def completion_text(tokenizer: Detokenizer, prompt_ids: list[int], token_ids: list[int]) -> str:
    """A completion's text as it reads after its prompt, special tokens left out: the text stop
    strings are matched in and ``tether generate`` writes (vLLM's output text; reward functions get
    the ids decoded alone, as in TRL: ``recipes.grpo.reward_text``). It differs from
    ``tokenizer.decode(token_ids)`` only where the prompt gives context: a SentencePiece tokenizer
    (Llama 2, Mistral) drops the word-start space of a text's first token, so a completion " Answer"
    decoded alone reads "Answer". Decoded after the prompt's last few tokens, whose text is cut off."""
    context = list(prompt_ids[-_STOP_CONTEXT_TOKENS:])
    if not context:
        return tokenizer.decode(token_ids, skip_special_tokens=True)
    text = tokenizer.decode(context + list(token_ids), skip_special_tokens=True)
    prefix = tokenizer.decode(context, skip_special_tokens=True)
    # (Context that ends inside a character's bytes decodes to a replacement character: then alone.)
    return text[len(prefix) :] if text.startswith(prefix) else tokenizer.decode(token_ids, skip_special_tokens=True)
