"""Built-in synthetic tasks: seeded generators with checkable answers, for the demo and tests.

No downloads: every problem comes from ``random.Random(seed)``. Each problem belongs to exactly
one split, decided by a hash of its prompt text (``blake2b``, stable across runs and machines,
unlike Python's salted ``hash``), so the train and held-out splits are disjoint by construction
whatever the seeds. Generators sample with replacement: a small problem space (1-digit sums)
yields repeats rather than running dry.

Tasks:

* ``arith`` -- ``"37+485="`` -> ``"522"``; operands of 1..``num_digits`` digits, operators from
  ``operators``, ``num_terms`` operands, results kept >= 0 unless ``allow_negative``.
* ``copy``  -- a random printable string of ``min_chars``..``max_chars`` characters then ``">"``;
  the answer repeats it (each ``chunk_size`` block reversed when ``chunk_size > 0``). Plain copies
  are what prompt-lookup speculative decoding is built for: every answer n-gram is in the prompt.

Completions never contain an end-of-sequence marker: tokenisation appends eos.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import string
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import pydantic

from tether.data.records import PreferenceRecord, PromptRecord, SFTRecord
from tether.errors import ConfigError, DataError

Split = Literal["train", "test"]
_MAX_TRIES_PER_PROBLEM = 1000  # rejection sampling for the split; only a tiny problem space hits it


class Task(Protocol):
    name: str

    def prompts(self, n: int, seed: int, split: Split = "train") -> list[PromptRecord]: ...

    def sft(self, n: int, seed: int, split: Split = "train") -> list[SFTRecord]: ...

    def preferences(self, n: int, seed: int, split: Split = "train") -> list[PreferenceRecord]: ...

    def is_correct(self, completion: str, **fields: Any) -> bool: ...

    def reward(self, prompt: str, completion: str, **fields: Any) -> float: ...


@dataclass(frozen=True, slots=True)
class Problem:
    prompt: str
    answer: str
    wrong_answer: str  # plausible but incorrect; the rejected side of a preference pair
    demonstration: str | None = None  # what the SFT teacher writes, when it is not the answer


def split_of(prompt: str, heldout_fraction: float) -> Split:
    """The split a problem belongs to: a pure function of its text."""
    digest = hashlib.blake2b(prompt.encode("utf-8"), digest_size=8).digest()
    unit = int.from_bytes(digest, "big") / 2**64  # uniform in [0, 1)
    return "test" if unit < heldout_fraction else "train"


def exact_match(completion: str, answer: str) -> bool:
    """``True`` when ``completion`` is ``answer`` up to surrounding whitespace.

    >>> exact_match("522 \\n", "522"), exact_match("5220", "522")
    (True, False)
    """
    return completion.strip() == answer.strip()


def _sample_problems(
    make: Callable[[random.Random], Problem], n: int, seed: int, split: Split, heldout_fraction: float
) -> list[Problem]:
    if n < 0:
        raise ConfigError(f"number of problems must be >= 0, got {n}")
    if split not in ("train", "test"):
        raise ConfigError(f"split must be 'train' or 'test', got {split!r}")
    # The split is part of the stream's seed so train and test draws are independent streams.
    rng = random.Random(f"{seed}:{split}")
    problems: list[Problem] = []
    for _ in range(n):
        for _ in range(_MAX_TRIES_PER_PROBLEM):
            problem = make(rng)
            if split_of(problem.prompt, heldout_fraction) == split:
                problems.append(problem)
                break
        else:
            raise ConfigError(
                f"could not draw a '{split}' problem in {_MAX_TRIES_PER_PROBLEM} tries; "
                f"the problem space is too small for heldout_fraction={heldout_fraction}"
            )
    return problems


class _ProblemTask:
    """Shared record builders (a field-less mixin); a task only says how to draw one ``Problem``."""

    __slots__ = ()
    name: str
    heldout_fraction: float

    def _make(self, rng: random.Random) -> Problem:
        raise NotImplementedError

    def _problems(self, n: int, seed: int, split: Split) -> list[Problem]:
        return _sample_problems(self._make, n, seed, split, self.heldout_fraction)

    def prompts(self, n: int, seed: int, split: Split = "train") -> list[PromptRecord]:
        problems = self._problems(n, seed, split)
        return [PromptRecord(p.prompt, {"answer": p.answer}, i) for i, p in enumerate(problems)]

    def sft(self, n: int, seed: int, split: Split = "train") -> list[SFTRecord]:
        problems = self._problems(n, seed, split)
        return [SFTRecord(p.prompt, p.demonstration or p.answer, i) for i, p in enumerate(problems)]

    def preferences(self, n: int, seed: int, split: Split = "train") -> list[PreferenceRecord]:
        problems = self._problems(n, seed, split)
        return [PreferenceRecord(p.prompt, p.answer, p.wrong_answer, i) for i, p in enumerate(problems)]

    def is_correct(self, completion: str, **fields: Any) -> bool:
        if fields.get("answer") is None:  # absent, or null in a table's row
            raise DataError(f"task '{self.name}' scores against an 'answer' field; the record has none")
        return self._matches(completion, str(fields["answer"]))

    def _matches(self, completion: str, answer: str) -> bool:
        return exact_match(completion, answer)

    def reward(self, prompt: str, completion: str, **fields: Any) -> float:
        """1.0 for the exact answer (surrounding whitespace ignored), else 0.0."""
        return 1.0 if self.is_correct(completion, **fields) else 0.0


def _check_fraction(heldout_fraction: float) -> None:
    if not 0.0 < heldout_fraction < 1.0:
        raise ConfigError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")


@dataclass(frozen=True, slots=True)
class ArithTask(_ProblemTask):
    num_digits: int = 3
    operators: str = "+-"
    num_terms: int = 2
    allow_negative: bool = False
    heldout_fraction: float = 0.1
    # A sloppy SFT teacher: with this probability its demonstration of a sum that needs a carry
    # forgets the carries ("58+67=" -> "15"). Prompts, answers and rewards stay exact; only the SFT
    # form imitates the teacher, which is what the demo's RL stage has to correct.
    teacher_carry_error: float = 0.0
    # A stuttering SFT teacher: with this probability it writes the last digit of an answer that ends
    # in an even digit twice ("12+34=" -> "466"). What the verifier rejects, RL can unlearn.
    teacher_repeat_error: float = 0.0
    name: str = field(default="arith", init=False)  # the registry's name, not an option

    def __post_init__(self) -> None:
        if self.num_digits < 1:
            raise ConfigError(f"arith num_digits must be >= 1, got {self.num_digits}")
        if not self.operators or set(self.operators) - {"+", "-"}:
            raise ConfigError(
                f"arith operators must be a non-empty mix of '+' and '-', got {self.operators!r}"
            )
        if self.num_terms < 2:
            raise ConfigError(f"arith num_terms must be >= 2, got {self.num_terms}")
        _check_fraction(self.heldout_fraction)
        for name in ("teacher_carry_error", "teacher_repeat_error"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"arith {name} must be in [0, 1], got {getattr(self, name)}")

    def _operand(self, rng: random.Random) -> int:
        num_digits = rng.randint(1, self.num_digits)
        low = 0 if num_digits == 1 else 10 ** (num_digits - 1)
        return rng.randint(low, 10**num_digits - 1)

    def _make(self, rng: random.Random) -> Problem:
        while True:  # rejection keeps the operand distribution intact; >= 1/2 of draws pass
            terms = [self._operand(rng) for _ in range(self.num_terms)]
            ops = [rng.choice(self.operators) for _ in range(self.num_terms - 1)]
            value = terms[0]
            for op, term in zip(ops, terms[1:]):
                value = value + term if op == "+" else value - term
            if value >= 0 or self.allow_negative:
                break
        expression = str(terms[0]) + "".join(op + str(t) for op, t in zip(ops, terms[1:]))
        demonstration = None
        # Drawn only when the teacher can err, so a clean task keeps its problem stream.
        if self.teacher_carry_error > 0 and set(ops) == {"+"} and rng.random() < self.teacher_carry_error:
            demonstration = _sum_without_carries(terms)
        is_even_ending = value % 2 == 0
        if self.teacher_repeat_error > 0 and is_even_ending and rng.random() < self.teacher_repeat_error:
            demonstration = str(value) + str(value)[-1]
        return Problem(f"{expression}=", str(value), str(_near_miss(value, rng)), demonstration)


def _sum_without_carries(terms: list[int]) -> str:
    """Column-wise sum mod 10, as if carries were forgotten: 58 + 67 -> "15" (the true sum is 125).

    >>> _sum_without_carries([58, 67]), _sum_without_carries([12, 34])
    ('15', '46')
    """
    width = max(len(str(t)) for t in terms)
    columns = [sum(int(str(t).zfill(width)[i]) for t in terms) % 10 for i in range(width)]
    return str(int("".join(map(str, columns))))


def _near_miss(value: int, rng: random.Random) -> int:
    """A wrong answer a model could plausibly give: off by one, or by one in some digit."""
    num_digits = len(str(abs(value)))
    offset = rng.choice([-1, 1]) * 10 ** rng.randrange(num_digits)
    wrong = value + offset
    return wrong if wrong >= 0 or value < 0 else value + abs(offset)


COPY_ALPHABET = string.ascii_letters + string.digits + " .,;:!?-_"


@dataclass(frozen=True, slots=True)
class CopyTask(_ProblemTask):
    min_chars: int = 40
    max_chars: int = 120
    chunk_size: int = 0  # 0: plain copy; k > 0: reverse each block of k characters
    separator: str = ">"
    heldout_fraction: float = 0.1
    name: str = field(default="copy", init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.min_chars <= self.max_chars:
            raise ConfigError(
                "copy needs 1 <= min_chars <= max_chars, "
                f"got min_chars={self.min_chars}, max_chars={self.max_chars}"
            )
        if self.chunk_size < 0:
            raise ConfigError(f"copy chunk_size must be >= 0, got {self.chunk_size}")
        if len(self.separator) != 1 or self.separator in COPY_ALPHABET or not self.separator.isprintable():
            raise ConfigError(
                f"copy separator must be one printable character outside the alphabet, got {self.separator!r}"
            )
        _check_fraction(self.heldout_fraction)

    def transform(self, text: str) -> str:
        """The expected answer for ``text``."""
        if self.chunk_size == 0:
            return text
        chunks = (text[i : i + self.chunk_size] for i in range(0, len(text), self.chunk_size))
        return "".join(chunk[::-1] for chunk in chunks)

    def _matches(self, completion: str, answer: str) -> bool:
        """The exact copy: spaces are characters of the alphabet, so none are stripped."""
        return completion == answer

    def _make(self, rng: random.Random) -> Problem:
        num_chars = rng.randint(self.min_chars, self.max_chars)
        text = "".join(rng.choice(COPY_ALPHABET) for _ in range(num_chars))
        answer = self.transform(text)
        # Wrong: one character substituted -- close enough that a preference model must read it all.
        position = rng.randrange(num_chars)
        replacement = rng.choice(COPY_ALPHABET.replace(answer[position], ""))
        wrong = answer[:position] + replacement + answer[position + 1 :]
        return Problem(f"{text}{self.separator}", answer, wrong)


TASKS: dict[str, Callable[..., Task]] = {"arith": ArithTask, "copy": CopyTask}


def task_names() -> list[str]:
    return sorted(TASKS)


def get_task(name: str, **kwargs: Any) -> Task:
    """Build a registered task by name, e.g. ``get_task("arith", num_digits=2)``."""
    check_task_options(name, kwargs)
    return TASKS[name](**kwargs)


def check_task_options(name: str, options: dict[str, Any]) -> None:
    """``data.task`` must name a task and ``data.task_options`` (untyped from YAML) be its options,
    each of its field's type (pydantic strict mode: no bool for an int, no 2.5 for an int; an int for
    a float is fine). The config checks them before anything is built; ``get_task`` again."""
    if name not in TASKS:
        raise ConfigError(f"data.task={name!r}: unknown task; available: {', '.join(task_names())}")
    cls = TASKS[name]
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
    for key, value in options.items():
        if key not in names:
            raise ConfigError(f"data.task_options.{key}: task '{name}' has no such option; "
                              f"its options: {', '.join(names)}")
        try:
            pydantic.TypeAdapter(hints[key]).validate_python(value, strict=True)
        except pydantic.ValidationError:
            kind = getattr(hints[key], "__name__", str(hints[key]))
            raise ConfigError(f"data.task_options.{key}: task '{name}' needs {kind}, got {value!r}") from None
