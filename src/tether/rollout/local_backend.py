"""The local transport: how the trainer reaches the generator role on one machine.

Two backends with one interface (``GeneratorTransport``), both thin: every decision lives in
``GeneratorWorker`` and the trainer-side driver, never here.

* ``InProcessTransport`` steps the worker in the caller's thread (tests, sync mode, debugging);
* ``ProcessTransport`` runs the worker in its own process (``torch.multiprocessing``) with its own
  CPU threads: finished groups and control messages travel through queues, weights through
  ``SharedWeights`` buckets. A Ray backend will implement the same calls.
* ``HandoverTransport`` bridges the generator process's start-up: until the process reports ready, a
  worker in the trainer's process generates, stepped between training steps like
  ``InProcessTransport``; then that worker drains (finishes its groups in flight, starts none) and
  its state (prompt cursor, re-issue queue, capacity count, counters) goes to the process together
  with the current weights, so the prompt stream continues where it stopped: no prompt is skipped
  or generated twice, and the staleness bound holds across the switch.

Generator processes fork from a process server where the platform has one (``process_server``); the
process's own loop is ``generator_process``.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from tether.data.records import PromptRecord
from tether.errors import TetherError
from tether.rollout.buffer import GroupRollout
from tether.rollout.generator_process import generator_process_main
from tether.rollout.generator_worker import GeneratorCounters, GeneratorWorker
from tether.rollout.process_server import process_context, sigint_deferred, sigint_ignored, start_process_server
from tether.rollout.weights import ReaderExitedError, SharedWeights


class GeneratorCrashedError(TetherError, RuntimeError):
    """The generator process failed or died: the message says how in one line (its exception's last
    line, or the signal that killed it); ``traceback`` holds its whole traceback when it sent one."""

    def __init__(self, message: str, traceback: str = "") -> None:
        super().__init__(message)
        self.traceback = traceback

    @classmethod
    def from_traceback(cls, text: str) -> GeneratorCrashedError:
        last = next((line for line in reversed(text.strip().splitlines()) if line.strip()), "")
        return cls(f"the generator process failed: {last.strip()}", text)

    @classmethod
    def from_exit(cls, exitcode: int | None) -> GeneratorCrashedError:
        if exitcode is not None and exitcode < 0:
            try:
                name = signal.Signals(-exitcode).name
            except ValueError:
                name = "a signal"
            hint = "; out of memory?" if -exitcode == signal.SIGKILL else ""
            return cls(f"the generator process was killed by {name} (signal {-exitcode}{hint})")
        return cls(f"the generator process exited with code {exitcode}")


class GeneratorTransport(Protocol):
    counters: GeneratorCounters  # the generator's latest cumulative counters

    @property
    def is_in_process(self) -> bool:
        """Whether the generator runs inside ``poll`` (in the trainer's thread) rather than beside
        the trainer, overlapping its steps."""
        ...

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

    @property
    def counters(self) -> GeneratorCounters:
        return self.worker.counters  # the worker's own: load_state_dict replaces it

    @property
    def is_in_process(self) -> bool:
        return True

    def poll(self, timeout_s: float = 1.0) -> list[GroupRollout]:
        groups: list[GroupRollout] = []
        deadline = time.monotonic() + timeout_s
        dropped = _num_dropped(self.counters)
        while not self.worker.is_idle:
            groups.extend(self.worker.step())
            if groups and not self.run_ahead:
                break
            if not groups and (_num_dropped(self.counters) != dropped or time.monotonic() > deadline):
                break  # a group filtered (dynamic sampling) or failed: the driver counts them against its limits
        return groups

    def publish_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self.worker.load_weights(named_tensors, version)

    def reissue(self, records: list[PromptRecord]) -> None:
        self.worker.reissue(records)

    def close(self) -> None:
        pass


class ProcessTransport:
    def __init__(self, make_worker: Callable[[], GeneratorWorker], weights: SharedWeights,
                 num_threads: int = 0, wait_for_handover: bool = False) -> None:
        """``make_worker`` must be picklable (a module-level function or a ``functools.partial`` of one):
        it runs in the new process and builds the engine there, holding the weights ``weights`` was made
        from (version 0: ``decoder_from_weights`` builds a model from them). ``wait_for_handover``: the process
        reports ready (``is_ready``) and idles until ``hand_over``. Forked from the process server
        where there is one (started here with ``BASE_PRELOAD`` if no caller started it sooner)."""
        start_process_server()
        ctx = process_context()
        self.weights = weights
        self.counters = GeneratorCounters()
        self._control = ctx.Queue()
        self._results = ctx.Queue()
        self._stop = ctx.Event()
        self._is_ready = False  # the process reported its worker built
        self._process = ctx.Process(target=generator_process_main, name="tether-generator", daemon=True,
                                    args=(make_worker, weights, self._control, self._results, self._stop,
                                          num_threads, wait_for_handover, os.getpid()))
        # Spawned (no process server), the child inherits SIGINT ignored through its imports; a forked one
        # inherits it from the server. Around a forkserver's start (which waits for the server's imports)
        # a Ctrl-C is held back until the child is forked, then stops it: raised mid-start, it left a
        # child that the server forked after this process had gone, which printed a traceback.
        if ctx.get_start_method() == "spawn":
            with sigint_ignored():
                self._process.start()
        else:
            with sigint_deferred() as interrupted:
                self._process.start()
            if interrupted:
                self.close()
                raise KeyboardInterrupt

    @property
    def is_in_process(self) -> bool:
        return False

    def is_ready(self) -> bool:
        """Whether the process has built its worker (never blocks; raises if it failed or died).

        Reads one message when not ready yet: call it only before any group can have been sent
        (waiting for a handover) or when the rest no longer matters (``close``)."""
        if not self._is_ready:
            with contextlib.suppress(queue.Empty):
                self._unpack(self._results.get_nowait())  # "ready" sets the flag; "error" raises
            if not self._is_ready and not self._process.is_alive():
                self._raise_exited()
        return self._is_ready

    def _raise_exited(self) -> None:
        """The process is gone: raise with its error report when one is still in the queue."""
        with contextlib.suppress(queue.Empty):
            while True:
                self._unpack(self._results.get(timeout=0.1))  # an "error" message raises with its traceback
        raise GeneratorCrashedError.from_exit(self._process.exitcode)

    def hand_over(self, state: dict[str, Any], named_tensors: Iterable[tuple[str, torch.Tensor]],
                  version: int) -> None:
        """Start the waiting process from a drained worker's ``state_dict`` and the weights of ``version``."""
        self.publish_weights(named_tensors, version)  # read before its first step, after the state
        self._control.put(("handover", state))
        self.counters = GeneratorCounters(**state["counters"])

    def poll(self, timeout_s: float = 1.0) -> list[GroupRollout]:
        groups: list[GroupRollout] = []
        deadline = time.monotonic() + timeout_s
        dropped = _num_dropped(self.counters)
        while not groups:  # a "ready" message carries no group: wait on
            try:
                groups.extend(self._unpack(self._results.get(timeout=max(0.0, deadline - time.monotonic()))))
            except queue.Empty:
                break
            with contextlib.suppress(queue.Empty):
                while True:
                    groups.extend(self._unpack(self._results.get_nowait()))
            if _num_dropped(self.counters) != dropped:
                break  # a group filtered (dynamic sampling) or failed: the driver counts them against its limits
        if not groups and not self._process.is_alive():
            self._raise_exited()
        return groups

    def _unpack(self, message: tuple[str, Any, GeneratorCounters | None]) -> list[GroupRollout]:
        kind, payload, counters = message
        if kind == "error":
            raise GeneratorCrashedError.from_traceback(payload)
        self._is_ready = True  # "ready" comes first; groups only after it
        if kind == "ready":
            return []
        assert counters is not None
        self.counters = counters
        return payload

    def publish_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        try:
            self.weights.write(named_tensors, version, is_reader_alive=self._process.is_alive)
        except ReaderExitedError:
            self._raise_exited()  # with the error the process reported, when it sent one

    def reissue(self, records: list[PromptRecord]) -> None:
        self._control.put(("reissue", records))

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the process: it finishes its engine step and exits; one still starting up (importing,
        building its engine) holds nothing yet and is terminated rather than waited for."""
        self._stop.set()
        with contextlib.suppress(GeneratorCrashedError, OSError, ValueError):  # OSError/ValueError: closed pipe
            self.is_ready()
        if self._is_ready:
            self._process.join(timeout_s)
        if self._process.is_alive():
            self._process.terminate()  # our own child, by handle
            self._process.join(timeout_s)
        for q in (self._control, self._results):
            q.cancel_join_thread()
            q.close()


class HandoverTransport:
    """Generates in the trainer's process until the generator process is ready, then hands over.

    ``local`` is a worker built from the same config as the process's; the process must have been
    started with ``wait_for_handover=True``. Weights published before the switch go to ``local``;
    at the switch the latest ones (the trainer's live parameters, unchanged since they were
    published) go to the process with the drained worker's state.
    """

    def __init__(self, local: GeneratorWorker, remote: ProcessTransport) -> None:
        self.remote = remote
        self._local: InProcessTransport | None = InProcessTransport(local)
        self._latest: tuple[list[tuple[str, torch.Tensor]], int] | None = None

    @property
    def counters(self) -> GeneratorCounters:
        return self._local.worker.counters if self._local is not None else self.remote.counters

    @property
    def is_handed_over(self) -> bool:
        return self._local is None

    @property
    def is_in_process(self) -> bool:
        return self._local is not None

    def poll(self, timeout_s: float = 1.0) -> list[GroupRollout]:
        local = self._local
        if local is None:
            return self.remote.poll(timeout_s)
        if local.worker.is_admitting and self.remote.is_ready():
            local.worker.drain()
        if not local.worker.is_admitting and local.worker.is_idle:
            self._hand_over(local.worker)
            return self.remote.poll(timeout_s)
        return local.poll(timeout_s)

    def _hand_over(self, worker: GeneratorWorker) -> None:
        # ``_latest`` holds the trainer's live parameters: still the values of ``version`` because the
        # switch happens inside a poll, between a step's publish and the next step's optimizer update.
        named_tensors, version = self._latest if self._latest is not None else (
            list(worker.engine.model.named_parameters()), worker.version)
        if version != worker.version:
            raise RuntimeError(f"hand-over of version {version} from a worker holding {worker.version}")
        self.remote.hand_over(worker.state_dict(), named_tensors, version)
        self._local = None  # frees its engine and KV pool

    def publish_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        if self._local is None:
            self.remote.publish_weights(named_tensors, version)
            return
        named_tensors = list(named_tensors)
        self._local.publish_weights(named_tensors, version)
        self._latest = (named_tensors, version)

    def reissue(self, records: list[PromptRecord]) -> None:
        (self._local or self.remote).reissue(records)

    def close(self) -> None:
        self._local = None
        self.remote.close()


def _num_dropped(counters: GeneratorCounters) -> int:
    """Groups the generator filtered (dynamic sampling) or failed so far: a poll returns when they change."""
    return counters.num_filtered + counters.num_failed
