"""Every engine test runs with the CPU-packed linears on (``cpu_kernels``): by default an fp32
vocabulary projection is only packed from 8 MB on and fp32 layers' linears only from 256 wide on CPUs
where MKL is slow, which the tests' tiny checkpoints never reach, so the plain MKL path is what the
rest of the suite (rollout, training, demo) runs in fp32 (bf16 models pack by default where oneDNN
has native bf16)."""

import pytest

from tether.engine import cpu_kernels


@pytest.fixture(autouse=True)
def pack_every_linear(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "MIN_PACKED_BYTES", 0)
    monkeypatch.setattr(cpu_kernels, "is_layer_worth_packing", cpu_kernels.is_onednn_linear_available)
