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
    """One log line every ``log_every`` steps, and at every evaluation: safe for CI logs and files.
    The ETA is the pace since the first step reported (start-up before it, model loading or a
    generator process booting, is no step's time); the first line has none."""

    def __init__(self, total: int, description: str, log_every: int = 1, stream: Any = None) -> None:
        self.total, self.description, self.log_every = total, description, log_every
        self.stream = stream or sys.stdout
        self._first: tuple[float, int] | None = None  # (time, step) of the first update

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        now = time.perf_counter()
        if self._first is None:
            self._first = (now, step)
        if step % self.log_every and step != self.total and "eval/loss" not in metrics:
            return
        start, first_step = self._first
        eta = f" eta {(now - start) / (step - first_step) * (self.total - step):.0f}s" if step > first_step else ""
        print(f"[{self.description}] step {step}/{self.total}{eta} {_summary(metrics)}", file=self.stream, flush=True)

    def close(self) -> None:
        pass


class RichProgress:
    """A live ``rich`` bar with step count and ETA, and the key metrics of the latest step on a line
    of their own below it (cut at the terminal's width: on one line they pushed the count and the
    ETA off an 80-column terminal)."""

    def __init__(self, total: int, description: str, console: Any = None) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
        from rich.progress import Progress as RichBar
        from rich.text import Text

        class TwoLineBar(RichBar):
            def get_renderables(self):  # type: ignore[no-untyped-def]
                yield self.make_tasks_table(self.tasks)
                for task in self.tasks:
                    yield Text(f"  {task.fields['summary']}", no_wrap=True, overflow="ellipsis")

        self._bar = TwoLineBar(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                               TimeRemainingColumn(), transient=False, console=console)
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
