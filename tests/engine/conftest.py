"""Every engine test runs with the CPU-packed linears on (``cpu_kernels``): by default the vocabulary
projection is only packed from 8 MB on and the layers' linears only from 256 wide on CPUs where MKL is
slow, which the tests' tiny checkpoints never reach; the plain MKL path is what the rest of the suite
(rollout, training, demo) runs."""

import pytest

from tether.engine import cpu_kernels


@pytest.fixture(autouse=True)
def pack_every_linear(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "MIN_PACKED_BYTES", 0)
    monkeypatch.setattr(cpu_kernels, "is_layer_worth_packing", cpu_kernels.is_onednn_linear_available)
