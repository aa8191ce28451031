"""``Sequence``: one sample being generated -- its tokens, its KV blocks, its progress, its RNG stream.

A request with ``n`` samples becomes ``n`` sequences. Only the first (the *leader*) is scheduled
while the prompt is prefilled; the others (its *followers*) wait inside it and are forked off once
the prompt's KV exists, sharing the leader's blocks. That is how a GRPO group prefills its prompt
exactly once, with or without prefix caching.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from dataclasses import dataclass, field

from tether.engine.rng import SampleRNG
from tether.engine.types import Completion, FinishReason, SamplingParams

# Odd 64-bit multiplier that spreads (seed, sample_index) pairs over distinct stream seeds.
_SAMPLE_SEED_STRIDE = 0x9E3779B97F4A7C15
_SEED_MASK = (1 << 63) - 1


def sample_seed(seed: int, sample_index: int) -> int:
    """The stream seed (``SampleRNG``) of sample ``sample_index`` of a request seeded with ``seed``."""
    return (seed * _SAMPLE_SEED_STRIDE + sample_index) & _SEED_MASK


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()  # not holding KV blocks (new, or preempted and waiting to recompute)
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    request_id: int
    sample_index: int
    token_ids: list[int]  # prompt followed by generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    stop_token_ids: frozenset[int]
    rng: SampleRNG  # this sample's own random stream: same seed, same sample, whatever the batch
    status: SequenceStatus = SequenceStatus.WAITING
    # Tokens whose KV is in this sequence's blocks. Reset to 0 on preemption (recompute policy).
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Tokens whose draft-model KV (speculative decoding) is in this sequence's blocks: the draft's
    # own pool shares the block tables. Lags num_computed_tokens; reset with it on preemption.
    num_draft_computed_tokens: int = 0
    # True once the draft model computed NaN/inf for this context: no more drafts for it (plain steps).
    is_draft_off: bool = False
    # True once a weight update lands while this sequence holds KV from the old weights: it keeps
    # that KV (the engine's default policy) but its blocks must never enter the prefix cache.
    is_kv_stale: bool = False
    logprobs: list[float] = field(default_factory=list)  # one per generated token
    versions: list[int] = field(default_factory=list)  # policy version that sampled each token
    followers: list[Sequence] = field(default_factory=list)  # samples forked off after the prompt
    finish_reason: FinishReason | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        if not 0 < self.num_prompt_tokens <= len(self.token_ids):
            raise ValueError(f"num_prompt_tokens={self.num_prompt_tokens} for {len(self.token_ids)} tokens")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_samples(self) -> int:
        """Sequences this one stands for in the running set: itself plus its unforked followers."""
        return 1 + len(self.followers)

    def append_token(self, token_id: int, logprob: float, version: int) -> None:
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)
        self.versions.append(version)

    def pop_token(self) -> None:
        """Takes back the newest token (appended, then interrupted before it was checked)."""
        self.token_ids.pop()
        self.logprobs.pop()
        self.versions.pop()

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.error = error

    def to_completion(self, prompt_index: int) -> Completion:
        return Completion(
            prompt_index=prompt_index,
            sample_index=self.sample_index,
            prompt_ids=self.token_ids[: self.num_prompt_tokens],
            token_ids=self.output_ids,
            logprobs=list(self.logprobs),
            versions=list(self.versions),
            finish_reason=self.finish_reason or "abort",
            error=self.error,
            request_id=self.request_id,
        )


@contextlib.contextmanager
def draws_rewound_on_error(seqs: list[Sequence]) -> Iterator[None]:
    """Sampling ``seqs`` in the block: if it raises, a sequence's stream keeps the draws of the
    tokens it emitted (one each, as plain steps count them) and gives back the rest, so it samples
    the same tokens when it steps again as it would have uninterrupted. A stream the block did not
    advance (greedy, or drawn by output position) is left as it is."""
    counts = [(seq.rng.num_draws, seq.num_output_tokens) for seq in seqs]
    try:
        yield
    except BaseException:
        for seq, (num_draws, num_outputs) in zip(seqs, counts):
            if seq.rng.num_draws != num_draws:
                seq.rng.num_draws = num_draws + seq.num_output_tokens - num_outputs
        raise
