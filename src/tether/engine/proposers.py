"""Proposers of draft tokens for speculative decoding: prompt lookup and a small draft model.

A proposer gives each decoding sequence up to k draft tokens (``Proposal``) and, for a draft model,
the distributions they were drawn from; ``tether.engine.speculative`` verifies them in one target
forward with a test that keeps the output distribution exactly the target's. ``build_proposer``
picks one from ``EngineConfig.speculative``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np
import torch

from tether.engine.attention import SeqSpan
from tether.engine.config import EngineConfig
from tether.engine.rng import DRAFT_DRAW, position_uniforms
from tether.engine.runner import DecoderModel, ModelRunner, StepInput
from tether.engine.sampler import inverse_cdf, processed_logprobs
from tether.engine.sequence import Sequence
from tether.errors import ConfigError


@dataclass(slots=True)
class Proposal:
    token_ids: list[int]  # [n] draft tokens fed to the target, n <= the slots the scheduler gave; may be empty
    # [n, V] the draft distributions q_i the tokens were drawn from; None: point masses (q_i(d_i) = 1)
    draft_probs: torch.Tensor | None = None
    # [V] the draft's distribution for the token after the fed drafts (the *tail*: see
    # ``tether.engine.speculative``): the verifier draws a draft from it and tests it against the
    # target's last row. None: no tail.
    tail_probs: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_empty(self) -> bool:
        return not self.token_ids and self.tail_probs is None


class Proposer(Protocol):
    # Whether the sampled rows of an engine with this proposer draw by output position
    # (``rng.position_uniforms``) rather than from their stream's counter: also in plain steps, so that
    # no draw is spent twice (``LLMEngine._sample_and_finish``).
    is_position_keyed: bool

    def propose(
        self, seqs: list[Sequence], max_num_tokens: list[int], block_copies: list[tuple[int, int]]
    ) -> list[Proposal]:
        """Up to ``max_num_tokens[i]`` draft tokens continuing ``seqs[i]`` (slots already allocated).

        ``block_copies`` are the step's copy-on-write copies, for proposers that keep KV in the
        engine's block tables; they are passed every step, even with no sequence to propose for.
        """
        ...


# ---------------------------------------------------------------------------- prompt lookup


def ngram_lookup(token_ids: list[int], n_max: int, n_min: int, num_tokens: int) -> list[int]:
    """The ``num_tokens`` tokens that followed the most recent earlier occurrence of the last n tokens.

    n is the longest suffix length in [n_min, n_max] that occurs earlier (a longer match predicts
    better); [] when none does. One right-to-left pass over the context: O(L) host work per call.
    """
    num_all = len(token_ids)
    last = token_ids[-1]
    best_len, best_end = 0, -1
    # ``end`` is where an earlier occurrence ends; end <= num_all - 2 leaves a token after it.
    for end in range(num_all - 2, -1, -1):
        if token_ids[end] != last:
            continue
        length = 1
        while length < n_max and length <= end and token_ids[end - length] == token_ids[-1 - length]:
            length += 1
        if length > best_len:
            best_len, best_end = length, end
            if length == n_max:
                break  # nothing longer counts, and this is the most recent of this length
    if best_len < n_min:
        return []
    return token_ids[best_end + 1 : best_end + 1 + num_tokens]


@dataclass(slots=True)
class NgramProposer:
    """Prompt lookup decoding (Saxena 2023): drafts copied from the sequence's own context."""

    n_max: int = 4
    n_min: int = 1
    num_tokens: int = 4  # k
    is_position_keyed: ClassVar[bool] = False  # the coupled test draws from the plain stream

    def propose(
        self, seqs: list[Sequence], max_num_tokens: list[int], block_copies: list[tuple[int, int]]
    ) -> list[Proposal]:
        return [
            Proposal(ngram_lookup(seq.token_ids, self.n_max, self.n_min, min(self.num_tokens, num)) if num else [])
            for seq, num in zip(seqs, max_num_tokens)
        ]


# ---------------------------------------------------------------------------- draft model


class DraftModelProposer:
    """A small decoder (same vocabulary) drafts k tokens autoregressively, greedy or sampled from q.

    Its KV lives in a pool of its own with the target's geometry (``num_blocks`` x ``block_size``)
    and is addressed through the *target's* block tables, so allocation, forking, copy-on-write,
    preemption and rollback need no second bookkeeping: ``Sequence.num_draft_computed_tokens`` says
    how far the draft's KV is valid (it catches up lazily: a prompt is prefilled by the draft on its
    first proposal). Draft KV only steers proposals; acceptance uses the q each token was drawn from,
    so a stale or imprecise draft cache costs speed, never exactness.

    Every sequence that samples (not greedy) gets a tail (``tether.engine.speculative``), also with no
    slot for fed drafts: at a prompt's end, or when the step's budget ran out.
    """

    is_position_keyed = True  # the acceptance test draws by output position, so plain steps do too

    def __init__(
        self, draft_model: DecoderModel, num_tokens: int, *, num_blocks: int, block_size: int,
        is_lm_head_packed: bool = True, pack_layer_linears: str = "auto", native_attention: bool = True,
        batch_invariant: bool | str = False,
    ) -> None:
        self.num_tokens = num_tokens
        self.max_context = draft_model.config.context_length  # positions the draft serves
        self.runner = ModelRunner(draft_model, num_blocks, block_size, is_lm_head_packed, pack_layer_linears,
                                  native_attention, batch_invariant)

    def propose(
        self, seqs: list[Sequence], max_num_tokens: list[int], block_copies: list[tuple[int, int]]
    ) -> list[Proposal]:
        self.runner.cache.copy_blocks(block_copies)  # keep the draft pool in step with the target's
        for seq, num in zip(seqs, max_num_tokens):
            # A draft of a shorter context than the target's stops drafting for a sequence whose
            # proposal would reach past it (as vLLM does): its later tokens are plain steps.
            drafted = min(self.num_tokens, num) + (not seq.params.is_greedy)
            if seq.num_tokens + drafted - 1 > self.max_context:  # the last draft step's last position + 1
                seq.is_draft_off = True
        limits = [0 if seq.is_draft_off else min(self.num_tokens, num) for seq, num in zip(seqs, max_num_tokens)]
        num_steps = [0 if seq.is_draft_off else limit + (not seq.params.is_greedy)  # + the tail
                     for seq, limit in zip(seqs, limits)]
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        tails: list[torch.Tensor | None] = [None] * len(seqs)
        for j in range(max(num_steps, default=0)):
            active = [i for i, num in enumerate(num_steps) if num > j]
            tokens, q = self._draft_step([seqs[i] for i in active], [drafts[i] for i in active])
            is_finite = torch.isfinite(q).all(dim=-1).tolist()
            for row, i in enumerate(active):
                if not is_finite[row]:  # the draft overflows on this context: plain steps from here on
                    seqs[i].is_draft_off = True
                    num_steps[i], drafts[i], probs[i], tails[i] = 0, [], [], None
                elif j < limits[i]:
                    drafts[i].append(tokens[row])
                    probs[i].append(q[row])
                else:
                    tails[i] = q[row]  # its token is drawn by the verifier, per sample of a group
        return [Proposal(d, torch.stack(p) if p else None, t) for d, p, t in zip(drafts, probs, tails)]

    def _draft_step(self, seqs: list[Sequence], drafts: list[list[int]]) -> tuple[list[int], torch.Tensor]:
        """One draft forward: each sequence's uncomputed context (catch-up, then the previous draft)
        -> a drafted token per sequence and its distribution q ``[S, V]``."""
        token_ids: list[int] = []
        positions: list[int] = []
        spans, logits_index = [], []
        for seq, draft in zip(seqs, drafts):
            # Context: the sequence then its drafts so far; the logits after the last predict the next.
            num_context = seq.num_tokens + len(draft)
            start = seq.num_draft_computed_tokens
            if start < seq.num_tokens:
                token_ids.extend(seq.token_ids[start:])
                token_ids.extend(draft)
            else:
                token_ids.extend(draft[start - seq.num_tokens :])
            positions.extend(range(start, num_context))
            spans.append(SeqSpan(start, num_context - start, seq.block_table))
            logits_index.append(len(token_ids) - 1)
            seq.num_draft_computed_tokens = num_context
        logits = self.runner.run(StepInput(token_ids, positions, spans, logits_index), [])  # [S, V]
        logprobs = processed_logprobs(logits, [seq.params for seq in seqs])  # [S, V]
        q = logprobs.exp()
        is_greedy = torch.tensor([seq.params.is_greedy for seq in seqs], device=q.device)
        positions = np.array([[seq.num_output_tokens + len(draft)] for seq, draft in zip(seqs, drafts)])
        uniforms = position_uniforms([seq.rng for seq in seqs], positions, DRAFT_DRAW)[:, 0]
        sampled = inverse_cdf(q, uniforms.to(q.device))
        tokens = torch.where(is_greedy, logprobs.argmax(dim=-1), sampled)  # [S]
        return tokens.tolist(), q


def build_proposer(
    config: EngineConfig,
    model: DecoderModel,
    draft_model: DecoderModel | None,
    num_blocks: int,
) -> Proposer | None:
    if config.speculative == "ngram" and draft_model is None:
        return NgramProposer(config.ngram_max, config.ngram_min, config.num_speculative_tokens)
    if config.speculative != "draft":
        if draft_model is not None:
            raise ConfigError(
                f"LLMEngine got a draft_model but engine.speculative={config.speculative!r}; set it to 'draft'"
            )
        return None
    if draft_model is None:
        raise ConfigError("engine.speculative='draft' needs a draft model: LLMEngine(..., draft_model=...)")
    if draft_model.config.vocab_size != model.config.vocab_size:
        raise ConfigError(
            f"draft model vocab_size {draft_model.config.vocab_size} differs from the target's "
            f"{model.config.vocab_size}; speculative decoding needs the same tokenizer"
        )
    target_device, draft_device = _device_of(model), _device_of(draft_model)
    if draft_device != target_device:
        raise ConfigError(
            f"draft model is on {draft_device} but the target model on {target_device}; speculative decoding "
            "needs both on one device (move the draft with .to())"
        )
    return DraftModelProposer(
        draft_model, config.num_speculative_tokens, num_blocks=num_blocks, block_size=config.block_size,
        is_lm_head_packed=config.cpu_pack_lm_head, pack_layer_linears=config.cpu_pack_linears,
        native_attention=config.cpu_native_attention, batch_invariant=config.batch_invariant,
    )


def _device_of(model: DecoderModel) -> torch.device:
    return next(iter(model.parameters())).device
