"""Run directories: every run is self-describing (resolved config, metrics, samples, checkpoints)."""

from __future__ import annotations

import time
from pathlib import Path

from tether.config import ExperimentConfig, save_resolved
from tether.config.loader import is_resolved_config
from tether.errors import ConfigError


def create_run_dir(config: ExperimentConfig, out: str | Path | None = None) -> Path:
    """``out`` if given, else ``<logging.run_root>/<name>-<YYYYmmdd-HHMMSS>/``; saves config.yaml."""
    if out is not None:
        run_dir = Path(out)
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        run_dir = Path(config.logging.run_root) / f"{config.name}-{stamp}"
        suffix = 1
        while run_dir.exists():  # two runs started in the same second keep separate directories
            run_dir = Path(config.logging.run_root) / f"{config.name}-{stamp}-{suffix}"
            suffix += 1
    if run_dir.exists() and (run_dir / "metrics.jsonl").exists():
        raise ConfigError(f"run directory {run_dir} already holds a run (metrics.jsonl); "
                          "choose another --out")
    own_config = run_dir / "config.yaml"
    if own_config.exists() and not is_resolved_config(own_config):  # never overwrite the user's file
        raise ConfigError(f"run directory {run_dir} holds a config.yaml that tether did not write; "
                          "choose another --out")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create run directory {run_dir}: {exc.strerror}") from None
    save_resolved(config, run_dir)
    return run_dir
