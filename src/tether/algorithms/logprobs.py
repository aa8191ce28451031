"""The one definition of a sampled token's log-prob, shared by the engine's sampler and the trainer.

A token's log-prob is taken under the distribution it was drawn from (what vLLM calls "processed
logprobs"): logits / temperature, restricted to the top-k, then to the top-p nucleus, then to the
min-p set, renormalised over what survives (filtered tokens get -inf); the order of transformers'
warpers and SGLang (vLLM applies min-p first, so its top-p nucleus is taken after min-p: with both
set the two differ). Greedy decoding
(temperature 0) reports the log-prob under the raw softmax (temperature 1), because argmax has no
distribution of its own. If the engine and the trainer disagreed on this definition, every
importance ratio pi_trainer / pi_engine would be biased even with identical weights.

Sampling parameters are Python numbers (one setting for the whole batch) or tensors whose shape
broadcasts to ``logits.shape[:-1]`` (e.g. ``[N]`` for logits ``[N, V]``: one setting per row), so a
batch that mixes requests with different settings is processed in one call without host syncs.
"""

from __future__ import annotations

import torch

Param = float | int | torch.Tensor

# Rows per fp32 chunk in gather_token_logprobs / entropy_from_logits: 1024 rows x 152k vocab x 4 B
# = 620 MB of fp32 temporaries at most, whatever the batch size.
DEFAULT_CHUNK_ROWS = 1024


def _as_row_param(value: Param, like: torch.Tensor) -> torch.Tensor:
    """A scalar or per-row parameter as an fp32 tensor shaped ``[..., 1]`` against logits ``[..., V]``."""
    if not isinstance(value, torch.Tensor):  # filled on the device: a copy from the host would sync a GPU
        return torch.full((*like.shape[:-1], 1), float(value), dtype=torch.float32, device=like.device)
    param = value.to(dtype=torch.float32, device=like.device)
    return param.expand(like.shape[:-1]).unsqueeze(-1)


def _is_noop_filter(top_k: Param, top_p: Param, min_p: Param) -> bool:
    """True when all filters are plain numbers that disable themselves, so the sort can be skipped."""
    if any(isinstance(p, torch.Tensor) for p in (top_k, top_p, min_p)):
        return False  # deciding would need a host sync; the general path is exact either way
    return top_k <= 0 and top_p >= 1.0 and min_p <= 0.0


def _keep_mask(scaled: torch.Tensor, top_k: Param, top_p: Param, min_p: Param) -> torch.Tensor:
    """Which tokens survive top-k -> top-p -> min-p. scaled: [..., V] fp32 -> BoolTensor[..., V]."""
    vocab_size = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [..., V]
    rank = torch.arange(vocab_size, device=scaled.device)  # [V]
    # Where equal logits land in the sort is the sort's choice (stable or not, CPU or GPU): each rule
    # reads a token's tie run by its first rank, so equal logits are kept or dropped together and the
    # mask is a function of the values alone, the same on the engine's device and the trainer's.
    is_run_start = torch.ones_like(sorted_logits, dtype=torch.bool)
    is_run_start[..., 1:] = sorted_logits[..., 1:] != sorted_logits[..., :-1]
    run_start = torch.where(is_run_start, rank, 0).cummax(dim=-1).values  # [..., V]

    # Top-k keeps every token tied with the k-th largest (HF's and vLLM's threshold).
    k = _as_row_param(top_k, scaled)  # [..., 1]
    keep = (k <= 0) | (run_start < k)  # [..., V] in sorted order

    # Top-p acts on the distribution renormalised after top-k (as in vLLM and HF's warpers).
    # A token is in the nucleus when the mass of the tokens strictly more likely is < top_p: the
    # smallest prefix whose mass reaches top_p, ties included. top_p >= 1 disables the filter so
    # rounding cannot drop a tail token.
    probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)  # [..., V]
    mass_before = (probs.cumsum(dim=-1) - probs).gather(-1, run_start)
    p = _as_row_param(top_p, scaled)
    keep &= (p >= 1.0) | (mass_before < p)

    # Min-p compares p_i / p_max = exp(l_i - l_max), which renormalisation does not change.
    m = _as_row_param(min_p, scaled)
    keep &= (m <= 0.0) | (probs >= m * probs[..., :1])

    keep |= run_start == 0  # the most likely tokens always survive, whatever the thresholds
    return torch.zeros_like(keep).scatter(-1, order, keep)  # back to vocabulary order


def process_logits(
    logits: torch.Tensor,
    temperature: Param,
    top_k: Param = 0,
    top_p: Param = 1.0,
    min_p: Param = 0.0,
) -> torch.Tensor:
    """Log-probs of the sampling distribution. logits: [..., V] (any dtype) -> fp32 [..., V].

    Filtered tokens are -inf and the surviving log-probs logsumexp to 0. Where temperature is 0
    (greedy), the row is ``log_softmax(logits)`` with no filtering.
    """
    logits = logits.float()
    is_scalar_temperature = not isinstance(temperature, torch.Tensor)
    if is_scalar_temperature and temperature <= 0:
        return torch.log_softmax(logits, dim=-1)
    if is_scalar_temperature and temperature == 1.0:
        scaled = logits  # x / 1.0 == x exactly: skip a full [..., V] pass (the common RL setting)
    else:
        temp = _as_row_param(temperature, logits)  # [..., 1]
        scaled = logits / torch.where(temp <= 0, torch.ones_like(temp), temp)  # [..., V]
    if not _is_noop_filter(top_k, top_p, min_p):
        scaled = scaled.masked_fill(~_keep_mask(scaled, top_k, top_p, min_p), float("-inf"))
    processed = torch.log_softmax(scaled, dim=-1)  # [..., V]
    if is_scalar_temperature:
        return processed  # no greedy row: skip a second [..., V] softmax
    is_greedy = _as_row_param(temperature, logits) <= 0  # [..., 1]
    return torch.where(is_greedy, torch.log_softmax(logits, dim=-1), processed)


def _row_chunks(num_rows: int, chunk_rows: int) -> list[slice]:
    return [slice(start, min(start + chunk_rows, num_rows)) for start in range(0, num_rows, chunk_rows)]


def _flat_param(value: Param, leading_shape: torch.Size, device: torch.device) -> Param:
    """A per-row parameter broadcast to ``leading_shape`` and flattened to ``[N]``; numbers pass through."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.to(device).expand(leading_shape).reshape(-1)


def gather_token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: Param = 1.0,
    top_k: Param = 0,
    top_p: Param = 1.0,
    min_p: Param = 0.0,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> torch.Tensor:
    """Log-prob of each target token under ``process_logits``. logits: [..., V], targets: [...] -> fp32 [...].

    Rows are processed in fp32 chunks of ``chunk_rows`` so that bf16 logits of a long batch never
    exist in fp32 all at once (under ``torch.no_grad``; with autograd each chunk's softmax is kept
    for backward). Differentiable w.r.t. logits. A target removed by top-k/top-p/min-p gets -inf.
    """
    leading_shape = logits.shape[:-1]
    flat_logits = logits.reshape(-1, logits.shape[-1])  # [N, V]
    flat_targets = targets.reshape(-1, 1).long()  # [N, 1]
    params = [_flat_param(p, leading_shape, logits.device) for p in (temperature, top_k, top_p, min_p)]
    is_plain = isinstance(temperature, (int, float)) and temperature == 1.0 and _is_noop_filter(*params[1:])
    pieces = []
    for rows in _row_chunks(flat_logits.shape[0], chunk_rows):
        chunk = flat_logits[rows].float()  # [n, V]
        chunk_targets = flat_targets[rows]
        if is_plain:
            # logit[target] - logsumexp avoids materialising a second [n, V] tensor.
            picked = chunk.gather(-1, chunk_targets).squeeze(-1) - torch.logsumexp(chunk, dim=-1)
        else:
            chunk_params = [p[rows] if isinstance(p, torch.Tensor) else p for p in params]
            picked = process_logits(chunk, *chunk_params).gather(-1, chunk_targets).squeeze(-1)
        pieces.append(picked)
    if not pieces:
        return torch.empty(leading_shape, dtype=torch.float32, device=logits.device)
    return torch.cat(pieces).reshape(leading_shape)


def entropy_from_logits(logits: torch.Tensor, chunk_rows: int = DEFAULT_CHUNK_ROWS) -> torch.Tensor:
    """Entropy of softmax(logits) in nats. logits: [..., V] -> fp32 [...].

    H = -sum_i p_i log p_i, computed in fp32 chunks like ``gather_token_logprobs``. Tokens at -inf
    (already filtered) contribute 0 rather than 0 * -inf = NaN, in the forward and the backward.
    """
    leading_shape = logits.shape[:-1]
    flat_logits = logits.reshape(-1, logits.shape[-1])  # [N, V]
    pieces = []
    for rows in _row_chunks(flat_logits.shape[0], chunk_rows):
        logp = torch.log_softmax(flat_logits[rows].float(), dim=-1)  # [n, V]
        probs = logp.exp()
        pieces.append(-(probs * logp.masked_fill(probs == 0, 0.0)).sum(dim=-1))
    if not pieces:
        return torch.empty(leading_shape, dtype=torch.float32, device=logits.device)
    return torch.cat(pieces).reshape(leading_shape)
