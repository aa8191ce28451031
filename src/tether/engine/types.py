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
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

import torch

FinishReason = Literal["stop", "length", "abort", "error"]

# The smallest positive temperature: below it ``logits / temperature`` overflows fp32 for ordinary
# logits (inf, then NaN probabilities). 0 is greedy.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None  # per-request seed: same seed, same sample, whatever the batch
    n: int = 1  # samples per prompt (a GRPO group); they share the prompt's KV

    def __post_init__(self) -> None:
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
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.seed is not None:  # a numpy integer is kept as a Python int (its arithmetic overflows)
            try:
                object.__setattr__(self, "seed", operator.index(self.seed))
            except TypeError:
                raise ValueError(f"seed must be an integer or None, got {self.seed!r}") from None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def for_request(self, index: int) -> SamplingParams:
        """These settings with a seed of their own for the ``index``-th request of a run.

        RL must draw fresh randomness for every prompt of every step: reusing one seed would replay
        the same uniforms for sample j of every group, step after step, and bias the gradient. The
        derived seed keeps the run reproducible; ``seed=None`` stays None (fresh global randomness).
        """
        if self.seed is None:
            return self
        return replace(self, seed=(self.seed * 0x9E3779B97F4A7C15 + index + 1) % 2**63)


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
