"""``LLMEngine``: the rollout engine -- requests in, completions with log-probs and versions out.

One ``step()`` = schedule (continuous batching) -> one forward over all scheduled tokens (paged
KV) -> sample -> bookkeeping. ``generate`` loops ``step`` until its requests finish; the
incremental API (``add_request`` / ``step`` / ``abort``) serves an async rollout loop.

Weight updates (``update_weights``) land between steps, in place. Policy for sequences in flight:
by default they keep the KV computed under the old weights and continue with the new ones (no
recompute; every token's ``versions`` entry says which policy sampled it). With
``EngineConfig.recompute_kv_on_update`` they are preempted instead and recompute their whole
context under the new weights. Either way the prefix cache is flushed, so no new request reuses
stale KV.

Speculative decoding (``EngineConfig.speculative``) slots in between schedule and sample: the
scheduler reserves ``k`` lookahead slots after each decode token, a proposer (``proposers.py``)
fills them with draft tokens, the forward returns logits at every position of those spans, and
``verify`` keeps a prefix plus one token by rejection sampling. Slots of rejected drafts are
simply overwritten later: ``num_computed_tokens`` only counts the accepted ones. A draft model also
proposes for every sampled row that has no slots (a prompt's end, a spent budget): a tail draft
tested against the row's logits, so that every token of a seeded sample passes the same test.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping
from collections.abc import Sequence as SequenceLike

import torch

from tether.engine.attention import SeqSpan
from tether.engine.block_manager import BlockManager
from tether.engine.config import EngineConfig
from tether.engine.proposers import Proposal, build_proposer
from tether.engine.requests import as_request_ids, batch_params, prompt_token_ids, request_error, resolve_max_model_len
from tether.engine.rng import SampleRNG
from tether.engine.runner import DecoderModel, ModelRunner, StepInput, num_kv_blocks_for
from tether.engine.sampler import Detokenizer, Sampler, finish_reason, read_on_host
from tether.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from tether.engine.sequence import Sequence, draws_rewound_on_error, sample_seed
from tether.engine.speculative import verify
from tether.engine.types import Completion, EngineStats, SamplingParams
from tether.errors import CheckpointError, RequestError, one_line


class LLMEngine:
    """Satisfies ``tether.engine.types.Generator``.

    A sample stops at the ids in ``EngineConfig.stop_token_ids`` and its own ``stop_token_ids``:
    unlike vLLM, a ``tokenizer`` passed here adds no EOS of its own (it only decodes, for stop strings);
    ``tether.builders.eos_token_ids(tokenizer, checkpoint)`` gives a tokenizer's and its checkpoint's
    generation_config.json ones, which the loops and ``tether generate`` pass.

    The engine runs ``model`` itself (no copy: ``tether.builders.build_generator`` makes one). On CPU
    it changes the memory layout of the model's linear weights (``use_transposed_weight_layout``: same
    values and shapes, the model still trains and saves as before).
    """

    def __init__(
        self,
        model: DecoderModel,
        *,
        tokenizer: Detokenizer | None = None,
        config: EngineConfig | None = None,
        draft_model: DecoderModel | None = None,
    ) -> None:
        self.config = config = config if config is not None else EngineConfig()
        self.model = model
        self.tokenizer = tokenizer
        self.vocab_size = model.config.vocab_size
        self.max_model_len = resolve_max_model_len(config, model.config.context_length)
        num_blocks = num_kv_blocks_for(
            model, config, self.max_model_len, draft_model if config.speculative == "draft" else None)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.enable_chunked_prefill,
            num_lookahead_tokens=config.num_speculative_tokens if config.speculative else 0,
            max_model_len=self.max_model_len,
        )
        self.runner = ModelRunner(
            model, num_blocks, config.block_size, config.cpu_pack_lm_head, config.cpu_pack_linears,
            config.cpu_native_attention, config.batch_invariant,
        )
        self.proposer = build_proposer(config, model, draft_model, num_blocks)
        self._draft_runner: ModelRunner | None = getattr(self.proposer, "runner", None)  # a draft model's
        draft = self._draft_runner  # EngineConfig.batch_invariant holds for the target's forward and any draft's
        self.is_batch_invariant = self.runner.is_batch_invariant and (draft is None or draft.is_batch_invariant)
        self.sampler = Sampler(self.runner.sampling_weights)
        self.stats = EngineStats()
        self.policy_version = 0
        self._requests: dict[int, list[Sequence]] = {}  # unfinished requests, all their samples
        self._done: list[Completion] = []  # finished outside a step (errors, aborts): next step returns them
        self._next_request_id = 0
        self._next_seq_id = 0
        self._seed_rng = random.Random(config.seed)  # seeds for requests without their own

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt_ids: SequenceLike[int], params: SamplingParams | None = None) -> int:
        """Queue ``params.n`` samples of a prompt; returns the request id their completions carry.

        A request the engine cannot serve does not raise: its completions come out of the next
        ``step()`` with ``finish_reason="error"`` and a one-line ``error``.
        """
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):  # a programming error, not a request to fail
            raise RequestError(f"add_request: params must be a SamplingParams, got {type(params).__name__}")
        request_id = self._next_request_id
        self._next_request_id += 1
        prompt, error = prompt_token_ids(prompt_ids)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(62)
        error = error or request_error(
            prompt, params, vocab_size=self.vocab_size, max_model_len=self.max_model_len,
            block_size=self.config.block_size, num_blocks=self.block_manager.num_blocks,
            has_tokenizer=self.tokenizer is not None,
        )  # fmt: skip
        if error is not None:
            message = f"request {request_id}: {error}"
            self._done.extend(
                Completion(
                    request_id, i, list(prompt), finish_reason="error", error=message, request_id=request_id
                )
                for i in range(params.n)
            )
            return request_id
        stop_ids = frozenset(params.stop_token_ids) | frozenset(self.config.stop_token_ids)
        seqs = [self._new_sequence(request_id, i, prompt, params, stop_ids, seed) for i in range(params.n)]
        self._requests[request_id] = seqs
        seqs[0].followers = seqs[1:]  # forked off once the prompt is computed: one prefill per group
        self.scheduler.add(seqs[0])
        return request_id

    def abort(self, request_ids: int | Iterable[int] | None = None) -> None:
        """Stop requests (one id, several, or all when None); their completions,
        ``finish_reason="abort"``, come out of the next ``step()`` with the tokens generated so far."""
        for request_id in list(self._requests) if request_ids is None else as_request_ids(request_ids):
            for seq in self._requests.pop(request_id, []):
                if seq.is_finished:
                    continue
                self.scheduler.remove(seq)
                seq.finish("abort")
                self._done.append(seq.to_completion(request_id))

    def oldest_token_version(self, request_id: int) -> int | None:
        """The policy version of the oldest token any sample of an unfinished request has sampled so
        far (None: none yet, or no such request)."""
        versions = [seq.versions[0] for seq in self._requests.get(request_id, ()) if seq.versions]
        return min(versions, default=None)

    def has_unfinished(self) -> bool:
        return bool(self._requests or self._done)

    # ------------------------------------------------------------------ stepping

    @torch.inference_mode()
    def step(self) -> list[Completion]:
        """Run one scheduling step; returns the completions that finished in it."""
        done, self._done = self._done, []
        try:
            if self.runner.weights.changed():
                self._on_new_weights()  # changed outside update_weights (load_state_dict, an optimizer step)
            out = self.scheduler.schedule()
            self.stats.num_preemptions += out.num_preempted
            self.stats.num_prefix_hit_tokens += out.num_prefix_hit_tokens
            if out.is_empty:
                return done
            proposals = self._propose(out)
            step_input, samplers, verifiers = self._prepare(out, proposals)
            logits = self.runner.run(step_input, out.block_copies)  # [N + sum(n_i + 1), V]
            self._advance(out.scheduled)  # drafts count once accepted (_verify_and_finish)
            # Each appends to ``done`` as it goes, so what finished before a raise is not lost.
            self._sample_and_finish(logits[: len(samplers)], samplers, done)
            self._verify_and_finish(logits[len(samplers) :], verifiers, proposals, done)
            self._scrub_nonfinite_kv(done)
        except BaseException:  # completions already finished are not lost with the step
            self._done = done + self._done
            self._recover_from_failed_step()
            raise
        self.stats.num_steps += 1
        return done

    def _recover_from_failed_step(self) -> None:
        """A step that raised (out of memory, an interrupt) may have stopped anywhere: tokens marked
        computed with nothing sampled, copy-on-write copies taken from the block manager and never
        made, a draft's KV counted before its forward. Every running sequence is preempted, to
        recompute its KV from its tokens when next scheduled, which is right wherever the step
        stopped; the caller may step on. Blocks this step wrote were never offered to the prefix
        cache (that happens after the forward), so none of it serves a later prompt. (What the step
        finished comes out of the next one; a token whose stop check it cut short was taken back,
        and the draws of tokens it did not emit given back: ``_emit``, ``draws_rewound_on_error``.)"""
        for runner in (self.runner, self._draft_runner):
            if runner is not None:
                runner.decode_kv.clear()  # copies of KV that the recompute writes again
        self.scheduler.remove_finished()
        self.stats.num_preemptions += self.scheduler.preempt_all()

    def _propose(self, out: SchedulerOutput) -> dict[int, Proposal]:
        """Draft tokens for the scheduled items that sample, by seq_id (non-empty only): up to their
        lookahead slots, and a tail where the proposer makes one."""
        if self.proposer is None:
            return {}
        items = [item for item in out.scheduled if item.is_sampling]
        proposals = self.proposer.propose(
            [item.seq for item in items], [item.num_lookahead for item in items], out.block_copies
        )
        return {item.seq.seq_id: p for item, p in zip(items, proposals) if not p.is_empty}

    def _prepare(
        self, out: SchedulerOutput, proposals: dict[int, Proposal]
    ) -> tuple[StepInput, list[Sequence], list[Sequence]]:
        """Flatten the scheduled spans (decode token + drafts where proposed) into one row.

        Logits rows: one per plain sampling sequence (``samplers``), then ``n + 1`` per sequence
        verifying ``n`` drafts (``verifiers``), each list in step order.
        """
        token_ids: list[int] = []
        positions: list[int] = []
        spans, sample_index, verify_index = [], [], []
        samplers, verifiers = [], []
        for item in out.scheduled:
            seq, start, num_new = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
            token_ids.extend(seq.token_ids[start : start + num_new])
            proposal = proposals.get(seq.seq_id)
            if proposal is not None:
                token_ids.extend(proposal.token_ids)
                num_new += proposal.num_tokens
                verify_index.extend(range(len(token_ids) - proposal.num_tokens - 1, len(token_ids)))
                verifiers.append(seq)
            elif item.is_sampling:
                sample_index.append(len(token_ids) - 1)
                samplers.append(seq)
            positions.extend(range(start, start + num_new))
            spans.append(SeqSpan(start, num_new, seq.block_table))
        return StepInput(token_ids, positions, spans, sample_index + verify_index), samplers, verifiers

    def _advance(self, items: list[ScheduledSeq]) -> None:
        """Mark the scheduled tokens computed and offer newly full blocks to the prefix cache."""
        for item in items:
            seq = item.seq
            before = seq.num_computed_tokens
            num_prompt = max(0, min(before + item.num_new_tokens, seq.num_prompt_tokens) - before)
            self.stats.num_prefill_tokens += num_prompt
            self.stats.num_decode_tokens += item.num_new_tokens - num_prompt
            seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.commit(seq, before)

    def _sample_and_finish(self, logits: torch.Tensor, samplers: list[Sequence], done: list[Completion]) -> None:
        if not samplers:
            return  # a step of prefill chunks only
        seqs, _, logits = self._with_groups(samplers, [1] * len(samplers), logits)
        with draws_rewound_on_error(seqs):
            # These rows of the step's logits are read by nothing else: sampled in place.
            # A draft-model engine's rows draw by output position, in plain steps too (Sampler.sample).
            positions = ([s.num_output_tokens for s in seqs]
                         if self.proposer is not None and self.proposer.is_position_keyed else None)
            result = self.sampler.sample(logits, [s.params for s in seqs], [s.rng for s in seqs],
                                         may_overwrite=True, positions=positions)
            for seq, token_id, logprob in zip(seqs, result.token_ids, result.logprobs):
                self._emit(seq, [token_id], [logprob])
                self._collect_if_finished(seq, done)
        self.scheduler.remove_finished()

    def _verify_and_finish(
        self, logits: torch.Tensor, verifiers: list[Sequence], proposals: dict[int, Proposal], done: list[Completion]
    ) -> None:
        """logits ``[sum(n_i + 1), V]``: accept each verifier's drafts, emit, roll back the rest."""
        if not verifiers:
            return
        # A leader ending its prompt has a tail only: its group shares its row and proposal.
        num_rows = [proposals[seq.seq_id].num_tokens + 1 for seq in verifiers]
        seqs, origins, logits = self._with_groups(verifiers, num_rows, logits)
        drafts = [proposals[verifiers[i].seq_id] for i in origins]
        with draws_rewound_on_error(seqs):
            self._accept(logits, seqs, drafts, done)
        self.scheduler.remove_finished()

    def _accept(self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[Proposal],
                done: list[Completion]) -> None:
        verdict = verify(logits, seqs, drafts, self.sampler.weights_kernel)
        # The verifiers' one read from the device
        token_ids, token_logprobs, accepted = read_on_host(verdict.token_ids, verdict.logprobs, verdict.num_accepted)
        for seq, draft, num_accepted, ids, lps in zip(seqs, drafts, accepted, token_ids, token_logprobs):
            before = seq.num_computed_tokens  # through the step's last non-draft token
            num_emitted = self._emit(seq, ids[: num_accepted + 1], lps)
            # KV is valid for the accepted drafts among what was emitted, all but the last token.
            seq.num_computed_tokens = before + max(num_emitted - 1, 0)
            seq.num_draft_computed_tokens = min(seq.num_draft_computed_tokens, seq.num_computed_tokens)
            self.block_manager.commit(seq, before)
            self.stats.num_decode_tokens += draft.num_tokens
            self.stats.num_draft_tokens += draft.num_tokens
            self.stats.num_accepted_tokens += num_accepted
            self._collect_if_finished(seq, done)

    def _with_groups(
        self, seqs: list[Sequence], num_rows: list[int], logits: torch.Tensor
    ) -> tuple[list[Sequence], list[int], torch.Tensor]:
        """``seqs`` with the followers of each leader that just finished its prompt forked in after
        it, each member's index in ``seqs``, and ``logits`` (``sum(num_rows)`` rows, ``num_rows[i]``
        for ``seqs[i]``) with a leader's rows repeated for each of its followers."""
        members, origins, rows, start = [], [], [], 0
        for i, (seq, num) in enumerate(zip(seqs, num_rows)):
            group = [seq, *self.scheduler.fork(seq)] if seq.followers else [seq]
            members.extend(group)
            origins.extend([i] * len(group))
            rows.extend(list(range(start, start + num)) * len(group))
            start += num
        if len(rows) != logits.shape[0]:
            logits = logits[torch.tensor(rows, device=logits.device)]
        return members, origins, logits

    def _collect_if_finished(self, seq: Sequence, done: list[Completion]) -> None:
        if seq.is_finished:
            done.append(seq.to_completion(seq.request_id))
            self._forget_if_done(seq.request_id)

    def _emit(self, seq: Sequence, token_ids: list[int], logprobs: list[float]) -> int:
        """Append tokens until one finishes ``seq`` (stop token/string, length); returns how many."""
        for num_emitted, (token_id, logprob) in enumerate(zip(token_ids, logprobs), start=1):
            if not math.isfinite(logprob):  # NaN/inf logits (diverged weights): fail this sequence only
                seq.finish("error", f"request {seq.request_id}: the model's logits are not finite (NaN or "
                           f"inf) at generated token {seq.num_output_tokens}")
                return num_emitted - 1
            seq.append_token(token_id, logprob, self.policy_version)
            error = None
            try:
                reason = finish_reason(seq, self.max_model_len, self.tokenizer)
            except Exception as exc:  # a detokenizer that fails on this text: this sequence only
                reason, error = "error", (f"request {seq.request_id}: checking its stop strings failed: "
                                          f"{type(exc).__name__}: {one_line(exc)}")
            except BaseException:  # an interrupt: the token goes unchecked, so it is not kept
                seq.pop_token()
                raise
            self.stats.num_generated_tokens += 1
            if reason is not None:
                seq.finish(reason, error)
                return num_emitted
        return len(token_ids)

    def _scrub_nonfinite_kv(self, done: list[Completion]) -> None:
        """After a forward computed NaN/inf hidden states (so NaN/inf KV), no such key or value is
        read again: masked and padded reads multiply stale slots by a zero attention weight, and
        NaN * 0 is NaN, so a sequence that next owned the block would fail too. The pool's NaN/inf
        slots are zeroed (``ModelRunner.scrub_nonfinite_kv``); running sequences whose own context
        held one fail now, with their unforked samples, whether or not they sampled in this step
        (a prompt aborted or preempted mid-prefill would otherwise free them unseen); the blocks
        leave the prefix cache. In a draft model's pool, the sequences it overflowed on stop
        drafting. A scan of the pool, only after such a step.
        """
        draft = self._draft_runner
        is_draft_bad = draft is not None and draft.saw_nonfinite()
        if not self.runner.saw_nonfinite() and not is_draft_bad:
            return
        running = [seq for seq in self.scheduler.running if not seq.is_finished]
        poisoned, bad_blocks = self.runner.scrub_nonfinite_kv(running, lambda seq: seq.num_computed_tokens)
        for seq in poisoned:
            for member in [seq, *seq.followers]:
                member.finish("error", f"request {seq.request_id}: its KV cache holds non-finite values (NaN or "
                              "inf), computed from this context by the current weights")
                self._collect_if_finished(member, done)
            seq.followers = []
        self.scheduler.remove_finished()
        self.block_manager.forget(bad_blocks)
        if is_draft_bad:
            stale, _ = draft.scrub_nonfinite_kv(running, lambda seq: seq.num_draft_computed_tokens)
            for seq in stale:
                seq.is_draft_off = True

    # ------------------------------------------------------------------ batch API

    def generate(
        self, prompts: Iterable[SequenceLike[int]], params: SamplingParams | Iterable[SamplingParams] | None = None
    ) -> list[Completion]:
        """``n`` completions per prompt, grouped by prompt in order (sample 0..n-1 within a group).

        ``params``: one ``SamplingParams`` for every prompt, one per prompt, or None (the defaults).
        ``Completion.prompt_index`` is the prompt's index in ``prompts``. Completions of requests
        added earlier through ``add_request`` are kept for the next ``step()``.
        """
        prompts, params_list = batch_params(prompts, params)
        prompt_index: dict[int, int] = {}
        results: list[list[Completion]] = [[] for _ in prompts]
        num_left = sum(sp.n for sp in params_list)
        others: list[Completion] = []
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params_list)):
                prompt_index[self.add_request(prompt, sp)] = i
            while num_left > 0:
                if not self.scheduler.has_unfinished() and not self._done:
                    raise RuntimeError(f"engine idle with {num_left} completions outstanding")  # a bug, not input
                for completion in self.step():
                    index = prompt_index.get(completion.request_id)
                    if index is None:
                        others.append(completion)
                        continue
                    completion.prompt_index = index
                    results[index].append(completion)
                    num_left -= 1
        except BaseException:  # adding or a step raised: none of this call's requests lingers into later calls
            self.abort(prompt_index)
            self._done = [c for c in self._done if c.request_id not in prompt_index]
            raise
        finally:
            self._done = others + self._done  # other requests' completions wait for the next step()
        return [c for group in results for c in sorted(group, key=lambda c: c.sample_index)]

    # ------------------------------------------------------------------ weights

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor], version: int
    ) -> None:
        """Copy new weights (``(name, tensor)`` pairs or a state dict) into the model in place; tokens
        sampled from now on carry ``version``. A bad update raises ``CheckpointError`` and changes
        nothing.

        Call between steps, from the thread that steps the engine. Weights changed in place by other
        means (``load_state_dict``, an optimizer step on the engine's model) are found at the next
        step and treated the same way, without a new version; writes through ``.data`` are not.
        """
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise CheckpointError(f"update_weights: version must be an int >= 0, got {version!r}")
        self.runner.load_weights(named_tensors)
        self.policy_version = version
        self._on_new_weights()

    def _on_new_weights(self) -> None:
        """KV computed under the old weights: none is reused by a new prompt; the sequences in flight
        keep theirs or recompute it (``EngineConfig.recompute_kv_on_update``)."""
        self.runner.weights.mark()
        self.block_manager.flush_prefix_cache()
        if self.config.recompute_kv_on_update:
            self.stats.num_preemptions += self.scheduler.preempt_all()
            return
        # One that has sampled nothing starts over: every token it samples then comes from the new
        # weights alone, context included (the loop's S = 0 counts such a group as on-policy).
        self.stats.num_preemptions += self.scheduler.preempt_all(
            lambda seq: seq.num_output_tokens == 0 and seq.num_computed_tokens > 0)
        for seq in self.scheduler.running:
            seq.is_kv_stale = True

    # ------------------------------------------------------------------ helpers

    def _new_sequence(
        self,
        request_id: int,
        sample_index: int,
        prompt: list[int],
        params: SamplingParams,
        stop_ids: frozenset[int],
        seed: int,
    ) -> Sequence:
        rng = SampleRNG(sample_seed(seed, sample_index))
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        return Sequence(
            seq_id, request_id, sample_index, list(prompt), len(prompt), params, stop_ids, rng
        )

    def _forget_if_done(self, request_id: int) -> None:
        seqs = self._requests.get(request_id)
        if seqs is not None and all(seq.is_finished for seq in seqs):
            del self._requests[request_id]
