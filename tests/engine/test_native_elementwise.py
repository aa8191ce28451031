"""The compiled elementwise kernels (``csrc/elementwise.cpp``): the MLPs' ``silu(gate) * up`` and the
plain sampler's weights, against the torch ops they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.native import built_kernels, needs_toolchain
from tether.engine import native
from tether.engine.rng import SampleRNG
from tether.engine.sampler import _CDF_CHUNK, Sampler, _weights
from tether.engine.types import SamplingParams

pytestmark = needs_toolchain


@pytest.fixture(scope="module")
def kernels():
    return built_kernels()


def test_silu_mul_is_silus_product_with_the_same_bits_at_every_offset(kernels):
    generator = torch.Generator().manual_seed(0)
    gate, up = torch.randn(1037, generator=generator) * 6, torch.randn(1037, generator=generator)
    with torch.inference_mode():
        full = kernels.silu_mul(gate, up)
        exact = (gate.double() * torch.sigmoid(gate.double()) * up.double()).float()
        torch.testing.assert_close(full, exact, atol=1e-30, rtol=1e-6)
        torch.testing.assert_close(full, F.silu(gate) * up, atol=1e-30, rtol=1e-6)
        # Each element alone, and in slices of any length and offset: the same bits (batch invariance)
        alone = torch.cat([kernels.silu_mul(gate[i : i + 1].clone(), up[i : i + 1].clone()) for i in range(1037)])
        assert torch.equal(alone, full)
        for start, end in [(3, 20), (13, 1037), (8, 1032)]:
            assert torch.equal(kernels.silu_mul(gate[start:end].clone(), up[start:end].clone()), full[start:end])
        # A 2-d batch is its rows
        rows = kernels.silu_mul(gate[:1024].view(8, 128).contiguous(), up[:1024].view(8, 128).contiguous())
        assert torch.equal(rows.view(-1), full[:1024])
        nan = kernels.silu_mul(torch.tensor([float("nan"), 80.0, -80.0, 0.0]), torch.ones(4))
        assert nan[0].isnan() and nan[1] == 80.0 and -1e-30 < nan[2] <= 0 and nan[3] == 0
    assert native.is_silu_mul_invariant(kernels.silu_mul)
    with pytest.raises(RuntimeError, match="contiguous fp32 CPU"):
        kernels.silu_mul(gate.double(), up.double())


def test_sampling_weights_are_the_torch_passes(kernels):
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 32001, generator=generator) * 3  # a short last chunk
    for temperature in (1.0, 0.6):
        expected_weights, expected_sums = _weights(logits.clone(), temperature, is_owned=True)
        weights = logits.clone()
        sums = kernels.sampling_weights(weights, temperature, _CDF_CHUNK)
        torch.testing.assert_close(weights, expected_weights, atol=1e-30, rtol=1e-6)
        torch.testing.assert_close(sums, expected_sums, atol=0, rtol=1e-5)
        assert weights.amax(dim=-1).eq(1).all()  # the maximum's weight is exactly 1
    # A -inf logit weighs nothing; a NaN or +inf one, or a row of -inf, makes its row NaN (the engine
    # then fails that request alone), as the torch passes do.
    odd = logits[:4].clone()
    odd[0, 5], odd[1, 7], odd[2, 9], odd[3] = float("-inf"), float("nan"), float("inf"), float("-inf")
    sums = kernels.sampling_weights(odd, 1.0, _CDF_CHUNK)
    assert odd[0, 5] == 0 and sums[0].isfinite().all()
    assert sums[1:].isnan().any(dim=-1).all()


def test_the_sampler_draws_the_same_tokens_through_the_kernel(kernels):
    """The compiled passes round the exponential unlike torch's (~1 ulp), so a uniform within that of a
    CDF boundary may pick the neighbour: nearly every draw agrees, and the log-probs to ~1e-6."""
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(512, 32000, generator=generator) * 3
    params = [SamplingParams(temperature=0.8)] * 512
    by_torch = Sampler().sample(logits.clone(), params, [SampleRNG(s) for s in range(512)])
    by_kernel = Sampler(kernels.sampling_weights).sample(logits.clone(), params, [SampleRNG(s) for s in range(512)])
    same = [i for i in range(512) if by_torch.token_ids[i] == by_kernel.token_ids[i]]
    assert len(same) >= 508
    torch.testing.assert_close(torch.tensor([by_kernel.logprobs[i] for i in same]),
                               torch.tensor([by_torch.logprobs[i] for i in same]), atol=2e-6, rtol=0)
    # The caller's logits are left alone unless given away
    kept = logits[:4].clone()
    Sampler(kernels.sampling_weights).sample(kept, params[:4], [SampleRNG(s) for s in range(4)])
    assert torch.equal(kept, logits[:4])


def test_the_mlps_take_the_kernel_only_inside_a_step_and_without_gradients(kernels):
    from tether.engine.runner import _silu_mul_hook, _silu_mul_swapped
    from tether.models.config import ModelConfig
    from tether.models.decoder import MLP

    config = ModelConfig.from_hf({"model_type": "qwen2", "vocab_size": 50, "hidden_size": 16, "intermediate_size": 40,
                                  "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1})
    mlp = MLP(config)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(3))
    plain = mlp(x)
    with _silu_mul_swapped([mlp], _silu_mul_hook(kernels.silu_mul)):
        with torch.inference_mode():
            served = mlp(x)  # the engine's step: the kernel
        trained = mlp(x)  # a forward that records gradients meanwhile (another thread): F.silu
    torch.testing.assert_close(served, plain, atol=1e-6, rtol=1e-5)
    assert torch.equal(trained, plain) and trained.grad_fn is not None
    assert "_silu_mul" not in mlp.__dict__  # gone after the step
