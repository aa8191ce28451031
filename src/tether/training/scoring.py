"""Per-token log-probs of completions under the trainer's model, padding-free.

Sequences (prompt + completion) are packed back to back into one row and run through the decoder
with ``PackedAttention`` so no attention crosses a sequence boundary and no compute goes to padding.
Only the hidden states that predict completion tokens are projected through the LM head, because
on small models the vocabulary projection dominates the cost.

The log-prob is ``tether.algorithms.logprobs``'s definition (temperature, top-k, top-p), the same
quantity the engine reports, so trainer/engine ratios are unbiased with identical weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tether.algorithms.logprobs import entropy_from_logits, gather_token_logprobs
from tether.models.attention import PackedAttention


@dataclass(frozen=True, slots=True)
class SamplingView:
    """The sampling settings under which completions were drawn (defines their log-probs)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0


@dataclass(slots=True)
class PackedSequences:
    input_ids: torch.Tensor  # LongTensor[1, N] all sequences back to back
    positions: torch.Tensor  # LongTensor[1, N] restarting at 0 per sequence
    seq_lens: list[int]  # [B]
    predict_index: torch.Tensor  # LongTensor[M] positions whose output predicts a completion token
    targets: torch.Tensor  # LongTensor[M] the completion tokens, in (row, t) order
    row_index: torch.Tensor  # LongTensor[M] which row (0..B-1) each target belongs to
    col_index: torch.Tensor  # LongTensor[M] which completion position each target is


def pack_sequences(prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> PackedSequences:
    ids: list[int] = []
    positions: list[int] = []
    predict: list[int] = []
    rows: list[int] = []
    cols: list[int] = []
    targets: list[int] = []
    for row, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids)):
        offset = len(ids)
        # The last completion token is a target but never an input that predicts anything.
        seq = list(prompt) + list(completion[:-1]) if completion else list(prompt)
        ids.extend(seq)
        positions.extend(range(len(seq)))
        first = offset + len(prompt) - 1  # the prompt's last token predicts completion[0]
        predict.extend(range(first, first + len(completion)))
        rows.extend([row] * len(completion))
        cols.extend(range(len(completion)))
        targets.extend(completion)
    seq_lens = [len(p) + max(len(c) - 1, 0) for p, c in zip(prompt_ids, completion_ids)]
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    return PackedSequences(as_long(ids).unsqueeze(0), as_long(positions).unsqueeze(0), seq_lens,
                           as_long(predict), as_long(targets), as_long(rows), as_long(cols))


def completion_logprobs(model: torch.nn.Module, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                        sampling: SamplingView, *, num_cols: int | None = None,
                        with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of each completion token: FloatTensor[B, T] right-padded with 0.

    Differentiable when called with grad enabled. ``num_cols`` fixes T (default: longest completion).
    """
    packed = pack_sequences(prompt_ids, completion_ids)
    hidden = model(packed.input_ids, packed.positions, PackedAttention(packed.seq_lens))  # [1, N, H]
    logits = model.compute_logits(hidden[0, packed.predict_index])  # [M, V]
    token_logp = gather_token_logprobs(logits, packed.targets, sampling.temperature, sampling.top_k,
                                       sampling.top_p)  # [M] fp32
    num_rows = len(prompt_ids)
    num_cols = num_cols if num_cols is not None else max((len(c) for c in completion_ids), default=0)
    out = token_logp.new_zeros(num_rows, num_cols)
    out = out.index_put((packed.row_index, packed.col_index), token_logp)
    entropy = None
    if with_entropy:
        with torch.no_grad():  # entropy is a metric here, not a loss term
            scaled = logits.detach().float() / (sampling.temperature or 1.0)
            ent = entropy_from_logits(scaled)
        entropy = ent.new_zeros(num_rows, num_cols).index_put((packed.row_index, packed.col_index), ent)
    return out, entropy
