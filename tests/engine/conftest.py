"""Every engine test runs with the CPU-packed vocabulary projection on (``cpu_kernels``), which by
default only serves projections of 8 MB or more, far larger than the tests' tiny checkpoints; the
plain MKL path is what the rest of the suite (rollout, training, demo) runs."""

import pytest

from tether.engine import cpu_kernels


@pytest.fixture(autouse=True)
def pack_every_lm_head(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "MIN_PACKED_BYTES", 0)
