"""Exact speculative decoding: proposers of draft tokens and the rejection-sampling acceptance test.

A decode step of a sequence with context ``x_1..x_L`` (KV computed up to ``x_{L-1}``) feeds
``[x_L, d_1, .., d_n]`` to the target in one forward, reading its log-probs ``p_0..p_n`` at every
position, and keeps the longest prefix of drafts that passes the test of Leviathan et al. 2023
("Fast Inference from Transformers via Speculative Decoding", Algorithm 1; Chen et al. 2023,
"Accelerating LLM Decoding with Speculative Sampling", Algorithm 2):

* accept ``d_i`` with probability ``min(1, p_i(d_i) / q_i(d_i))``, ``q_i`` the draft's distribution;
* at the first rejection ``i``, emit a token drawn from ``norm(max(0, p_i - q_i))``;
* when all ``n`` pass, emit a bonus token drawn from ``p_n``.

Every emitted token is then distributed exactly as a plain draw from ``p`` (the residual makes up
the mass the test rejects). Prompt lookup (``NgramProposer``) is a point-mass ``q``, and for it
the test is coupled to plain sampling instead: position ``i`` draws ``x_i`` from ``p_i`` by the
inverse CDF with the sequence's next uniform, exactly as a plain step would, and the draft stays
accepted while ``x_i == d_i`` (probability ``p_i(d_i)``, as in the test above); the first ``x_i``
that differs is emitted and ends the step. Every emitted token is then a plain draw from ``p`` with
its own uniform, one draw per token: a seeded request samples the same tokens whether or how many
drafts it got (the step's budget and the free blocks decide that, so with the rejection test a
neighbour in the batch shifted its random stream). Greedy rows accept ``d_i`` iff it is
``argmax p_i`` and emit ``argmax`` at the stop, so greedy output equals plain greedy decoding.

``p`` is ``process_logits`` of the request's sampling settings (the trainer's definition), so the
reported log-probs are the target's, whatever proposed the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from tether.engine.attention import SeqSpan
from tether.engine.config import EngineConfig
from tether.engine.rng import draw_at, draw_uniforms
from tether.engine.runner import DecoderModel, ModelRunner, StepInput
from tether.engine.sampler import inverse_cdf, processed_logprobs
from tether.engine.sequence import Sequence
from tether.engine.types import SamplingParams
from tether.errors import ConfigError


@dataclass(slots=True)
class Proposal:
    token_ids: list[int]  # [n] draft tokens, n <= the slots the scheduler gave; may be empty
    # [n, V] the draft distributions q_i the tokens were drawn from; None: point masses (q_i(d_i) = 1)
    draft_probs: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class Proposer(Protocol):
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

    def propose(
        self, seqs: list[Sequence], max_num_tokens: list[int], block_copies: list[tuple[int, int]]
    ) -> list[Proposal]:
        return [
            Proposal(ngram_lookup(seq.token_ids, self.n_max, self.n_min, min(self.num_tokens, num)))
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
    """

    def __init__(
        self, draft_model: DecoderModel, num_tokens: int, *, num_blocks: int, block_size: int,
        is_lm_head_packed: bool = True, pack_layer_linears: str = "auto", native_attention: bool = True,
    ) -> None:
        self.num_tokens = num_tokens
        self.runner = ModelRunner(draft_model, num_blocks, block_size, is_lm_head_packed, pack_layer_linears,
                                  native_attention)

    def propose(
        self, seqs: list[Sequence], max_num_tokens: list[int], block_copies: list[tuple[int, int]]
    ) -> list[Proposal]:
        self.runner.cache.copy_blocks(block_copies)  # keep the draft pool in step with the target's
        limits = [min(self.num_tokens, num) for num in max_num_tokens]
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for j in range(max(limits, default=0)):
            active = [i for i, limit in enumerate(limits) if limit > j]
            tokens, q = self._draft_step([seqs[i] for i in active], [drafts[i] for i in active])
            for row, i in enumerate(active):
                drafts[i].append(tokens[row])
                probs[i].append(q[row])
        return [Proposal(d, torch.stack(p) if p else None) for d, p in zip(drafts, probs)]

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
        sampled = inverse_cdf(q, draw_uniforms([seq.rng for seq in seqs])[:, 0].to(q.device))
        tokens = torch.where(is_greedy, logprobs.argmax(dim=-1), sampled)  # [S]
        return tokens.tolist(), q


# ---------------------------------------------------------------------------- acceptance


def verify(logits: torch.Tensor, seqs: list[Sequence], drafts: list[Proposal]) -> Verdict:
    """Run the acceptance test for sequences that fed ``[x_L, d_1..d_n]`` to the target.

    logits ``[sum(n_i + 1), V]``: each sequence's rows in order; ``drafts`` each non-empty.
    """
    k = max(p.num_tokens for p in drafts)
    device = logits.device
    logprobs = _pad_rows(processed_logprobs(logits, _repeat_params(seqs, drafts)), drafts, k)  # [S, K + 1, V]
    draft_ids = torch.tensor([p.token_ids + [0] * (k - p.num_tokens) for p in drafts], device=device)
    num_drafts = torch.tensor([p.num_tokens for p in drafts], device=device)
    if all(seq.params.is_greedy for seq in seqs):  # the common eval case: no draws, no residuals
        return accept_greedy(logprobs, draft_ids, num_drafts)
    is_greedy = torch.tensor([seq.params.is_greedy for seq in seqs], device=device)
    draft_probs = _stack_draft_probs(drafts, k)
    if draft_probs is None:  # point masses (prompt lookup): the coupled test, one draw per token
        uniforms = draw_at([seq.rng for seq in seqs], np.tile(np.arange(k + 1, dtype=np.uint64), (len(seqs), 1)),
                           [0] * len(seqs))
        verdict = accept_coupled(logprobs, draft_ids, num_drafts, is_greedy, uniforms.to(device))
        for seq, num_accepted in zip(seqs, verdict.num_accepted.tolist()):
            if not seq.params.is_greedy:
                seq.rng.num_draws += num_accepted + 1  # the draws of the tokens emitted, as plain steps
        return verdict
    return accept_drafts(
        logprobs, draft_ids, num_drafts, draft_probs, is_greedy, _draw_verify_uniforms(seqs, drafts, k).to(device)
    )


def _draw_verify_uniforms(seqs: list[Sequence], drafts: list[Proposal], k: int) -> torch.Tensor:
    """[S, K + 1]: n_i acceptance draws then the stop draw (in column K), from each row's stream.

    Exactly n_i + 1 draws per sequence, whatever the other rows' proposals: a seeded request's
    sample does not depend on what shares its step.
    """
    # Column j < K is draw j (used for j < n_i); column K is draw n_i, the stop draw.
    columns = np.tile(np.arange(k + 1, dtype=np.uint64), (len(seqs), 1))
    columns[:, k] = [d.num_tokens for d in drafts]
    return draw_at([seq.rng for seq in seqs], columns, [d.num_tokens + 1 for d in drafts])


@dataclass(slots=True)
class Verdict:
    token_ids: torch.Tensor  # [S, K + 1] accepted drafts, then the residual or bonus token; then junk
    logprobs: torch.Tensor  # [S, K + 1] fp32 target log-prob of each of token_ids
    num_accepted: torch.Tensor  # [S] drafts accepted; row s emits num_accepted[s] + 1 tokens


def accept_greedy(logprobs: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor) -> Verdict:
    """``accept_drafts`` when every row is greedy: keep drafts while they are the target's argmax.

    The emitted tokens are then exactly the argmax at each position (accepted drafts equal it), so
    the output is token for token that of plain greedy decoding.
    """
    k = draft_ids.shape[1]
    best = logprobs.argmax(dim=-1)  # [S, K + 1]
    is_accepted = (best[:, :k] == draft_ids) & (torch.arange(k, device=best.device) < num_drafts[:, None])
    num_accepted = is_accepted.long().cumprod(dim=-1).sum(dim=-1)  # [S]
    return Verdict(best, logprobs.gather(-1, best[..., None]).squeeze(-1), num_accepted)


def accept_coupled(
    logprobs: torch.Tensor,
    draft_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    is_greedy: torch.Tensor,
    uniforms: torch.Tensor,
) -> Verdict:
    """The test for point-mass drafts, coupled to plain sampling (module docstring).

    logprobs ``[S, K + 1, V]``, draft_ids ``[S, K]``, num_drafts ``[S]``, is_greedy ``[S]`` as in
    ``accept_drafts``; uniforms ``[S, K + 1]``: column i is the uniform of the step's i-th token.
    """
    num_rows, num_positions, vocab_size = logprobs.shape
    k = num_positions - 1
    probs = logprobs.exp().view(-1, vocab_size)  # [S * (K + 1), V]
    # What a plain step emits at each position: accepted drafts equal it, and the first position
    # that differs is the step's last token, so these are the verdict's tokens as they stand.
    token_ids = inverse_cdf(probs, uniforms.reshape(-1)).view(num_rows, num_positions)  # [S, K + 1]
    if bool(is_greedy.any()):
        token_ids = torch.where(is_greedy[:, None], logprobs.argmax(dim=-1), token_ids)
    is_accepted = token_ids[:, :k] == draft_ids
    is_accepted &= torch.arange(k, device=logprobs.device)[None, :] < num_drafts[:, None]
    num_accepted = is_accepted.long().cumprod(dim=-1).sum(dim=-1)  # [S]
    token_logprobs = logprobs.gather(-1, token_ids[..., None]).squeeze(-1)  # [S, K + 1]
    return Verdict(token_ids, token_logprobs, num_accepted)


def accept_drafts(
    logprobs: torch.Tensor,
    draft_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    draft_probs: torch.Tensor,
    is_greedy: torch.Tensor,
    uniforms: torch.Tensor,
) -> Verdict:
    """The acceptance test for S sequences at once (rows padded to K drafts).

    logprobs ``[S, K + 1, V]`` target log-probs (process_logits) at each draft position and after
    the last; draft_ids ``[S, K]`` (padding: any id); num_drafts ``[S]`` >= 0; draft_probs
    ``[S, K, V]`` q (point masses take ``accept_coupled``); is_greedy ``[S]`` bool; uniforms
    ``[S, K + 1]`` in [0, 1): one per acceptance test, the last for the residual/bonus draw.
    """
    num_rows, num_positions, _ = logprobs.shape
    k = num_positions - 1
    rows = torch.arange(num_rows, device=logprobs.device)
    probs = logprobs.exp()  # [S, K + 1, V]
    p_draft = probs[:, :k].gather(-1, draft_ids[..., None]).squeeze(-1)  # [S, K]
    q_draft = draft_probs.gather(-1, draft_ids[..., None]).squeeze(-1)
    # u < p / q, written without the division: accepted with probability min(1, p / q).
    is_accepted = uniforms[:, :k] * q_draft < p_draft  # [S, K]
    is_greedy_hit = logprobs[:, :k].argmax(dim=-1) == draft_ids  # [S, K]
    is_accepted = torch.where(is_greedy[:, None], is_greedy_hit, is_accepted)
    is_accepted &= torch.arange(k, device=logprobs.device)[None, :] < num_drafts[:, None]
    num_accepted = is_accepted.long().cumprod(dim=-1).sum(dim=-1)  # [S] the accepted prefix
    p_stop = probs[rows, num_accepted]  # [S, V] the target at the first rejection (or after all)
    final = inverse_cdf(_stop_distribution(p_stop, draft_ids, num_accepted, num_drafts, draft_probs),
                        uniforms[:, k])  # fmt: skip
    final = torch.where(is_greedy, p_stop.argmax(dim=-1), final)  # [S]
    token_ids = torch.cat([draft_ids, draft_ids.new_zeros(num_rows, 1)], dim=1)  # [S, K + 1]
    token_ids[rows, num_accepted] = final
    token_logprobs = logprobs.gather(-1, token_ids[..., None]).squeeze(-1)  # [S, K + 1]
    return Verdict(token_ids, token_logprobs, num_accepted)


def _stop_distribution(
    p_stop: torch.Tensor,
    draft_ids: torch.Tensor,
    num_accepted: torch.Tensor,
    num_drafts: torch.Tensor,
    draft_probs: torch.Tensor,
) -> torch.Tensor:
    """[S, V] what the stop token is drawn from: the residual max(0, p - q) after a rejection,
    p itself after all drafts passed (unnormalised: ``inverse_cdf`` scales by the row total)."""
    num_rows, k = draft_ids.shape
    if k == 0:
        return p_stop
    rows = torch.arange(num_rows, device=p_stop.device)
    rejected_at = num_accepted.clamp(max=k - 1)  # [S]
    residual = (p_stop - draft_probs[rows, rejected_at]).clamp(min=0.0)
    # A rejection implies p(d) < q(d), so the residual has mass; rounding can still empty it.
    is_residual = (num_accepted < num_drafts) & (residual.sum(dim=-1) > 0)  # [S]
    return torch.where(is_residual[:, None], residual, p_stop)


def build_proposer(
    config: EngineConfig,
    model: DecoderModel,
    draft_model: DecoderModel | None,
    num_blocks: int,
    max_model_len: int,
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
    if draft_model.config.max_position_embeddings < max_model_len:
        raise ConfigError(
            f"draft model max_position_embeddings {draft_model.config.max_position_embeddings} is below "
            f"engine.max_model_len={max_model_len}"
        )
    return DraftModelProposer(
        draft_model, config.num_speculative_tokens, num_blocks=num_blocks, block_size=config.block_size,
        is_lm_head_packed=config.cpu_pack_lm_head, pack_layer_linears=config.cpu_pack_linears,
        native_attention=config.cpu_native_attention,
    )


def _repeat_params(verifiers: list[Sequence], drafts: list[Proposal]) -> list[SamplingParams]:
    """Each verifier's sampling params once per logits row (n_i + 1 rows)."""
    return [seq.params for seq, p in zip(verifiers, drafts) for _ in range(p.num_tokens + 1)]


def _pad_rows(logprobs: torch.Tensor, drafts: list[Proposal], k: int) -> torch.Tensor:
    """[sum(n_i + 1), V] -> [S, K + 1, V], padding rows repeating a real one (never read)."""
    index, row = [], 0
    for p in drafts:
        index.extend(row + min(j, p.num_tokens) for j in range(k + 1))
        row += p.num_tokens + 1
    padded = logprobs[torch.tensor(index, device=logprobs.device)]
    return padded.view(len(drafts), k + 1, -1)


def _stack_draft_probs(drafts: list[Proposal], k: int) -> torch.Tensor | None:
    """The draft distributions q as ``[S, K, V]`` (zero padding), or None when all are point masses."""
    if all(p.draft_probs is None for p in drafts):
        return None
    first = next(p.draft_probs for p in drafts if p.draft_probs is not None)
    out = first.new_zeros(len(drafts), k, first.shape[-1])
    for row, p in enumerate(drafts):
        if p.draft_probs is not None:
            out[row, : p.num_tokens] = p.draft_probs
    return out
