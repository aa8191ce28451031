"""Run directories: every run is self-describing (resolved config, metrics, samples, checkpoints)."""

from __future__ import annotations

import time
from pathlib import Path

from tether.config import ExperimentConfig, save_resolved
from tether.config.loader import is_resolved_config
from tether.errors import ConfigError

# What a run that failed before its first step leaves: ``--out`` may be reused while that is all.
_REUSABLE = ("config.yaml", "metrics.jsonl", "samples.jsonl")


def new_run_path(run_root: str | Path, name: str) -> Path:
    """``<run_root>/<name>-<YYYYmmdd-HHMMSS>/``, suffixed ``-1``, ``-2``, ... when that exists (two runs
    started in the same second keep separate directories). Not created."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(run_root) / f"{name}-{stamp}"
    suffix = 1
    while run_dir.exists():
        run_dir = Path(run_root) / f"{name}-{stamp}-{suffix}"
        suffix += 1
    return run_dir


def create_run_dir(config: ExperimentConfig, out: str | Path | None = None) -> Path:
    """``out`` if given, else ``new_run_path``; saves config.yaml. An existing ``out`` must hold
    nothing but what a run of tether's that failed before its first step leaves (its config.yaml,
    empty metrics and samples): no one's files are written over."""
    run_dir = Path(out) if out is not None else new_run_path(config.logging.run_root, config.name)
    if run_dir.exists():
        _check_reusable(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create run directory {run_dir}: {exc.strerror}") from None
    save_resolved(config, run_dir)
    return run_dir


def _check_reusable(run_dir: Path) -> None:
    if not run_dir.is_dir():
        raise ConfigError(f"run directory {run_dir} is a file; choose another --out")
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists() and metrics.stat().st_size > 0:
        raise ConfigError(f"run directory {run_dir} already holds a run (metrics.jsonl); choose another --out")
    own_config = run_dir / "config.yaml"
    if own_config.exists() and not is_resolved_config(own_config):  # never overwrite the user's file
        raise ConfigError(f"run directory {run_dir} holds a config.yaml that tether did not write; "
                          "choose another --out")
    others = sorted(entry.name for entry in run_dir.iterdir()
                    if entry.name not in _REUSABLE or not entry.is_file()
                    or (entry.name != "config.yaml" and entry.stat().st_size > 0))
    if others:
        more = f" and {len(others) - 1} more" if len(others) > 1 else ""
        raise ConfigError(f"run directory {run_dir} is not empty (holds {others[0]!r}{more}); "
                          "choose another --out")
