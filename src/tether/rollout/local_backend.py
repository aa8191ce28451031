"""The local transport: how the trainer reaches the generator role on one machine.

Two backends with one interface (``GeneratorTransport``), both thin: every decision lives in
``GeneratorWorker`` and the trainer-side driver, never here.

* ``InProcessTransport`` steps the worker in the caller's thread (tests, sync mode, debugging);
* ``ProcessTransport`` runs the worker in its own process (``torch.multiprocessing``, spawn) with
  its own CPU threads: finished groups and control messages travel through queues, weights
  through ``SharedWeights`` buckets. A Ray backend will implement the same four calls.
"""

from __future__ import annotations

import contextlib
import queue
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
import torch.multiprocessing as mp

from tether.data.records import PromptRecord
from tether.rollout.buffer import GroupRollout
from tether.rollout.generator_worker import GeneratorCounters, GeneratorWorker
from tether.rollout.weights import SharedWeights


class GeneratorCrashedError(RuntimeError):
    """The generator role raised; the message carries its traceback."""


class GeneratorTransport(Protocol):
    counters: GeneratorCounters  # the generator's latest cumulative counters

    def poll(self, timeout_s: float) -> list[GroupRollout]:
        """Groups finished since the last poll (waits up to ``timeout_s`` for at least one)."""
        ...

    def publish_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None: ...

    def reissue(self, records: list[PromptRecord]) -> None:
        """Prompts whose groups were dropped; the generator queues them first and frees their capacity."""
        ...

    def close(self) -> None: ...


class InProcessTransport:
    """Drives the worker in the caller's thread. ``run_ahead``: each poll steps until the worker is
    idle (the generator as far ahead as capacity allows: the staleness worst case); otherwise until
    at least one group finishes."""

    def __init__(self, worker: GeneratorWorker, run_ahead: bool = False) -> None:
        self.worker = worker
        self.run_ahead = run_ahead
        self.counters = worker.counters

    def poll(self, timeout_s: float = 1.0) -> list[GroupRollout]:
        groups: list[GroupRollout] = []
        deadline = time.monotonic() + timeout_s
        while not self.worker.is_idle:
            groups.extend(self.worker.step())
            if groups and not self.run_ahead:
                break
            if not groups and time.monotonic() > deadline:
                break  # e.g. dynamic sampling filtering everything: let the driver judge
        return groups

    def publish_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self.worker.load_weights(named_tensors, version)

    def reissue(self, records: list[PromptRecord]) -> None:
        self.worker.reissue(records)

    def close(self) -> None:
        pass


def run_generator_process(make_worker: Callable[[], GeneratorWorker], weights: SharedWeights,
                          control: Any, results: Any, stop: Any, num_threads: int) -> None:
    """The generator process's main loop: control messages, then weights, then one engine step."""
    if num_threads > 0:
        torch.set_num_threads(num_threads)
    try:
        worker = make_worker()
        while not stop.is_set():
            with contextlib.suppress(queue.Empty):
                while True:
                    kind, payload = control.get_nowait()
                    if kind == "reissue":
                        worker.reissue(payload)
            if weights.has_unread:  # between engine steps, so no step ever mixes two weight sets
                named_tensors, version = weights.read()
                worker.load_weights(named_tensors, version)
                weights.ack(version)
            groups = worker.step()
            if groups:
                results.put(("groups", groups, worker.counters))
            elif worker.is_idle:
                time.sleep(0.001)  # waiting for weights or re-issued prompts
        # Stopped: groups still queued will never be read. Without this the exit waits for the
        # queue's feeder thread to push them through a full pipe, and ``close`` ran into its 10 s
        # timeout whenever the generator had run ahead (S >= 2 left ~10 s on every run's clock).
        results.cancel_join_thread()
    except Exception:  # reported to the trainer, which raises it; the process then exits
        results.put(("error", traceback.format_exc(), None))


class ProcessTransport:
    def __init__(self, make_worker: Callable[[], GeneratorWorker], weights: SharedWeights,
                 num_threads: int = 0) -> None:
        """``make_worker`` must be picklable (a module-level function or a ``functools.partial`` of one):
        it runs in the new process and builds the engine there."""
        ctx = mp.get_context("spawn")
        self.weights = weights
        self.counters = GeneratorCounters()
        self._control = ctx.Queue()
        self._results = ctx.Queue()
        self._stop = ctx.Event()
        self._process = ctx.Process(target=run_generator_process, name="tether-generator", daemon=True,
                                    args=(make_worker, weights, self._control, self._results, self._stop,
                                          num_threads))
        self._process.start()

    def poll(self, timeout_s: float = 1.0) -> list[GroupRollout]:
        groups: list[GroupRollout] = []
        try:
            message = self._results.get(timeout=timeout_s)
            while True:
                groups.extend(self._unpack(message))
                message = self._results.get_nowait()
        except queue.Empty:
            pass
        if not groups and not self._process.is_alive():
            raise GeneratorCrashedError(f"the generator process exited with code {self._process.exitcode}")
        return groups

    def _unpack(self, message: tuple[str, Any, GeneratorCounters | None]) -> list[GroupRollout]:
        kind, payload, counters = message
        if kind == "error":
            raise GeneratorCrashedError(f"the generator process failed:\n{payload}")
        assert counters is not None
        self.counters = counters
        return payload

    def publish_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self.weights.write(named_tensors, version, is_reader_alive=self._process.is_alive)

    def reissue(self, records: list[PromptRecord]) -> None:
        self._control.put(("reissue", records))

    def close(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._process.join(timeout_s)
        if self._process.is_alive():
            self._process.terminate()  # our own child, by handle
            self._process.join(timeout_s)
        for q in (self._control, self._results):
            q.cancel_join_thread()
            q.close()
