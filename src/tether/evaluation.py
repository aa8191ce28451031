"""Held-out accuracy with the rollout generator (greedy), for built-in tasks with a checker."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tether.data.records import PromptRecord
from tether.engine.types import Generator, SamplingParams


@dataclass(frozen=True, slots=True)
class AccuracyResult:
    num_correct: int
    num_total: int

    @property
    def accuracy(self) -> float:
        return self.num_correct / max(self.num_total, 1)


def evaluate_accuracy(generator: Generator, records: Sequence[PromptRecord],
                      encode: Callable[[PromptRecord], list[int]], decode: Callable[[list[int]], str],
                      is_correct: Callable[..., Any], *, max_new_tokens: int,
                      stop_token_ids: tuple[int, ...] = ()) -> AccuracyResult:
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids)
    completions = generator.generate([encode(r) for r in records], params)
    num_correct = sum(bool(is_correct(decode(c.token_ids), **records[c.prompt_index].fields))
                      for c in completions)
    return AccuracyResult(num_correct, len(records))
