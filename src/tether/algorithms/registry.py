"""Name -> function registries for the interchangeable pieces of RL math.

The trainer looks up an advantage estimator, a policy loss, a KL estimator, an off-policy
correction and a loss aggregation by the name written in the config; it never branches on that
name. Each module in ``tether.algorithms`` fills its registry with ``@REGISTRY.register("name")``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from tether.errors import ConfigError

T = TypeVar("T", bound=Callable[..., Any])


class UnknownNameError(ConfigError, KeyError):
    """A config names an entry that is not registered; the message lists the valid names.

    A ``KeyError`` for code that looks names up, and a ``ConfigError`` so the CLI prints it as a
    one-line user error.
    """

    def __str__(self) -> str:
        # KeyError.__str__ would repr() the message, wrapping it in quotes.
        return str(self.args[0]) if self.args else ""


class Registry(Generic[T]):
    """A small name -> function table; ``kind`` names it in error messages (e.g. "advantage")."""

    __slots__ = ("kind", "_entries")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@ADVANTAGES.register("grpo")``. Registering a name twice is a bug."""

        def add(fn: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = fn
            return fn

        return add

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            valid = ", ".join(self.names())
            raise UnknownNameError(f"unknown {self.kind} {name!r}; valid names: {valid}") from None

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._entries))

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={list(self.names())})"


# One registry per choice the config makes; the modules below fill them at import time.
ADVANTAGES: Registry[Callable[..., Any]] = Registry("advantage estimator")
POLICY_LOSSES: Registry[Callable[..., Any]] = Registry("policy loss")
KL_ESTIMATORS: Registry[Callable[..., Any]] = Registry("KL estimator")
CORRECTIONS: Registry[Callable[..., Any]] = Registry("off-policy correction")
AGGREGATIONS: Registry[Callable[..., Any]] = Registry("loss aggregation")
