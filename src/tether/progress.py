"""Progress display: a ``rich`` bar with ETA and key metrics on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import Any, Protocol

KEY_METRICS = ("reward/mean", "loss/policy", "loss/sft", "eval/loss", "kl/ref", "entropy",
               "time/step_s")


class Progress(Protocol):
    def update(self, step: int, metrics: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


def _summary(metrics: dict[str, Any]) -> str:
    parts = []
    for key in KEY_METRICS:
        value = metrics.get(key)
        if isinstance(value, (int, float)):
            parts.append(f"{key}={value:.4g}")
    return " ".join(parts)


class PlainProgress:
    """One log line every ``log_every`` steps: safe for CI logs and files."""

    def __init__(self, total: int, description: str, log_every: int = 1, stream: Any = None) -> None:
        self.total, self.description, self.log_every = total, description, log_every
        self.stream = stream or sys.stdout
        self.start = time.time()

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        if step % self.log_every and step != self.total:
            return
        elapsed = time.time() - self.start
        eta = elapsed / max(step, 1) * (self.total - step)
        print(f"[{self.description}] step {step}/{self.total} eta {eta:.0f}s {_summary(metrics)}",
              file=self.stream, flush=True)

    def close(self) -> None:
        pass


class RichProgress:
    """A live ``rich`` bar with ETA and the key metrics of the latest step."""

    def __init__(self, total: int, description: str) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
        from rich.progress import Progress as RichBar

        self._bar = RichBar(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeRemainingColumn(), TextColumn("{task.fields[summary]}"), transient=False)
        self._task = self._bar.add_task(description, total=total, summary="")
        self._bar.start()

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        self._bar.update(self._task, completed=step, summary=_summary(metrics))

    def close(self) -> None:
        self._bar.stop()


class NullProgress:
    def update(self, step: int, metrics: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def make_progress(mode: str, total: int, description: str, log_every: int = 1) -> Progress:
    """``auto`` picks rich on a terminal and plain lines otherwise."""
    if mode == "auto":
        mode = "rich" if sys.stdout.isatty() else "plain"
    if mode == "rich":
        return RichProgress(total, description)
    if mode == "plain":
        return PlainProgress(total, description, log_every)
    return NullProgress()
