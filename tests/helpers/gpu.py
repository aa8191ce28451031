"""Tests that need a real CUDA device: marked ``gpu`` and skipped where torch sees none (CI).
``pytest -m gpu`` runs them all on a GPU machine (``bench/device_check.sh``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")]


def on_gpu(test: Callable) -> Callable:
    """Decorator: ``GPU``'s marks on a test function."""
    for mark in GPU:
        test = mark(test)
    return test
