"""The generator role's logic: admit prompts within capacity, step the engine, score finished groups.

No transport here: a backend (in-process, local processes, later Ray actors) calls ``step``,
``load_weights`` and ``reissue`` and moves what they return. All of the worker's state (engine
weights aside) is explicit: the prompt cursor, the re-issue queue, the capacity controller, the
groups in flight and the counters.

Weight updates and sequences in flight (``partial_rollouts``):
* on (the default when S > 0): the update lands between two engine steps; sequences in flight
  continue under the new weights and every token records the version that sampled it;
* off: the worker stops admitting, lets the groups in flight finish under the old weights, then
  applies the update (no token is wasted, and every sample is single-version).
Either way, a group in flight that can no longer be trained within the staleness bound (its
oldest token older than ``new_version - S``) is aborted at once and its prompt re-issued; a group
that has sampled nothing yet is kept (its tokens will carry the new version). A newer update
supersedes one still pending: weights never go back to an older version.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from tether.data.cursor import DataCursor
from tether.data.records import PromptRecord
from tether.engine.types import Completion, IncrementalGenerator, SamplingParams
from tether.rewards import RewardComputer
from tether.rollout.buffer import GroupRollout
from tether.rollout.staleness import CapacityController


@dataclass(frozen=True, slots=True)
class GeneratorSettings:
    sampling: SamplingParams  # n = group size
    groups_per_batch: int
    max_staleness: int
    num_extra_groups: int = 0  # over-sampling (``rollout.oversample``)
    is_partial_rollouts: bool = True
    is_dynamic_sampling: bool = False  # drop zero-reward-variance groups and refill


# Batches' worth of groups that dynamic sampling may filter in a row (verl's max_num_gen_batches):
# then the generator starts no more groups and the trainer stops the run with the reason.
MAX_FILTERED_DRAWS = 10


@dataclass(slots=True)
class GeneratorCounters:
    """Cumulative; logged by the trainer as ``rollout/*``."""

    num_started: int = 0  # groups admitted (re-issues included)
    num_finished: int = 0  # groups scored and handed out
    num_filtered: int = 0  # dynamic sampling: zero reward variance, dropped
    num_filtered_in_a_row: int = 0  # filtered since the last group handed out
    num_filtered_reward_errors: int = 0  # reward calls that failed (scored 0) in those groups
    filtered_reward_errors: dict[str, str] = field(default_factory=dict)  # each reward's first such failure
    num_failed: int = 0  # a sample failed in the engine (finish_reason "error"): the group is dropped
    first_failure: str | None = None  # the first such sample's error, for the log
    num_aborted: int = 0  # aborted in flight, too stale to ever be trained on; prompt re-issued
    num_reissued: int = 0  # prompts re-issued (aborted here or dropped stale by the trainer)
    num_weight_updates: int = 0
    num_generated_tokens: int = 0  # tokens the engine sampled (those of aborted and dropped groups too)


@dataclass(slots=True)
class InFlightGroup:
    uid: int
    record: PromptRecord
    prompt_ids: list[int]
    start_version: int
    completions: list[Completion] = field(default_factory=list)

    def oldest_version(self, engine: IncrementalGenerator, request_id: int) -> int | None:
        """The version of its oldest sampled token (finished samples and those in flight); None
        while it has sampled nothing (e.g. queued behind the engine's sequence limit)."""
        versions = [c.versions[0] for c in self.completions if c.versions]
        in_engine = engine.oldest_token_version(request_id)
        if in_engine is not None:
            versions.append(in_engine)
        return min(versions, default=None)


class GeneratorWorker:
    def __init__(self, engine: IncrementalGenerator, prompts: DataCursor[PromptRecord], rewards: RewardComputer,
                 encode: Callable[[PromptRecord], list[int]], decode: Callable[[list[int]], str],
                 settings: GeneratorSettings) -> None:
        self.engine = engine
        self.prompts = prompts
        self.rewards = rewards
        self.encode = encode
        self.decode = decode
        self.settings = settings
        self.controller = CapacityController(settings.groups_per_batch, settings.max_staleness,
                                             settings.num_extra_groups)
        self.counters = GeneratorCounters()
        self.version = engine.policy_version
        self.in_flight: dict[int, InFlightGroup] = {}  # engine request id -> group
        self.reissue_queue: deque[PromptRecord] = deque()
        self._pending_weights: tuple[list[tuple[str, torch.Tensor]], int] | None = None
        self._next_uid = 0
        self.is_admitting = True  # False once ``drain`` is called: finish what is in flight, start nothing

    # ------------------------------------------------------------------ weights

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """A new policy version. Applied now, or after the groups in flight drain (partial rollouts off):
        either way the groups it leaves too stale to train are aborted now, not run to their end
        (deferred, a group that has sampled nothing yet will sample under the current version)."""
        self._abort_doomed(version, None if self.settings.is_partial_rollouts else self.version)
        if self.settings.is_partial_rollouts or not self.in_flight:
            self._apply_weights(named_tensors, version)
            return
        # The caller's tensors may be a shared buffer it rewrites next version: keep a private copy.
        self._pending_weights = ([(name, t.detach().clone()) for name, t in named_tensors], version)

    def _apply_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self._pending_weights = None  # superseded: applying it later would roll the weights back
        self.engine.update_weights(named_tensors, version)
        if version != self.version:  # a hand-over re-sends the version its state already counted
            self.counters.num_weight_updates += 1
        self.version = version
        self._abort_doomed(version)

    def _abort_doomed(self, version: int, unsampled: int | None = None) -> None:
        """Abort the groups in flight that ``version`` leaves too stale to train (their oldest token
        older than ``version - S``) and re-issue their prompts. A group that has sampled nothing yet
        counts as of version ``unsampled`` (None: kept, its tokens will carry ``version``)."""
        oldest = {rid: g.oldest_version(self.engine, rid) for rid, g in self.in_flight.items()}
        oldest = {rid: unsampled if v is None else v for rid, v in oldest.items()}
        doomed = [rid for rid, v in oldest.items() if v is not None and version - v > self.settings.max_staleness]
        if doomed:
            self.engine.abort(doomed)  # their "abort" completions are ignored: the ids are forgotten
            groups = [self.in_flight.pop(rid) for rid in doomed]
            self.counters.num_aborted += len(groups)
            self.reissue([g.record for g in groups])

    # ------------------------------------------------------------------ prompts

    def reissue(self, records: list[PromptRecord]) -> None:
        """Put prompts whose groups will never be trained on back at the front of the queue."""
        self.controller.release(len(records))
        self.reissue_queue.extendleft(reversed(records))
        self.counters.num_reissued += len(records)

    def _next_record(self) -> PromptRecord:
        return self.reissue_queue.popleft() if self.reissue_queue else self.prompts.take(1)[0]

    @property
    def may_admit(self) -> bool:
        return (self.is_admitting and self._pending_weights is None and self.controller.may_start(self.version)
                and not self.is_out_of_signal)

    @property
    def is_out_of_signal(self) -> bool:
        """Dynamic sampling filtered ``MAX_FILTERED_DRAWS`` batches' worth of groups in a row: start no
        more (a generator process ran on filtering hundreds while its trainer was busy)."""
        return self.counters.num_filtered_in_a_row >= MAX_FILTERED_DRAWS * self.settings.groups_per_batch

    def drain(self) -> None:
        """Start no more groups; those in flight run to the end. Once ``is_idle``, ``state_dict`` holds
        the whole prompt stream (nothing in flight to re-issue), e.g. to hand it to another worker."""
        self.is_admitting = False

    def _admit(self) -> None:
        while self.may_admit:
            record = self._next_record()
            prompt_ids = self.encode(record)
            self.controller.start()
            request_id = self.engine.add_request(prompt_ids, self.settings.sampling.for_request(self._next_uid))
            self.in_flight[request_id] = InFlightGroup(self._next_uid, record, prompt_ids, self.version)
            self._next_uid += 1
            self.counters.num_started += 1

    # ------------------------------------------------------------------ stepping

    @property
    def is_idle(self) -> bool:
        """Nothing to run until weights or re-issued prompts arrive."""
        return not self.in_flight and not self.may_admit and self._pending_weights is None

    def step(self) -> list[GroupRollout]:
        """Admit what capacity allows, run one engine step, return the groups finished (scored) in it."""
        if self._pending_weights is not None and not self.in_flight:
            named_tensors, version = self._pending_weights
            self._pending_weights = None
            self._apply_weights(named_tensors, version)
        self._admit()
        if not self.engine.has_unfinished():
            return []
        finished: list[GroupRollout] = []
        before = self.engine.stats.num_generated_tokens
        completions = self.engine.step()
        self.counters.num_generated_tokens += self.engine.stats.num_generated_tokens - before
        for completion in completions:
            group = self.in_flight.get(completion.request_id)
            if group is None:
                continue  # an aborted group's leftovers
            group.completions.append(completion)
            if len(group.completions) == self.settings.sampling.n:
                del self.in_flight[completion.request_id]
                scored = self._score(group)
                if scored is not None:
                    finished.append(scored)
        return finished

    def _score(self, group: InFlightGroup) -> GroupRollout | None:
        """Rewards for a finished group (a raising reward fn scores 0, counted); None when filtered."""
        completions = sorted(group.completions, key=lambda c: c.sample_index)
        failed = next((c for c in completions if c.finish_reason == "error"), None)
        if failed is not None:  # not a sample of the policy: its group is not trained on
            self.controller.release()
            self.counters.num_failed += 1
            self.counters.first_failure = self.counters.first_failure or f"record {group.record.index}: {failed.error}"
            return None
        texts = [self.decode(c.token_ids) for c in completions]
        record = group.record
        num = len(completions)
        scores = self.rewards.score([record.prompt] * num, texts, [record.fields] * num)
        rollout = GroupRollout(group.uid, record, group.prompt_ids, completions, texts, scores,
                               group.start_version)
        if self.settings.is_dynamic_sampling and num > 1 and not rollout.has_reward_variance:
            self.controller.release()  # no signal: its place goes to a fresh prompt
            self.counters.num_filtered += 1
            self.counters.num_filtered_in_a_row += 1
            # A reward that fails on every sample scores the group all 0: its failures must not
            # leave with the group (they are counted and reported like a trained group's).
            self.counters.num_filtered_reward_errors += sum(scores.num_errors.values())
            for name, message in scores.first_errors.items():
                self.counters.filtered_reward_errors.setdefault(name, message)
            return None
        self.counters.num_finished += 1
        self.counters.num_filtered_in_a_row = 0
        return rollout

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Resumable state; groups in flight are saved as prompts to re-issue (their tokens are lost)."""
        in_flight = [g.record for g in sorted(self.in_flight.values(), key=lambda g: g.uid)]
        return {"prompts": self.prompts.state_dict(), "reissue": [*in_flight, *self.reissue_queue],
                "num_started": self.controller.num_started - len(in_flight), "version": self.version,
                "next_uid": self._next_uid, "counters": asdict(self.counters)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prompts.load_state_dict(state["prompts"])
        self.reissue_queue = deque(state["reissue"])
        self.controller.num_started = state["num_started"]
        self.version = state["version"]
        self._next_uid = state["next_uid"]
        self.counters = GeneratorCounters(**state["counters"])
