"""Shared settings of the rollout tests (a module, not conftest: spawned processes import it too)."""

from __future__ import annotations

from pathlib import Path

from tether.config import ExperimentConfig, load_config

REWARDS = Path(__file__).parent / "reward_fns.py"

TINY = [
    "model.scratch.hidden_size=32", "model.scratch.intermediate_size=64", "model.scratch.num_layers=1",
    "model.scratch.num_heads=2", "model.scratch.num_kv_heads=1", "model.scratch.max_position_embeddings=64",
    "rollout.group_size=4", "rollout.prompts_per_step=3", "rollout.max_new_tokens=5",
    "engine.kv_cache_bytes=2000000", "logging.progress=none", "trainer.lr=1e-2",
]


def tiny_config(*overrides: str, reward: str = "count_digits") -> ExperimentConfig:
    # the built-in task's size; a data file is read whole (data.num_train with one is refused)
    task_size = [] if any(o.startswith("data.train=") for o in overrides) else ["data.num_train=64"]
    return load_config(None, [*TINY, *task_size, f"rewards=[{{fn: '{REWARDS}:{reward}'}}]", *overrides])


