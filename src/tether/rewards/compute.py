"""The one call site for rewards: every score of a run is computed by ``RewardComputer.score``.

A reward function that raises or returns garbage (not a number, NaN, a dict of non-numbers) never
stops the run: that sample's score from that function is 0.0 (0.0 in each of its sub-scores, the
names it returned before: a failure adds no metric name) and the failure is counted in
``reward/errors`` and ``reward/<name>/errors``. (A later worker pool with timeouts replaces the
in-process loop here; callers don't change.)
"""

from __future__ import annotations

import copy
import math
import numbers
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tether.rewards.loader import RewardFn


@dataclass(frozen=True, slots=True)
class WeightedReward:
    name: str
    fn: RewardFn
    weight: float = 1.0


@dataclass(slots=True)
class RewardResult:
    totals: list[float]  # [N] weighted sum per sample
    components: dict[str, list[float]]  # name -> [N] unweighted scores (sub-scores as name/key); NaN: None
    num_errors: dict[str, int] = field(default_factory=dict)
    first_errors: dict[str, str] = field(default_factory=dict)  # reward name -> its first failure's message

    @property
    def first_error(self) -> str | None:
        """The first failure of any reward function (``"name: message"``)."""
        return next(iter(self.first_errors.values()), None)

    @classmethod
    def concatenate(cls, results: Sequence[RewardResult]) -> RewardResult:
        """One result over all samples of ``results``, in order (a component missing from a part
        scores 0 there; error counts add up; each reward's first error message wins)."""
        totals = [t for r in results for t in r.totals]
        names = list(dict.fromkeys(name for r in results for name in r.components))
        components = {name: [s for r in results for s in _component_of(r, name)] for name in names}
        num_errors: dict[str, int] = {}
        for r in results:
            for name, count in r.num_errors.items():
                num_errors[name] = num_errors.get(name, 0) + count
        first_errors: dict[str, str] = {}
        for r in results:
            for name, message in r.first_errors.items():
                first_errors.setdefault(name, message)
        return cls(totals, components, num_errors, first_errors)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {
            "reward/mean": statistics.fmean(self.totals) if self.totals else 0.0,
            "reward/std": statistics.pstdev(self.totals) if len(self.totals) > 1 else 0.0,
            "reward/errors": float(sum(self.num_errors.values())),
        }
        for name, scores in self.components.items():
            applicable = [x for x in scores if not math.isnan(x)]  # NaN: the function returned None
            out[f"reward/{name}/mean"] = statistics.fmean(applicable) if applicable else math.nan
        for name, count in self.num_errors.items():
            out[f"reward/{name}/errors"] = float(count)
        return out


def _component_of(result: RewardResult, name: str) -> list[float]:
    """``result``'s scores of component ``name``; one it lacks (a sub-score first seen in a later
    part) scores 0, or NaN where its function returned None (reward names hold no '/')."""
    if name in result.components:
        return result.components[name]
    own = result.components.get(name.partition("/")[0], [0.0] * len(result.totals))
    return [math.nan if math.isnan(x) else 0.0 for x in own]


class RewardComputer:
    def __init__(self, rewards: Sequence[WeightedReward]) -> None:
        if not rewards:
            raise ValueError("at least one reward function is required")
        self.rewards = list(rewards)
        # Each dict-returning function's sub-score names seen so far: a failed call scores 0 in these
        # (and in the function's own score, always written), so no metric name leaves with a failure.
        self._keys: dict[str, dict[str, None]] = {reward.name: {} for reward in self.rewards}

    def score(self, prompts: Sequence[str], completions: Sequence[str],
              fields: Sequence[dict[str, Any]]) -> RewardResult:
        num = len(completions)
        result = RewardResult(totals=[0.0] * num, components={})
        for reward in self.rewards:
            result.num_errors[reward.name] = 0
            not_applicable: list[int] = []  # samples it returned None for
            for i in range(num):
                score, parts, error = _call(reward.fn, prompts[i], completions[i], fields[i])
                if score is None:  # does not apply here: adds nothing, and its means leave it out
                    not_applicable.append(i)
                    continue
                if error is not None:
                    result.num_errors[reward.name] += 1
                    result.first_errors.setdefault(reward.name, f"{reward.name}: {error}")
                result.components.setdefault(reward.name, [0.0] * num)[i] = score  # a dict's: its sum
                for key, value in parts.items():
                    self._keys[reward.name].setdefault(key)
                    result.components.setdefault(f"{reward.name}/{key}", [0.0] * num)[i] = value
                weighted = reward.weight * score
                if not abs(weighted) <= MAX_ABS_REWARD:  # a large weight times a large score (a failed
                    result.num_errors[reward.name] += 1  # call scored 0, so it never gets here)
                    result.first_errors.setdefault(reward.name, f"{reward.name}: weight {reward.weight} x score "
                                                                f"{score} is beyond +-{MAX_ABS_REWARD:g}")
                    weighted = 0.0
                result.totals[i] += weighted
            for key in (None, *self._keys[reward.name]):  # failed samples: 0 in each
                scores = result.components.setdefault(reward.name if key is None else f"{reward.name}/{key}",
                                                      [0.0] * num)
                for i in not_applicable:
                    scores[i] = math.nan
        return result



def _call(fn: RewardFn, prompt: str, completion: str, row: dict[str, Any]
          ) -> tuple[float | None, dict[str, float], str | None]:
    """Returns (score, named parts, error); a failure scores 0.0; ``None`` (TRL's convention for
    a reward that does not apply to this sample, one task's reward in a mixture) scores None."""
    # A dataset column named like a positional argument must not collide with it. Copies: the row and
    # a chat prompt are the dataset's own, shared by every sample of every epoch, and a reward that
    # appends to them (a judge building its messages) would change them for all later calls.
    fields = _private({k: v for k, v in row.items() if k not in ("prompt", "completion")})
    prompt = _private(prompt)  # a string is its own copy
    try:
        value = fn(prompt, completion, **fields)
        if value is None:
            return None, {}, None
        if isinstance(value, dict):
            if not value:
                return 0.0, {}, "returned no sub-scores ({})"
            parts: dict[str, float] = {}
            for key, item in value.items():
                number = _as_number(item)
                if number is None:
                    return 0.0, {}, (f"sub-score {_repr(key)} is not a finite number within "
                                            f"+-{MAX_ABS_REWARD:g}: {_repr(item)}")
                if str(key) in parts:  # 1 and "1": one metric name, one would be lost from the sum
                    return 0.0, {}, f"two sub-scores are named {str(key)!r}"
                if not str(key):  # its metric would be the reward's own (the sum of its sub-scores)
                    return 0.0, {}, "a sub-score is named '' (it needs a name)"
                parts[str(key)] = number
            total = sum(parts.values())
            if not abs(total) <= MAX_ABS_REWARD:
                return 0.0, {}, f"its sub-scores sum to {total:g}, beyond +-{MAX_ABS_REWARD:g}"
            return total, parts, None
        number = _as_number(value)
        if number is None and isinstance(value, (list, tuple)):
            return 0.0, {}, (f"returned {_repr(value)}: a reward is called once per sample, (prompt, completion, "
                             "**fields) -> float (a list is TRL's batched signature)")
        if number is None:
            return 0.0, {}, f"returned {_repr(value)}, not a finite number within +-{MAX_ABS_REWARD:g}"
        return number, {}, None
    # User code: any failure is counted, never raised. SystemExit too (a code-execution reward runs
    # model-written code, which may call exit()), and CancelledError (an async judge's call). Only
    # KeyboardInterrupt (the user) goes through.
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        return 0.0, {}, f"{type(exc).__name__}: {_str(exc)}"


def _private(value: Any) -> Any:
    """A deep copy of ``value``, or ``value`` itself where it cannot be copied (a field holding a lock
    or a connection, in rows given in memory): scoring must not fail for it."""
    try:
        return copy.deepcopy(value)
    except Exception:
        return value


def _repr(value: Any) -> str:
    try:
        return repr(value)[:200]
    except Exception:  # a user object whose __repr__ raises
        return f"<{type(value).__name__}>"


def _str(exc: BaseException) -> str:
    try:
        return str(exc)[:500]
    except Exception:
        return "<unprintable>"


# A score's magnitude cap: beyond it the float32 advantages overflow (a group's variance squares the
# rewards: 1e20 squared is past float32's 3.4e38) and one NaN step ruins the weights. Such a score
# counts as an error and scores 0, like a NaN.
MAX_ABS_REWARD = 1e15


def _as_number(value: Any) -> float | None:
    """A finite score from a Python, numpy or torch number (a bool too); None for anything else,
    text included (``float`` would parse numpy's ``np.str_("1.0")``)."""
    if not isinstance(value, (int, float)) and hasattr(value, "item") and callable(value.item):
        try:
            value = value.item()  # a numpy scalar or 0-d array, a one-element tensor: its Python value
        except Exception:  # several elements, or a user type's item() that raises
            return None
    if isinstance(value, (str, bytes)) or not isinstance(value, numbers.Real):  # bool is an int
        return None
    try:
        number = float(value)
    except Exception:  # an int with hundreds of digits; a user's float subclass whose __float__ raises
        return None
    return number if math.isfinite(number) and abs(number) <= MAX_ABS_REWARD else None
