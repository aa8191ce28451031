"""Run outputs with stable names: ``metrics.jsonl`` (one object per step), ``samples.jsonl``.

Every metric of a run goes through ``MetricsWriter``; later logging backends (TensorBoard, W&B)
hang off the same ``log`` call. Metric names are public interface; the ones a step always writes:

``step``, ``reward/mean``, ``reward/std``, ``loss/policy``, ``kl/ref``, ``entropy``, ``grad_norm``,
``response_length/mean``, ``time/step_s``, ``throughput/gen_tokens_per_s``,
``throughput/train_tokens_per_s``, ``throughput/step_tokens_per_s`` (plus ``lr``, ``reward/<name>/mean``,
``reward/errors`` ...).

``throughput/step_tokens_per_s`` (completion tokens trained on over the step's time) means the same in
both loops; ``throughput/gen_tokens_per_s`` is the engine's rate over ``time/gen_s``: the generation
phase in the sync loop and wherever the generator runs in the trainer's thread (sync mode with
oversampling or dynamic sampling, an async run's start-up), the whole step where a generator process
overlaps training; there it counts every token sampled since the last step, those of groups aborted,
filtered or not yet consumed too.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from tether.errors import RunOutputError
from tether.progress import Progress


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Inf; keep them visible rather than invalid
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):
        return _jsonable(value.item())
    return value


class MetricsWriter:
    """Appends one JSON object per step; flushes each line so a killed run keeps every step."""

    def __init__(self, run_dir: Path, progress: Progress | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.samples_path = self.run_dir / "samples.jsonl"
        self.progress = progress
        self._metrics = self.metrics_path.open("a")
        self._samples = self.samples_path.open("a")
        self.start_time = time.time()

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **_jsonable(metrics)}
        self._write(self._metrics, self.metrics_path, json.dumps(record) + "\n")
        if self.progress is not None:
            self.progress.update(step, metrics)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        text = "".join(json.dumps({"step": step, **_jsonable(sample)}) + "\n" for sample in samples)
        self._write(self._samples, self.samples_path, text)

    @staticmethod
    def _write(file: Any, path: Path, text: str) -> None:
        """Appends and flushes; a full disk, or the run directory deleted under the run (whose lines
        would go on into a file no one can read), stops the run with one line."""
        try:
            if os.fstat(file.fileno()).st_nlink == 0:
                raise RunOutputError(f"{path} was deleted while the run wrote it (the run directory removed?)")
            file.write(text)
            file.flush()
        except OSError as error:
            raise RunOutputError(f"{path}: cannot write ({error.strerror or error})") from None

    def close(self) -> None:
        for file in (self._metrics, self._samples):
            with contextlib.suppress(OSError):  # a full disk was reported by the write that hit it
                file.close()
        if self.progress is not None:
            self.progress.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Read a ``metrics.jsonl`` back (tests, plots); a last line cut short (a full disk, a kill
    mid-write) is left out."""
    with Path(path).open() as f:
        lines = [line for line in f if line.strip()]
    records = [json.loads(line) for line in lines[:-1]]
    if lines:
        with contextlib.suppress(json.JSONDecodeError):
            records.append(json.loads(lines[-1]))
    return records
