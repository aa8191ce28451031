"""Run directories: every run is self-describing (resolved config, what ran it, metrics, samples,
checkpoints)."""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: runs are not locked against one another
    fcntl = None  # type: ignore[assignment]

from tether.config import ExperimentConfig, save_resolved
from tether.config.loader import is_resolved_config
from tether.errors import ConfigError

GENERATOR_ERROR_LOG = "generator_error.log"  # a crashed generator process's traceback (recipes.grpo)
RUN_INFO = "run.json"  # what ran the run: versions, command, machine, start time (``run_info``)
_LOCK_NAME = ".tether.lock"
# What a run that failed before its first step leaves: ``--out`` may be reused while that is all.
# These files may hold something (the next run rewrites them); metrics and samples must be empty.
_KEPT_WHOLE = ("config.yaml", RUN_INFO, _LOCK_NAME, GENERATOR_ERROR_LOG)
_REUSABLE = (*_KEPT_WHOLE, "metrics.jsonl", "samples.jsonl")


def new_run_path(run_root: str | Path, name: str) -> Path:
    """``<run_root>/<name>-<YYYYmmdd-HHMMSS>/``, suffixed ``-1``, ``-2``, ... when that exists. Not
    created: ``claim_new_run_dir`` claims the name by creating it, and takes the next suffix when
    another run created it first (two runs started in the same second keep separate directories)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(run_root) / f"{name}-{stamp}"
    suffix = 1
    while run_dir.exists():
        run_dir = Path(run_root) / f"{name}-{stamp}-{suffix}"
        suffix += 1
    return run_dir


def claim_new_run_dir(run_root: str | Path, name: str) -> Path:
    """Creates ``new_run_path`` (exclusively: another run that created that name first makes this one
    take the next suffix) and returns it."""
    run_dir = new_run_path(run_root, name)
    while not _mkdir(run_dir, exist_ok=False):
        run_dir = new_run_path(run_root, name)
    return run_dir


def create_run_dir(config: ExperimentConfig, out: str | Path | None = None) -> Path:
    """``out`` if given, else ``new_run_path``; claims it for this process and saves config.yaml.

    An existing ``out`` must hold nothing but what a run of tether's that failed before its first
    step leaves (its config.yaml, empty metrics and samples, its lock file, a generator's error log),
    and no live run may hold it: a run holds an exclusive lock on ``<run_dir>/.tether.lock`` until its process ends
    (``release_run_dir`` lets go earlier), so a second run given the same ``--out`` while the first
    is still starting is refused. No one's files are written over."""
    if out is not None:
        run_dir = Path(out)
        if run_dir.exists():
            if not run_dir.is_dir():
                raise ConfigError(f"run directory {run_dir} is a file; choose another --out")
            _check_reusable(run_dir)  # before anything is written into it
        _mkdir(run_dir, exist_ok=True)
    else:
        run_dir = claim_new_run_dir(config.logging.run_root, config.name)
    _lock(run_dir)
    try:
        _check_reusable(run_dir)  # again under the lock: a run that took it meanwhile has finished
        (run_dir / GENERATOR_ERROR_LOG).unlink(missing_ok=True)  # the failed attempt's, not this run's
        save_resolved(config, run_dir)
        (run_dir / RUN_INFO).write_text(json.dumps(run_info(), indent=1) + "\n")
    except BaseException:
        release_run_dir(run_dir)
        raise
    return run_dir


def run_info() -> dict[str, object]:
    """What runs this process, for ``run.json``: the versions that move results (the README's
    accuracies move with the torch version and the CPU), the command, the machine, the start."""
    def version(package: str) -> str | None:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None

    return {"started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": sys.argv,
            "versions": {name: version(name) for name in ("tether", "torch", "transformers", "tokenizers",
                                                          "safetensors", "pydantic")},
            "python": platform.python_version(), "platform": platform.platform(),
            "machine": platform.machine(), "processor": _cpu_name(), "num_cpus": os.cpu_count()}


def _cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` says."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                        platform.processor())
    except OSError:
        return platform.processor()


def remove_if_unused(run_dir: Path) -> bool:
    """Remove a run directory that holds only what its start wrote (config.yaml, run.json, the lock,
    empty metrics and samples): a run that failed before its first step, on the default path, would
    leave one per attempt beside the real runs. Anything else (a generator's error log) keeps it."""
    try:
        if _not_reusable(run_dir) or (run_dir / GENERATOR_ERROR_LOG).exists():
            return False
    except OSError:  # the directory went (deleted mid-run): the run's own error says so
        return False
    release_run_dir(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    return True


def release_run_dir(run_dir: str | Path) -> None:
    """Lets go of the lock ``create_run_dir`` took (a process's end lets go of it too)."""
    fd = _LOCKS.pop(Path(run_dir).resolve(), None)
    if fd is not None:
        os.close(fd)


_LOCKS: dict[Path, int] = {}  # run directory -> the open lock file's descriptor, for this process's life


def _mkdir(run_dir: Path, *, exist_ok: bool) -> bool:
    """Creates ``run_dir`` (and its parents); False when it exists and ``exist_ok`` is False."""
    try:
        run_dir.mkdir(parents=True, exist_ok=exist_ok)
    except FileExistsError:
        if exist_ok:  # a file in the way of a parent
            raise ConfigError(f"cannot create run directory {run_dir}: a path on the way is a file") from None
        return False
    except OSError as exc:
        raise ConfigError(f"cannot create run directory {run_dir}: {exc.strerror}") from None
    return True


def _lock(run_dir: Path) -> None:
    """An exclusive, non-blocking ``flock`` on the run directory's lock file, held while the process
    lives (or until ``release_run_dir``); the lock file names the holder's pid for the error."""
    key = run_dir.resolve()
    if key in _LOCKS:
        raise ConfigError(f"run directory {run_dir} is in use by this process's run; choose another --out")
    try:
        fd = os.open(run_dir / _LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ConfigError(f"cannot create run directory {run_dir}: {exc.strerror}") from None
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ConfigError(f"run directory {run_dir} is in use by a running tether process (pid {holder}); "
                              "choose another --out") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _LOCKS[key] = fd


def _not_reusable(run_dir: Path) -> list[str]:
    """The entries of ``run_dir`` beyond what a run that failed before its first step leaves."""
    return sorted(entry.name for entry in run_dir.iterdir()
                  if entry.name not in _REUSABLE or not entry.is_file()
                  or (entry.name not in _KEPT_WHOLE and entry.stat().st_size > 0))


def _check_reusable(run_dir: Path) -> None:
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists() and metrics.stat().st_size > 0:
        raise ConfigError(f"run directory {run_dir} already holds a run (metrics.jsonl); choose another --out")
    own_config = run_dir / "config.yaml"
    if own_config.exists() and not is_resolved_config(own_config):  # never overwrite the user's file
        raise ConfigError(f"run directory {run_dir} holds a config.yaml that tether did not write; "
                          "choose another --out")
    if others := _not_reusable(run_dir):
        more = f" and {len(others) - 1} more" if len(others) > 1 else ""
        raise ConfigError(f"run directory {run_dir} is not empty (holds {others[0]!r}{more}); "
                          "choose another --out")
