"""Exact speculative decoding: the acceptance test for drafts (proposed by ``tether.engine.proposers``).

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

A draft model's drafts are not point masses, and the rejection test above keeps its acceptance
rate (``sum min(p, q)``, where the coupled test would get ``sum p q``). Its seeded samples are made
independent of the batch another way: every token a sampled row emits passes the same test.
Besides the ``n`` drafts it feeds the target, the draft model drafts one more token, for the position
after them (the *tail*), which is tested against ``p_n`` and never fed: accepted, it is the step's
last token; rejected, the residual is. So no token is a plain draw from ``p`` -- not the bonus, not
the first token after a prompt, not one after a recompute -- and the token at output index ``t`` is
the same function of ``p_t``, ``q_t`` and three uniforms keyed by (seed, t) (``position_uniforms``),
however many drafts the step's budget allowed. The price is one more draft forward per step.

``p`` is ``process_logits`` of the request's sampling settings (the trainer's definition), so the
reported log-probs are the target's, whatever proposed the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tether.engine.proposers import Proposal
from tether.engine.rng import ACCEPT_DRAW, DRAFT_DRAW, STOP_DRAW, draw_at, position_uniforms
from tether.engine.sampler import WeightsKernel, inverse_cdf, processed_logprobs, sample_with_uniforms
from tether.engine.sequence import Sequence
from tether.engine.types import SamplingParams


def verify(
    logits: torch.Tensor, seqs: list[Sequence], drafts: list[Proposal], weights_kernel: WeightsKernel | None = None
) -> Verdict:
    """Run the acceptance test for sequences that fed ``[.., x_L, d_1..d_n]`` to the target.

    logits ``[sum(n_i + 1), V]``: each sequence's rows in order (its last ``n_i + 1``); ``drafts``
    each non-empty. Rows of a group may share logits rows and a proposal (a tail only).
    ``weights_kernel``: the engine sampler's (``Sampler.weights_kernel``), so that the coupled test
    draws with a plain step's rounding.
    """
    k = max(p.num_tokens for p in drafts)
    device = logits.device
    host = [n for p in drafts for n in (p.num_tokens, *p.token_ids, *[0] * (k - p.num_tokens))]
    ints = torch.tensor(host, dtype=torch.long).view(len(drafts), k + 1)  # [S, 1 + K] on the host
    is_all_greedy = all(seq.params.is_greedy for seq in seqs)
    if not is_all_greedy and all(p.draft_probs is None and p.tail_probs is None for p in drafts):
        # Point masses (prompt lookup): the coupled test, one draw per token from the plain stream,
        # each drawn as a plain step draws it (the same sampling path, so the same rounding), with
        # the log-prob a plain step reports. The plain tokens are on the host once sampled, so the test
        # runs there: a GPU waits once for them, not again for copies back and a count.
        uniforms = draw_at([seq.rng for seq in seqs], np.tile(np.arange(k + 1, dtype=np.uint64), (len(seqs), 1)),
                           [0] * len(seqs))
        padded_params = [seq.params for seq in seqs for _ in range(k + 1)]
        plain = sample_with_uniforms(_pad_rows(logits, drafts, k).view(len(seqs) * (k + 1), -1), padded_params,
                                     uniforms.view(-1).to(device), True, weights_kernel)  # a copy: ours
        shape = (len(seqs), k + 1)
        verdict = accept_coupled(ints[:, 1:], ints[:, 0], torch.tensor(plain.token_ids).view(shape),
                                 torch.tensor(plain.logprobs, dtype=torch.float32).view(shape))
        for seq, num_accepted in zip(seqs, verdict.num_accepted.tolist()):
            if not seq.params.is_greedy:
                seq.rng.num_draws += num_accepted + 1  # the draws of the tokens emitted, as plain steps
        return verdict
    ints = ints.to(device)  # one host-to-device copy for both (on a GPU each copy from the host is a sync)
    num_drafts, draft_ids = ints[:, 0], ints[:, 1:]  # [S], [S, K]: K may be 0 (tails only)
    logprobs = _pad_rows(processed_logprobs(logits, _repeat_params(seqs, drafts)), drafts, k)  # [S, K + 1, V]
    if is_all_greedy:  # the common eval case: no draws, no residuals
        return accept_greedy(logprobs, draft_ids, num_drafts)
    is_greedy = torch.tensor([seq.params.is_greedy for seq in seqs], device=device)
    draft_ids, draft_probs, has_tail = _with_tails(seqs, drafts, draft_ids, logprobs.new_zeros(logprobs.shape))
    # Output position t + j of each row: its acceptance draw and its stop draw (module docstring).
    positions = np.array([seq.num_output_tokens for seq in seqs])[:, None] + np.arange(k + 1)  # [S, K + 1]
    rngs = [seq.rng for seq in seqs]
    uniforms = torch.stack(
        [position_uniforms(rngs, positions, ACCEPT_DRAW), position_uniforms(rngs, positions, STOP_DRAW)], dim=-1
    )  # [S, K + 1, 2]
    return accept_drafts(logprobs, draft_ids, num_drafts, draft_probs, is_greedy, uniforms.to(device), has_tail)


def _with_tails(
    seqs: list[Sequence], drafts: list[Proposal], draft_ids: torch.Tensor, draft_probs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A draft model's proposals as the acceptance test reads them: ``draft_ids`` ``[S, K]`` (the fed
    drafts, padded) with each row's tail after its fed drafts, drawn here from the row's own stream
    (a group's samples share a tail distribution, not a token), as ``[S, K + 1]``; ``draft_probs``
    (zeros ``[S, K + 1, V]``) filled with the distributions each was drawn from; ``has_tail`` ``[S]``."""
    device = draft_ids.device
    draft_ids = torch.cat([draft_ids, draft_ids.new_zeros(len(drafts), 1)], dim=1)  # [S, K + 1]
    for row, p in enumerate(drafts):
        if p.draft_probs is not None:
            draft_probs[row, : p.num_tokens] = p.draft_probs
    tail_rows = [row for row, p in enumerate(drafts) if p.tail_probs is not None]
    has_tail = torch.zeros(len(drafts), dtype=torch.bool, device=device)
    if tail_rows:
        rows = torch.tensor(tail_rows, device=device)
        columns = torch.tensor([drafts[row].num_tokens for row in tail_rows], device=device)
        tail_probs = torch.stack([drafts[row].tail_probs for row in tail_rows])  # [T, V]
        positions = np.array([[seqs[row].num_output_tokens + drafts[row].num_tokens] for row in tail_rows])
        uniforms = position_uniforms([seqs[row].rng for row in tail_rows], positions, DRAFT_DRAW)[:, 0]
        draft_ids[rows, columns] = inverse_cdf(tail_probs, uniforms.to(device))
        draft_probs[rows, columns] = tail_probs
        has_tail[rows] = True
    return draft_ids, draft_probs, has_tail


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
    draft_ids: torch.Tensor, num_drafts: torch.Tensor, plain_ids: torch.Tensor, plain_logprobs: torch.Tensor
) -> Verdict:
    """The test for point-mass drafts, coupled to plain sampling (module docstring).

    draft_ids ``[S, K]``, num_drafts ``[S]`` as in ``accept_drafts``; plain_ids ``[S, K + 1]``: the
    token a plain step emits at each position (``sample_with_uniforms`` with the uniform of the
    step's i-th token in column i; a greedy row's argmax), plain_logprobs ``[S, K + 1]`` their
    log-probs. Accepted drafts equal it, and the first position that differs is the step's last
    token, so these are the verdict's tokens as they stand.
    """
    k = draft_ids.shape[1]
    is_accepted = plain_ids[:, :k] == draft_ids
    is_accepted &= torch.arange(k, device=draft_ids.device)[None, :] < num_drafts[:, None]
    num_accepted = is_accepted.long().cumprod(dim=-1).sum(dim=-1)  # [S]
    return Verdict(plain_ids, plain_logprobs, num_accepted)


def accept_drafts(
    logprobs: torch.Tensor,
    draft_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    draft_probs: torch.Tensor,
    is_greedy: torch.Tensor,
    uniforms: torch.Tensor,
    has_tail: torch.Tensor | None = None,
) -> Verdict:
    """The acceptance test for S sequences at once (rows padded to K fed drafts).

    logprobs ``[S, K + 1, V]`` target log-probs (process_logits) at each draft position and after
    the last; draft_ids ``[S, K + 1]``: row s's ``num_drafts[s]`` fed drafts, then its tail draft
    where ``has_tail[s]`` (padding: any id); draft_probs ``[S, K + 1, V]`` the q each was drawn
    from (point masses take ``accept_coupled``); is_greedy ``[S]`` bool (greedy rows have no tail);
    uniforms ``[S, K + 1, 2]`` in [0, 1): at each position, the acceptance draw and the stop draw.

    A row tests its fed drafts then its tail; it emits the accepted prefix and then, at the first
    rejection, a draw from the residual ``max(0, p - q)``; when every test passed, nothing more
    with a tail (the tail was the last token) and a bonus draw from ``p_n`` without one.
    ``Verdict.num_accepted`` counts the fed drafts accepted: row s emits it plus one token.
    """
    num_rows, num_positions, _ = logprobs.shape
    k = num_positions - 1
    rows = torch.arange(num_rows, device=logprobs.device)
    if has_tail is None:
        has_tail = torch.zeros_like(is_greedy)
    num_tested = num_drafts + has_tail.long()  # [S] <= K + 1
    probs = logprobs.exp()  # [S, K + 1, V]
    p_draft = probs.gather(-1, draft_ids[..., None]).squeeze(-1)  # [S, K + 1]
    q_draft = draft_probs.gather(-1, draft_ids[..., None]).squeeze(-1)
    # u < p / q, written without the division: accepted with probability min(1, p / q).
    is_accepted = uniforms[..., 0] * q_draft < p_draft  # [S, K + 1]
    is_greedy_hit = logprobs.argmax(dim=-1) == draft_ids  # [S, K + 1]
    is_accepted = torch.where(is_greedy[:, None], is_greedy_hit, is_accepted)
    is_accepted &= torch.arange(k + 1, device=logprobs.device)[None, :] < num_tested[:, None]
    num_passed = is_accepted.long().cumprod(dim=-1).sum(dim=-1)  # [S] the accepted prefix, tail included
    stop = num_passed.clamp(max=k)  # [S] the column of the residual or bonus draw
    p_stop = probs[rows, stop]  # [S, V] the target at the first rejection (or after all)
    residual = (p_stop - draft_probs[rows, stop]).clamp(min=0.0)
    # A rejection implies p(d) < q(d), so the residual has mass; rounding can still empty it.
    is_residual = (num_passed < num_tested) & (residual.sum(dim=-1) > 0)  # [S]
    final = inverse_cdf(torch.where(is_residual[:, None], residual, p_stop), uniforms[rows, stop, 1])
    # Greedy rows take the argmax of the log-probs, as plain decoding and the acceptance test do: exp
    # can round two log-probs one float step apart to the same probability.
    final = torch.where(is_greedy, logprobs[rows, stop].argmax(dim=-1), final)  # [S]
    is_tail_emitted = has_tail & (num_passed == num_tested)  # its draft stands as the last token
    token_ids = draft_ids.clone()
    token_ids[rows, stop] = torch.where(is_tail_emitted, token_ids[rows, stop], final)
    token_logprobs = logprobs.gather(-1, token_ids[..., None]).squeeze(-1)  # [S, K + 1]
    return Verdict(token_ids, token_logprobs, torch.minimum(num_passed, num_drafts))


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
