"""The generator process's side of ``ProcessTransport``: its main loop (control messages, then
weights, then one engine step of ``GeneratorWorker``), its watch on the trainer, and how it takes
Ctrl-C. ``ProcessTransport`` (``local_backend``) starts ``generator_process_main`` in the process.
"""

from __future__ import annotations

import contextlib
import copy
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tether.rollout.generator_worker import GeneratorWorker
from tether.rollout.weights import SharedWeights


def _leave_sigint_to_the_trainer(*_: Any) -> None:
    """The generator process's SIGINT handler: nothing. Ctrl-C reaches the whole process group and the
    trainer stops the generator; a handler (not SIG_IGN) because a caught signal is reset to its
    default across exec, so programs the generator starts (a reward's sandbox, the kernels' compiler)
    still stop on Ctrl-C."""


def _handle(worker: GeneratorWorker, kind: str, payload: Any) -> None:
    if kind == "reissue":
        worker.reissue(payload)
    elif kind == "handover":
        worker.load_state_dict(payload)


_HAS_PROC = Path("/proc/self/stat").is_file()


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
        if _HAS_PROC:  # Linux: a killed trainer its launcher has not collected yet is a zombie, gone all the same
            try:
                stat = Path(f"/proc/{self.pid}/stat").read_text()
                return stat[stat.rindex(")") + 2] in "ZX"  # the state field follows the command's ")"
            except FileNotFoundError:
                return True
            except (OSError, ValueError, IndexError):
                pass  # unreadable: ask the kernel whether the pid exists
        try:
            os.kill(self.pid, 0)  # signal 0: only asks whether the process exists
        except ProcessLookupError:
            return True
        except PermissionError:  # exists, owned by someone else (a reused pid): not ours to judge
            return False
        return False


def exit_when_orphaned(trainer_pid: int, grace_s: float = 1.0) -> None:
    """A daemon thread's loop: once the trainer is gone, exit the process (after ``grace_s``, in
    which the main loop stops on its own when it can). The main thread may be blocked where it
    never checks: a reward that does not return kept an orphaned generator alive for good, holding
    its launcher's output pipe and its semaphores."""
    watch = TrainerWatch(trainer_pid)
    while not watch.is_gone():
        time.sleep(TrainerWatch.CHECK_S)
    time.sleep(grace_s)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


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
    if trainer_pid > 0:
        threading.Thread(target=exit_when_orphaned, args=(trainer_pid,), name="tether-trainer-watch",
                         daemon=True).start()
    if num_threads > 0:
        torch.set_num_threads(num_threads)
    try:
        worker = make_worker()
        if weights.acked_version < 0:  # its worker holds version 0 (read from the buckets, or its own copy)
            weights.ack(0)
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


def generator_process_main(*args: Any) -> None:
    """The process target. After a clean stop nothing is left to flush or release (no files; the
    OS frees shared memory with the process), so it exits at once: the interpreter's teardown of
    torch and transformers took ~0.6 s, all on the trainer's clock in ``close``. An error report
    takes the normal exit, whose queue feeder delivers it."""
    signal.signal(signal.SIGINT, _leave_sigint_to_the_trainer)  # the process's main thread
    if run_generator_process(*args):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
