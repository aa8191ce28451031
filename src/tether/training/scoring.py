"""Per-token log-probs of completions under the trainer's model, padding-free.

Sequences (prompt + completion) are packed back to back into one row and run through the decoder
with ``PackedAttention`` so no attention crosses a sequence boundary and no compute goes to padding.
When prompts repeat (the G samples of a GRPO group), each distinct prompt is packed once and its
completions attend to it through ``SharedPrefixAttention``: the prompt's forward and backward run
once per group instead of G times, with the same log-probs and gradients (summed over the group).
Only the hidden states that predict completion tokens are projected through the LM head, because
on small models the vocabulary projection dominates the cost.

The log-prob is ``tether.algorithms.logprobs``'s definition (temperature, top-k, top-p), the same
quantity the engine reports, so trainer/engine ratios are unbiased with identical weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tether.algorithms.logprobs import entropy_from_logits, gather_token_logprobs
from tether.models.attention import PackedAttention, sliding_window_args
from tether.models.prefix_attention import SharedPrefixAttention


@dataclass(frozen=True, slots=True)
class SamplingView:
    """The sampling settings under which completions were drawn (defines their log-probs)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def is_filtered(self) -> bool:
        """Top-k or top-p cut the distribution: tokens outside the kept set have probability 0."""
        return self.top_k > 0 or self.top_p < 1.0


@dataclass(slots=True)
class PackedSequences:
    input_ids: torch.Tensor  # LongTensor[1, N] all sequences back to back
    positions: torch.Tensor  # LongTensor[1, N] each sequence's own positions
    attention: PackedAttention | SharedPrefixAttention  # keeps attention inside each sequence
    predict_index: torch.Tensor  # LongTensor[M] positions whose output predicts a completion token
    targets: torch.Tensor  # LongTensor[M] the completion tokens, in (row, t) order
    row_index: torch.Tensor  # LongTensor[M] which row (0..B-1) each target belongs to
    col_index: torch.Tensor  # LongTensor[M] which completion position each target is


def _as_long(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def pack_sequences(prompt_ids: list[list[int]], completion_ids: list[list[int]],
                   windows: dict[str, Any] | None = None) -> PackedSequences:
    """Each (prompt, completion) as its own sequence, back to back (``PackedAttention``)."""
    ids: list[int] = []
    predict: list[int] = []
    rows: list[int] = []
    cols: list[int] = []
    targets: list[int] = []
    for row, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids)):
        offset = len(ids)
        # The last completion token is a target but never an input that predicts anything.
        seq = list(prompt) + list(completion[:-1]) if completion else list(prompt)
        ids.extend(seq)
        first = offset + len(prompt) - 1  # the prompt's last token predicts completion[0]
        predict.extend(range(first, first + len(completion)))
        rows.extend([row] * len(completion))
        cols.extend(range(len(completion)))
        targets.extend(completion)
    seq_lens = [len(p) + max(len(c) - 1, 0) for p, c in zip(prompt_ids, completion_ids)]
    attention = PackedAttention(seq_lens, **(windows or {}))
    return PackedSequences(_as_long(ids)[None], attention.positions(), attention, _as_long(predict),
                           _as_long(targets), _as_long(rows), _as_long(cols))


def shared_prompts(prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """(distinct prompts in first-seen order, each row's index among them).

    >>> shared_prompts([[1, 2], [1, 2], [3]])
    ([[1, 2], [3]], [0, 0, 1])
    """
    index: dict[tuple[int, ...], int] = {}
    row_prompt = [index.setdefault(tuple(p), len(index)) for p in prompt_ids]
    return [list(p) for p in index], row_prompt


def pack_shared_prompts(prompt_ids: list[list[int]], completion_ids: list[list[int]],
                        windows: dict[str, Any] | None = None,
                        shared: tuple[list[list[int]], list[int]] | None = None) -> PackedSequences:
    """Each distinct prompt once, then every completion (``SharedPrefixAttention``): a GRPO group's
    prompt goes through the model once instead of once per sample. ``shared``: ``shared_prompts
    (prompt_ids)`` when the caller has it already."""
    prompts, row_prompt = shared if shared is not None else shared_prompts(prompt_ids)
    suffix_lens = [max(len(c) - 1, 0) for c in completion_ids]
    attention = SharedPrefixAttention([len(p) for p in prompts], suffix_lens, row_prompt, **(windows or {}))
    prompt_starts, suffix_starts = attention.prefix_starts(), attention.suffix_starts()
    ids = [t for p in prompts for t in p] + [t for c in completion_ids for t in c[:-1]]
    predict: list[int] = []
    rows: list[int] = []
    cols: list[int] = []
    targets: list[int] = []
    for row, completion in enumerate(completion_ids):
        if not completion:
            continue
        g = row_prompt[row]
        predict.append(prompt_starts[g] + len(prompts[g]) - 1)  # the prompt's last token
        predict.extend(range(suffix_starts[row], suffix_starts[row] + len(completion) - 1))
        rows.extend([row] * len(completion))
        cols.extend(range(len(completion)))
        targets.extend(completion)
    return PackedSequences(_as_long(ids)[None], attention.positions(), attention, _as_long(predict),
                           _as_long(targets), _as_long(rows), _as_long(cols))


def completion_logprobs(model: torch.nn.Module, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                        sampling: SamplingView, *, num_cols: int | None = None,
                        with_entropy: bool = False, share_prompts: bool = True
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of each completion token: FloatTensor[B, T] right-padded with 0.

    Differentiable when called with grad enabled. ``num_cols`` fixes T (default: longest completion).
    ``share_prompts``: rows with the same prompt (a GRPO group) share one pass over it; same result.
    """
    (logp,), entropy = completion_logprobs_under(model, prompt_ids, completion_ids, [sampling], num_cols=num_cols,
                                                 with_entropy=with_entropy, share_prompts=share_prompts)
    return logp, entropy


def completion_logprobs_under(model: torch.nn.Module, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                              views: list[SamplingView], *, num_cols: int | None = None,
                              with_entropy: bool = False, share_prompts: bool = True
                              ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """``completion_logprobs`` under each of ``views`` from one forward (the policy's log-probs as
    sampled, and unfiltered ones for its KL to the reference); entropies under ``views[0]``."""
    windows = sliding_window_args(model.config)
    shared = shared_prompts(prompt_ids) if share_prompts else None
    if shared is not None and len(shared[0]) < len(prompt_ids):
        packed = pack_shared_prompts(prompt_ids, completion_ids, windows, shared)
    else:
        packed = pack_sequences(prompt_ids, completion_ids, windows)
    hidden = model(packed.input_ids, packed.positions, packed.attention)  # [1, N, H]
    logits = model.compute_logits(hidden[0, packed.predict_index])  # [M, V]
    num_rows = len(prompt_ids)
    num_cols = num_cols if num_cols is not None else max((len(c) for c in completion_ids), default=0)
    outs = []
    for view in views:
        token_logp = gather_token_logprobs(logits, packed.targets, view.temperature, view.top_k,
                                           view.top_p)  # [M] fp32
        out = token_logp.new_zeros(num_rows, num_cols)
        outs.append(out.index_put((packed.row_index, packed.col_index), token_logp))
    entropy = None
    if with_entropy:
        with torch.no_grad():  # entropy is a metric here, not a loss term
            scaled = logits.detach().float() / (views[0].temperature or 1.0)
            ent = entropy_from_logits(scaled)
        entropy = ent.new_zeros(num_rows, num_cols).index_put((packed.row_index, packed.col_index), ent)
    return outs, entropy
