"""The ``Generator`` interface between the RL loop and whatever produces rollouts.

Kept narrow on purpose (token ids in; token ids, fp32 log-probs, policy versions and a finish
reason out; ``update_weights``; ``abort``) so that the built-in engine, a remote engine replica,
or a vLLM/SGLang server can sit behind it.

Log-prob definition (shared with the trainer through ``tether.algorithms.logprobs``): the log-prob of
a sampled token is taken under the distribution it was drawn from: logits / temperature, restricted
to the top-k and then the top-p nucleus (and min-p), renormalised over what survives. Greedy
decoding (temperature 0) reports the log-prob under the unprocessed softmax (temperature 1).
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

import torch

from tether.engine.rng import derived_seed

FinishReason = Literal["stop", "length", "abort", "error"]

# The smallest positive temperature: below it ``logits / temperature`` overflows fp32 for ordinary
# logits (inf, then NaN probabilities). 0 is greedy.
MIN_TEMPERATURE = 1e-5
MAX_TOP_K = 2**31 - 1  # larger than any vocabulary: the same as 0 (no top-k)
MAX_SAMPLES = 2**16  # n: a group's samples are made when its request is added


def _as_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        return float(value)
    except OverflowError:  # an int with hundreds of digits
        raise ValueError(f"{name} is out of range ({str(value)[:20]}...)") from None


def _as_int(name: str, value: object) -> int:
    """``value`` as a Python int (a numpy integer too); a float, bool or string is an error."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def as_stop_token_ids(value: object) -> tuple[int, ...]:
    """Stop token ids as a tuple of Python ints >= 0 (numpy integers too); a ``ValueError`` otherwise."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValueError(f"stop_token_ids must be a sequence of token ids, got {value!r}")
    stop_ids = tuple(_as_int("a stop token id", t) for t in value)
    if any(t < 0 for t in stop_ids):
        raise ValueError(f"stop token ids must be >= 0, got {stop_ids}")
    return stop_ids


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    # Per-request seed: the sampler's draws depend on it alone, not on the batch; with batch
    # invariance (``EngineConfig.batch_invariant``) the logits do not either, so the sample is the same
    # bit for bit in any batch (without it they can differ in their last bits, which at a near-tie
    # flips a draw). None: the engine draws one from its own stream (``EngineConfig.seed``).
    seed: int | None = None
    n: int = 1  # samples per prompt (a GRPO group); they share the prompt's KV

    def __post_init__(self) -> None:
        """Checks every field, one ``ValueError`` naming it; numbers become Python floats and ints,
        stop ids and strings tuples (a single string is one stop string)."""
        for name in ("temperature", "top_p", "min_p"):
            object.__setattr__(self, name, _as_float(name, getattr(self, name)))
        for name in ("top_k", "max_new_tokens", "n"):
            object.__setattr__(self, name, _as_int(name, getattr(self, name)))
        if isinstance(self.stop_strings, str):
            object.__setattr__(self, "stop_strings", (self.stop_strings,))
        elif isinstance(self.stop_strings, Iterable):
            object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        if not isinstance(self.stop_strings, tuple) or not all(isinstance(s, str) and s for s in self.stop_strings):
            raise ValueError(f"stop_strings must be non-empty strings, got {self.stop_strings!r}")
        object.__setattr__(self, "stop_token_ids", as_stop_token_ids(self.stop_token_ids))
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {self.temperature:g}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be in [0, {MAX_TOP_K}] (0 disables it), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 1 <= self.n <= MAX_SAMPLES:
            raise ValueError(f"n must be in [1, {MAX_SAMPLES}], got {self.n}")
        if self.seed is not None:  # a numpy integer is kept as a Python int (its arithmetic overflows)
            try:
                object.__setattr__(self, "seed", operator.index(self.seed))
            except TypeError:
                raise ValueError(f"seed must be an integer or None, got {self.seed!r}") from None
            if not 0 <= self.seed < 2**64:  # the stream takes 64 bits: -1 would replay 2**64 - 1's samples
                raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def for_request(self, index: int) -> SamplingParams:
        """These settings with a seed of their own for the ``index``-th request of a run.

        RL must draw fresh randomness for every prompt of every step: reusing one seed would replay
        the same uniforms for sample j of every group, step after step, and bias the gradient. The
        derived seed keeps the run reproducible: ``rng.derived_seed``, SplitMix64 of (seed, index), so
        derived seeds look unrelated to each other and to small seeds a user gives (an affine map
        sent seed 0's request i to seed i + 1, which a prompt line seeded 1 replayed). ``seed=None``
        stays None.
        """
        if self.seed is None:
            return self
        return replace(self, seed=derived_seed(self.seed, index))


@dataclass(slots=True)
class EngineStats:
    num_steps: int = 0
    num_prefill_tokens: int = 0  # prompt tokens run through the model (recomputes after preemption count)
    num_decode_tokens: int = 0  # generated tokens run through the model
    num_generated_tokens: int = 0  # tokens sampled
    num_prefix_hit_tokens: int = 0  # tokens served from the prefix cache (a preempted sequence's own too)
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # speculative draft tokens verified by the target
    num_accepted_tokens: int = 0  # of those, accepted by the rejection-sampling test

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


@dataclass(slots=True)
class Completion:
    """One sample. ``logprobs[i]`` and ``versions[i]`` belong to ``token_ids[i]``."""

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason = "length"
    error: str | None = None  # set when finish_reason == "error": why this request failed
    request_id: int | None = None  # the engine's id for the prompt (``LLMEngine.add_request``)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class Generator(Protocol):
    """What the RL loop and ``tether generate`` need from a rollout engine."""

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[Completion]:
        """Sample ``params.n`` completions per prompt; returned grouped by prompt, in order."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load new policy weights; tokens sampled afterwards carry ``version``."""
        ...

    def abort(self, request_ids: Iterable[int] | None = None) -> None:
        """Stop the given in-flight requests (all when None)."""
        ...


class IncrementalGenerator(Generator, Protocol):
    """The incremental API the asynchronous loop drives (``GeneratorWorker``): requests in, one
    engine step at a time, aborts and weight updates between steps while sequences are in flight."""

    policy_version: int  # the version tokens sampled now carry
    stats: EngineStats

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> int:
        """Queue ``params.n`` samples of a prompt; returns the request id its completions carry."""
        ...

    def step(self) -> list[Completion]:
        """Run one scheduling step; the completions that finished in it."""
        ...

    def has_unfinished(self) -> bool: ...

    def oldest_token_version(self, request_id: int) -> int | None:
        """The version of the oldest token any unfinished sample of the request has sampled."""
        ...
