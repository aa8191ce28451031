"""A tiny random policy and the rollout roles built around it, in-process."""

from __future__ import annotations

import pytest
from rollout_helpers import tiny_config

from tether.builders import build_model_and_tokenizer


@pytest.fixture(scope="module")
def tiny_policy():
    """(model, tokenizer), built once per module; tests that train deep-copy the model."""
    return build_model_and_tokenizer(tiny_config().model, None, seed=0)
