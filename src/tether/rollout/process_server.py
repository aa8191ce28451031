"""The process server generator processes fork from, and how they take Ctrl-C at start.

A spawned interpreter pays its imports (torch ~2.5 s, transformers ~1 s to unpickle a tokenizer on a
small machine) before it builds its engine. Where the platform has it (Linux, macOS), generator
processes are forked from a *process server* instead (multiprocessing's forkserver): a fresh
interpreter that imports the generator's modules once (``start_process_server``) and forks a child
per generator, which starts with them already imported. It never ran torch ops, so no OpenMP pool is
forked half-alive. Callers that know an asynchronous run is coming start the server early (``tether
train``, ``tether demo``, the benchmarks), so its imports overlap their own set-up;
``ProcessTransport`` starts it on demand otherwise. Elsewhere the context is spawn.
"""

from __future__ import annotations

import contextlib
import multiprocessing.forkserver
import signal
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch.multiprocessing as mp

# What a generator process needs imported (``GeneratorWorker`` and the process's loop); the recipe
# that builds the worker adds its own modules (``start_process_server``).
BASE_PRELOAD = ("tether.rollout.generator_process",)


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
    with sigint_ignored():  # the server, and every generator forked from it, leave Ctrl-C to the trainer
        multiprocessing.forkserver.ensure_running()
    if wait:
        probe = context.Process(target=_do_nothing, name="tether-server-probe")
        probe.start()  # forked once the server has imported
        probe.join()
    return True


def _do_nothing() -> None:
    pass


@contextlib.contextmanager
def sigint_deferred() -> Iterator[list[bool]]:
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
def sigint_ignored() -> Iterator[None]:
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
