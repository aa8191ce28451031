"""``Scheduler``: continuous batching under a per-step token budget.

Each step first serves the running sequences in admission order (a decode is one token, an
unfinished prefill the next chunk of its prompt), then admits waiting ones while budget, sequence
slots and free blocks last, so prefill chunks and decodes share one forward. When the pool runs
out, the most recently admitted running sequence is preempted: its blocks are freed and it goes
back to the front of the queue to be recomputed later (prefix caching makes that cheap). The
oldest running sequence can always proceed, so the engine never deadlocks; the engine rejects any
request that could not fit in the pool on its own.

With speculative decoding on (``num_lookahead_tokens`` = k), a decode also reserves (and budgets)
up to k slots after its token for draft tokens, capped by what the sequence may still emit; the
reservation is dropped rather than preempting anyone for it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tether.engine.block_manager import BlockManager
from tether.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens computed this step, from seq.num_computed_tokens on
    # Extra slots allocated (and budgeted) after a decode token for speculative draft tokens; the
    # proposer may fill fewer. Their KV is kept only for drafts the target accepts.
    num_lookahead: int = 0

    @property
    def is_sampling(self) -> bool:
        """Whether this chunk reaches the end of the sequence, so its last logits give a token."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) copy-on-write
    num_preempted: int = 0
    num_prefix_hit_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_batched_tokens(self) -> int:
        return sum(item.num_new_tokens + item.num_lookahead for item in self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        *,
        num_lookahead_tokens: int = 0,
        max_model_len: int | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.num_lookahead_tokens = num_lookahead_tokens  # speculative drafts per decode (k), 0: off
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the head has priority

    @property
    def num_running_samples(self) -> int:
        return sum(seq.num_samples for seq in self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if out.num_preempted == 0:  # admitting now would only preempt again next step
            self._admit_waiting(out, budget)
        out.block_copies = self.block_manager.take_copies()
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        queue = deque(self.running)
        self.running = []
        while queue and budget > 0:
            seq = queue.popleft()
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self.enable_chunked_prefill and num_new < seq.num_uncomputed_tokens:
                self.running.append(seq)  # its whole remainder does not fit this step's budget
                continue
            num_lookahead = self._num_lookahead(seq, num_new, budget)
            if not self.block_manager.can_allocate(seq, num_new + num_lookahead):
                num_lookahead = 0  # never preempt another sequence just to speculate
            while not self.block_manager.can_allocate(seq, num_new):
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                out.num_preempted += 1
                if victim is seq:
                    break
            if seq.status is SequenceStatus.WAITING:
                break  # preempted itself: nothing after it can run either
            self.block_manager.allocate(seq, num_new + num_lookahead)
            out.scheduled.append(ScheduledSeq(seq, num_new, num_lookahead))
            self.running.append(seq)
            budget -= num_new + num_lookahead
        self.running.extend(queue)  # out of budget: they keep their place for the next step
        return budget

    def _num_lookahead(self, seq: Sequence, num_new: int, budget: int) -> int:
        """Draft slots for a decode step of ``seq``: k, capped by the budget and by what ``seq`` may
        still emit (each step emits accepted drafts plus one token, within max_new_tokens and
        max_model_len)."""
        if self.num_lookahead_tokens == 0 or num_new != 1 or seq.num_uncomputed_tokens != 1:
            return 0  # prefill chunks sample nothing; the last chunk of a prompt samples normally
        if seq.followers:
            return 0  # a leader ending its prompt samples for its whole group (see LLMEngine)
        num_left = seq.params.max_new_tokens - seq.num_output_tokens - 1
        if self.max_model_len is not None:
            num_left = min(num_left, self.max_model_len - seq.num_tokens - 1)
        return max(0, min(self.num_lookahead_tokens, budget - num_new, num_left))

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        num_samples = self.num_running_samples
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            # A group larger than max_num_seqs is still admitted alone, or it would wait forever.
            if self.running and num_samples + seq.num_samples > self.max_num_seqs:
                break
            num_hit = self.block_manager.match_prefix(seq)
            num_new = min(seq.num_uncomputed_tokens, budget)
            is_fitting = self.enable_chunked_prefill or num_new == seq.num_uncomputed_tokens
            if not is_fitting or not self.block_manager.can_allocate(seq, num_new):
                self.block_manager.free(seq)  # give the prefix hits back; retry next step
                break
            self.block_manager.allocate(seq, num_new)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            out.num_prefix_hit_tokens += num_hit
            num_samples += seq.num_samples
            budget -= num_new

    def _preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and queue it first in line to recompute (keeps its tokens)."""
        self.block_manager.free(seq)
        seq.num_draft_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def preempt_all(self, only: Callable[[Sequence], bool] | None = None) -> int:
        """Preempt every running sequence (those ``only`` picks), oldest ending first in line;
        returns how many."""
        victims, self.running = (self.running, []) if only is None else _partition(self.running, only)
        for seq in reversed(victims):
            self._preempt(seq)
        return len(victims)

    def fork(self, leader: Sequence) -> list[Sequence]:
        """Start the leader's followers on its computed prompt; they run after everything else."""
        followers, leader.followers = leader.followers, []
        for follower in followers:
            self.block_manager.fork(leader, follower)
            # The shared blocks hold the leader's draft KV too (same tokens, same positions).
            follower.num_draft_computed_tokens = leader.num_draft_computed_tokens
            follower.status = SequenceStatus.RUNNING
            self.running.append(follower)
        return followers

    def remove_finished(self) -> None:
        """Free the blocks of running sequences that finished in this step."""
        finished = [seq for seq in self.running if seq.is_finished]
        if finished:
            self.running = [seq for seq in self.running if not seq.is_finished]
            for seq in finished:
                self.block_manager.free(seq)

    def remove(self, seq: Sequence) -> None:
        """Take ``seq`` out of the queues (abort), freeing its blocks."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        self.block_manager.free(seq)


def _partition(seqs: list[Sequence], pick: Callable[[Sequence], bool]) -> tuple[list[Sequence], list[Sequence]]:
    """(the sequences ``pick`` picks, the others), each in order."""
    picked: list[Sequence] = []
    others: list[Sequence] = []
    for seq in seqs:
        (picked if pick(seq) else others).append(seq)
    return picked, others
