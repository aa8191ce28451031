"""The local transport: how the trainer reaches the generator role on one machine.

Two backends with one interface (``GeneratorTransport``), both thin: every decision lives in
``GeneratorWorker`` and the trainer-side driver, never here.

* ``InProcessTransport`` steps the worker in the caller's thread (tests, sync mode, debugging);
* ``ProcessTransport`` runs the worker in its own process (``torch.multiprocessing``) with its own
  CPU threads: finished groups and control messages travel through queues, weights through
  ``SharedWeights`` buckets. A Ray backend will implement the same four calls.
* ``HandoverTransport`` bridges the generator process's start-up: until the process reports ready, a
  worker in the trainer's process generates, stepped between training steps like
  ``InProcessTransport``; then that worker drains (finishes its groups in flight, starts none) and
  its state (prompt cursor, re-issue queue, capacity count, counters) goes to the process together
  with the current weights, so the prompt stream continues where it stopped: no prompt is skipped
  or generated twice, and the staleness bound holds across the switch.

Process start-up. A spawned interpreter pays its imports (torch ~2.5 s, transformers ~1 s to unpickle
a tokenizer on a small machine) before it builds its engine. Where the platform has it (Linux,
macOS), generator processes are forked from a *process server* instead (multiprocessing's
forkserver): a fresh interpreter that imports the generator's modules once
(``start_process_server``) and forks a child per generator, which starts with them already
imported. It never ran torch ops, so no OpenMP pool is forked half-alive. Callers that know an
asynchronous run is coming start the server early (``tether train``, ``tether demo``, the
benchmarks), so its imports overlap their own set-up; ``ProcessTransport`` starts it on demand
otherwise. Elsewhere the context is spawn, as before.
"""

from __future__ import annotations

import contextlib
import copy
import multiprocessing.forkserver
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.multiprocessing as mp

from tether.data.records import PromptRecord
from tether.errors import TetherError
from tether.rollout.buffer import GroupRollout
from tether.rollout.generator_worker import GeneratorCounters, GeneratorWorker
from tether.rollout.weights import ReaderExitedError, SharedWeights

# What a generator process needs imported (``GeneratorWorker`` and this module's loop); the recipe
# that builds the worker adds its own modules (``start_process_server``).
BASE_PRELOAD = ("tether.rollout.local_backend",)


def process_context() -> Any:
    """The multiprocessing context generator processes start in: forkserver where available, else spawn."""
    return mp.get_context("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")


_is_preload_set = False  # the process server's modules are fixed by the first start


def start_process_server(preload: Sequence[str] = (), wait: bool = False) -> bool:
    """Start the process server that generator processes fork from, importing ``BASE_PRELOAD`` and
    ``preload`` (module names; one that fails to import is skipped, and a child that needs it
    imports it itself). Returns at once: the server imports in the background, and the first fork
    waits for it; ``wait``: return once it has imported (by forking a process that does nothing).
    The first call fixes the modules for the life of this process; later calls only make sure the
    server runs. False where the platform has no forkserver (processes are spawned).
    """
    global _is_preload_set
    context = process_context()
    if context.get_start_method() != "forkserver":
        return False
    if not _is_preload_set:
        context.set_forkserver_preload([*BASE_PRELOAD, *preload])
        _is_preload_set = True
    with _sigint_ignored():  # the server, and every generator forked from it, leave Ctrl-C to the trainer
        multiprocessing.forkserver.ensure_running()
    if wait:
        probe = context.Process(target=_do_nothing, name="tether-server-probe")
        probe.start()  # forked once the server has imported
        probe.join()
    return True


def _do_nothing() -> None:
    pass


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[list[bool]]:
    """SIGINT recorded (the yielded list gets an entry), not raised, while the block runs on the main
    thread; the caller raises it after. Elsewhere signals cannot be set, and nothing is held back."""
    caught: list[bool] = []
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return
    previous = signal.signal(signal.SIGINT, lambda *_: caught.append(True))
    try:
        yield caught
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """SIGINT ignored while a process starts (on the main thread; elsewhere signals cannot be set): the
    child inherits it across exec. Ctrl-C reaches the whole process group; the trainer turns it into
    "interrupted" and stops its generator, which otherwise printed a KeyboardInterrupt traceback of
    its own (the server's one too, when it came during the server's imports)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:  # None: a handler set outside Python, which cannot be put back; Python's own then
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)


def _leave_sigint_to_the_trainer(*_: Any) -> None:
    """The generator process's SIGINT handler: nothing. Ctrl-C reaches the whole process group and the
    trainer stops the generator; a handler (not SIG_IGN) because a caught signal is reset to its
    default across exec, so programs the generator starts (a reward's sandbox, the kernels' compiler)
    still stop on Ctrl-C."""


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


def _handle(worker: GeneratorWorker, kind: str, payload: Any) -> None:
    if kind == "reissue":
        worker.reissue(payload)
    elif kind == "handover":
        worker.load_state_dict(payload)


class TrainerWatch:
    """Whether the trainer process that started a generator is gone (killed by SIGKILL, the OOM
    killer, a job's time limit: nothing set ``stop``). A generator checks at most every
    ``CHECK_S`` and exits, instead of spinning on as an orphan; ``pid`` 0 never reports gone."""

    CHECK_S = 0.5

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._next_check = 0.0

    def is_gone(self) -> bool:
        now = time.monotonic()
        if self.pid <= 0 or now < self._next_check:
            return False
        self._next_check = now + self.CHECK_S
        try:
            os.kill(self.pid, 0)  # signal 0: only asks whether the process exists
        except ProcessLookupError:
            return True
        except PermissionError:  # exists, owned by someone else (a reused pid): not ours to judge
            return False
        return False


def _is_stopped(stop: Any, trainer: TrainerWatch) -> bool:
    return stop.is_set() or trainer.is_gone()


def _wait_for_handover(worker: GeneratorWorker, control: Any, stop: Any, trainer: TrainerWatch) -> bool:
    """Generate nothing until a ``handover`` message brings the state to continue from; False if stopped."""
    while not _is_stopped(stop, trainer):
        with contextlib.suppress(queue.Empty):
            kind, payload = control.get(timeout=0.05)
            _handle(worker, kind, payload)
            if kind == "handover":
                return True
    return False


def _generate(worker: GeneratorWorker, weights: SharedWeights, control: Any, results: Any, stop: Any,
              trainer: TrainerWatch) -> None:
    reported: tuple[int, ...] = ()  # the drop counters last sent: a change is sent even with no group
    while not _is_stopped(stop, trainer):
        with contextlib.suppress(queue.Empty):
            while True:
                _handle(worker, *control.get_nowait())
        if weights.has_unread:  # between engine steps, so no step ever mixes two weight sets
            named_tensors, version = weights.read()
            worker.load_weights(named_tensors, version)
            weights.ack(version)
        groups = worker.step()
        counters = worker.counters
        drops = (counters.num_failed, counters.num_filtered, counters.num_aborted)
        if groups or drops != reported:  # a run whose every group fails still tells the trainer why
            results.put(("groups", groups, copy.copy(counters)))
            reported = drops
        elif worker.is_idle:
            time.sleep(0.001)  # waiting for weights or re-issued prompts


def run_generator_process(make_worker: Callable[[], GeneratorWorker], weights: SharedWeights,
                          control: Any, results: Any, stop: Any, num_threads: int,
                          wait_for_handover: bool = False, trainer_pid: int = 0) -> bool:
    """The generator process's main loop: control messages, then weights, then one engine step.

    Reports ``ready`` once its worker is built; ``wait_for_handover``: then generates nothing until
    a ``handover`` message brings the state to continue from (``HandoverTransport``). Stops when
    ``stop`` is set or the process ``trainer_pid`` is gone. Returns True when stopped cleanly,
    False after reporting an error.
    """
    trainer = TrainerWatch(trainer_pid)
    if num_threads > 0:
        torch.set_num_threads(num_threads)
    try:
        worker = make_worker()
        results.put(("ready", None, None))
        if not wait_for_handover or _wait_for_handover(worker, control, stop, trainer):
            _generate(worker, weights, control, results, stop, trainer)
    except BaseException:  # anything (SystemExit, CancelledError from user code) is reported to
        results.put(("error", traceback.format_exc(), None))  # the trainer, which raises it; then exit
        return False
    # Stopped: groups still queued will never be read. Without this the exit waits for the
    # queue's feeder thread to push them through a full pipe, and ``close`` ran into its 10 s
    # timeout whenever the generator had run ahead (S >= 2 left ~10 s on every run's clock).
    results.cancel_join_thread()
    return True


def _generator_process_main(*args: Any) -> None:
    """The process target. After a clean stop nothing is left to flush or release (no files; the
    OS frees shared memory with the process), so it exits at once: the interpreter's teardown of
    torch and transformers took ~0.6 s, all on the trainer's clock in ``close``. An error report
    takes the normal exit, whose queue feeder delivers it."""
    signal.signal(signal.SIGINT, _leave_sigint_to_the_trainer)  # the process's main thread
    if run_generator_process(*args):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


class ProcessTransport:
    def __init__(self, make_worker: Callable[[], GeneratorWorker], weights: SharedWeights,
                 num_threads: int = 0, wait_for_handover: bool = False) -> None:
        """``make_worker`` must be picklable (a module-level function or a ``functools.partial`` of one):
        it runs in the new process and builds the engine there. ``wait_for_handover``: the process
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
        self._process = ctx.Process(target=_generator_process_main, name="tether-generator", daemon=True,
                                    args=(make_worker, weights, self._control, self._results, self._stop,
                                          num_threads, wait_for_handover, os.getpid()))
        # Spawned (no process server), the child inherits SIGINT ignored through its imports; a forked one
        # inherits it from the server. Around a forkserver's start (which waits for the server's imports)
        # a Ctrl-C is held back until the child is forked, then stops it: raised mid-start, it left a
        # child that the server forked after this process had gone, which printed a traceback.
        if ctx.get_start_method() == "spawn":
            with _sigint_ignored():
                self._process.start()
        else:
            with _sigint_deferred() as interrupted:
                self._process.start()
            if interrupted:
                self.close()
                raise KeyboardInterrupt

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
