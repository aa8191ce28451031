"""Resolve reward functions named in config: a built-in name, ``module:function`` or ``file.py:function``.

A reward function is a plain ``(prompt, completion, **fields) -> float | dict[str, float]``; a
dict return is a set of named sub-scores that are summed (and logged one by one).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tether.data.tasks import exact_match as answers_match
from tether.errors import ConfigError, one_line

RewardFn = Callable[..., Any]


def exact_match(prompt: str, completion: str, answer: Any = None, **fields: Any) -> float:
    """1.0 when the completion, stripped, equals the row's ``answer`` field: a string, a number
    (written as JSON writes it: ``85.0`` matches "85" and "85.0") or a list of accepted answers. A
    row without an answer (no such column, or null) or of another type is an error, counted in
    ``reward/errors``, not a silent 0.

    >>> exact_match("2+2=", " 4 ", answer="4"), exact_match("2+2=", "4", answer=4.0)
    (1.0, 1.0)
    >>> exact_match("2+2=", "four", answer=["4", "four"])
    1.0
    """
    if answer is None:
        raise ValueError("the row has no 'answer' field (or it is null) to compare with")
    accepted = answer if isinstance(answer, (list, tuple)) else [answer]
    return float(any(answers_match(completion, text) for item in accepted for text in _answer_texts(item)))


def _answer_texts(answer: Any) -> list[str]:
    """The spellings an answer matches: its string, or a number's (``4.0`` as "4" too)."""
    if isinstance(answer, str):
        return [answer]
    if isinstance(answer, bool) or not isinstance(answer, (int, float)):
        raise ValueError(f"the row's answer must be a string, a number or a list of them, got {answer!r}"[:200])
    if isinstance(answer, float) and answer.is_integer():
        return [str(answer), str(int(answer))]
    return [str(answer)]


BUILTIN_REWARDS: Mapping[str, RewardFn] = {"exact_match": exact_match}


def resolve_reward(spec: str, builtins: Mapping[str, RewardFn] | None = None) -> RewardFn:
    """Turn a config string into a callable; a bad name is a one-line ``ConfigError``."""
    table = {**BUILTIN_REWARDS, **(builtins or {})}
    if spec in table:
        return table[spec]
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ConfigError(f"rewards: unknown reward {spec!r}; use one of {sorted(table)}, "
                          "'module:function' or 'path/file.py:function'")
    module = _load_file(target, spec) if reward_file(spec) else _import(target, spec)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"rewards: {target} has no function {name!r} ({spec})")
    return fn


def check_called_per_sample(fn: RewardFn, spec: str, fields: Mapping[str, Any]) -> None:
    """Refuse, before a run, a reward that cannot be called ``fn(prompt, completion, **fields)`` with
    the data's ``fields`` (every field name any row has: a task mixture's rows differ): every call
    would raise, score 0, and the run would train on nothing (TRL's batched
    ``reward_fn(completions, **kwargs)`` did, exit 0). A class is refused too."""
    if isinstance(fn, type):
        raise ConfigError(f"rewards: {spec} is a class; name a function (prompt, completion, **fields) -> float")
    try:  # the function's own signature, not a @functools.wraps adapter's wrapped one
        signature = inspect.signature(fn, follow_wrapped=False)
    except (TypeError, ValueError):  # a builtin without a signature: its calls will tell
        return
    # As ``RewardComputer`` calls it: columns named like the positional arguments are not passed.
    fields = {key: value for key, value in fields.items() if key not in ("prompt", "completion")}
    try:
        signature.bind("", "", **fields)
    except TypeError as error:
        batched = {"prompts", "completions"} & set(signature.parameters)
        hint = ("; TRL's batched form is not tether's: tether calls it once per sample" if batched else "")
        row = f" and the data's fields {sorted(fields)}" if fields else ""
        raise ConfigError(f"rewards: {spec}{signature} cannot be called as f(prompt, completion{row}): "
                          f"{error}{hint}") from None


def reward_file(spec: str) -> tuple[str, str] | None:
    """(the file, the function) of a ``path/file.py:function`` spec; None for any other spec."""
    target, sep, name = spec.rpartition(":")
    return (target, name) if sep and target.endswith(".py") else None


def _import(module_name: str, spec: str) -> Any:
    # From the working directory too, as `python -m` would: the `tether` console script puts its own
    # bin directory first on sys.path, not the directory it runs in.
    cwd = os.getcwd()
    is_added = cwd not in sys.path
    if is_added:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:  # the user's module may fail in any way while importing
        raise ConfigError(f"rewards: cannot import {module_name!r} ({spec}): {type(exc).__name__}: "
                          f"{one_line(exc)}") from None
    finally:
        if is_added and cwd in sys.path:  # the module may have changed directory, or sys.path
            sys.path.remove(cwd)


def _load_file(path_text: str, spec: str) -> Any:
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise ConfigError(f"rewards: file not found: {path} ({spec})")
    # A module registered under a name of its own file (two rewards.py in different directories do
    # not collide), as importlib's recipe does: dataclasses and pickle look classes up in sys.modules.
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]
    name = f"tether_reward_{path.stem}_{digest}"
    if name in sys.modules:  # two functions of one file share one module: its globals, one import-time load
        return sys.modules[name]
    # Its own directory first on sys.path, as running the file as a script would, and kept there: a
    # helper module beside it (``from utils import extract_answer``) is imported at load time or
    # lazily, inside a reward call.
    directory = str(path.resolve().parent)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"rewards: cannot load {path} ({spec})")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # exit() at import time too
        sys.modules.pop(name, None)
        raise ConfigError(f"rewards: {path} failed to load: {type(exc).__name__}: {one_line(exc)}") from None
    return module
