"""Recipes: what `tether train` runs, chosen by ``recipe`` in the config."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tether.config import ExperimentConfig, load_config
from tether.config.loader import refuse_repeated_overrides
from tether.metrics import read_metrics
from tether.runs import create_run_dir, release_run_dir, remove_if_unused


def _recipes() -> dict[str, Callable[[ExperimentConfig, Path], Any]]:
    from tether.recipes.grpo import run_grpo
    from tether.recipes.sft import run_sft

    return {"sft": run_sft, "grpo": run_grpo}


def run_train(config_path: str, overrides: list[str], out: str | None = None) -> Any:
    refuse_repeated_overrides(overrides)  # the user's command line
    config = load_config(config_path, overrides)
    if config.recipe == "grpo":
        from tether.recipes.grpo import start_generator_process_server

        start_generator_process_server(config)  # boots while the model and data are built
    run_dir = create_run_dir(config, out)
    print(f"run directory: {run_dir}", flush=True)
    try:
        result = _recipes()[config.recipe](config, run_dir)
    except BaseException as error:
        if out is None and remove_if_unused(run_dir):  # a failed start leaves no debris beside the runs
            print(f"run directory {run_dir} removed: the run stopped before its first step", flush=True)
        elif isinstance(error, KeyboardInterrupt):  # Ctrl-C, or SIGTERM (the CLI raises one for it)
            print(f"{run_dir}: stopped {_steps_done(run_dir)}; metrics.jsonl and samples.jsonl keep what was "
                  "logged; no checkpoint: final/ is written when a run finishes", file=sys.stderr, flush=True)
        raise
    finally:
        release_run_dir(run_dir)
    print(f"done: {run_dir}", flush=True)
    return result


def _steps_done(run_dir: Path) -> str:
    try:
        steps = [record["step"] for record in read_metrics(run_dir / "metrics.jsonl") if record.get("step")]
    except (OSError, ValueError, TypeError):
        return "early"
    return f"after step {max(steps)}" if steps else "before its first step"
