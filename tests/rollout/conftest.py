"""A tiny random policy and the rollout roles built around it, in-process."""

from __future__ import annotations

from pathlib import Path

import pytest

from tether.builders import build_model_and_tokenizer
from tether.config import ExperimentConfig, load_config

REWARDS = Path(__file__).parent / "reward_fns.py"

TINY = [
    "model.scratch.hidden_size=32", "model.scratch.intermediate_size=64", "model.scratch.num_layers=1",
    "model.scratch.num_heads=2", "model.scratch.num_kv_heads=1", "model.scratch.max_position_embeddings=64",
    "rollout.group_size=4", "rollout.prompts_per_step=3", "rollout.max_new_tokens=5", "data.num_train=64",
    "engine.kv_cache_bytes=2000000", "logging.progress=none", "trainer.lr=1e-2",
]


def tiny_config(*overrides: str, reward: str = "count_digits") -> ExperimentConfig:
    return load_config(None, [*TINY, f"rewards=[{{fn: '{REWARDS}:{reward}'}}]", *overrides])


@pytest.fixture(scope="module")
def tiny_policy():
    """(model, tokenizer), built once per module; tests that train deep-copy the model."""
    return build_model_and_tokenizer(tiny_config().model, None, seed=0)
