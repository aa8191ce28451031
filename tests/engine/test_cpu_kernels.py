"""``PackedLinear`` (oneDNN-reordered vocabulary projection on CPU) against plain ``F.linear``, alone
and inside the engine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.hf_tiny import make_hf_checkpoint
from helpers.reference import assert_same_completions
from tether.engine import EngineConfig, LLMEngine, SamplingParams
from tether.engine.cpu_kernels import PackedLinear, is_onednn_linear_available, is_worth_packing
from tether.models import load_model

pytestmark = pytest.mark.skipif(
    not is_onednn_linear_available(torch.zeros(1)), reason="this torch build has no oneDNN linear"
)


@pytest.mark.parametrize("num_rows", [1, 2, 7, 64])
def test_packed_linear_equals_linear(num_rows):
    torch.manual_seed(0)
    weight = torch.randn(1000, 48)
    x = torch.randn(num_rows, 48)
    torch.testing.assert_close(PackedLinear()(x, weight), F.linear(x, weight), atol=1e-5, rtol=1e-5)


def _fused_adamw_step(weight: torch.nn.Parameter) -> None:
    weight.grad = torch.ones_like(weight)
    torch.optim.AdamW([weight], lr=0.1, fused=True).step()  # leaves the parameter's version alone


CHANGES = {
    "in-place op": lambda w: w.detach().mul_(-2.0),
    "copy_ through .data": lambda w: w.data.copy_(torch.randn_like(w)),
    "in-place op through .data": lambda w: w.data.mul_(0.5),
    "fused AdamW step": _fused_adamw_step,
    "storage swap": lambda w: setattr(w, "data", torch.randn_like(w)),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_packed_linear_follows_every_kind_of_weight_change(change):
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(300, 32))
    x = torch.randn(5, 32)
    packed = PackedLinear()
    packed(x, weight), packed(x, weight)
    assert packed.num_reorders == 1  # calls alone never reorder again
    with torch.no_grad():
        CHANGES[change](weight)
    torch.testing.assert_close(packed(x, weight), F.linear(x, weight), atol=1e-5, rtol=1e-5)
    assert packed.num_reorders == 2


def test_packed_linear_follows_two_storage_swaps_and_a_new_parameter():
    """A freed storage's address can come back for the next tensor: the copy's source is held."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(300, 32))
    x = torch.randn(5, 32)
    packed = PackedLinear()
    packed(x, weight)
    for _ in range(2):
        weight.data = torch.randn(300, 32)
    torch.testing.assert_close(packed(x, weight), F.linear(x, weight), atol=1e-5, rtol=1e-5)
    other = torch.nn.Parameter(torch.randn(300, 32))  # e.g. model.lm_head.weight = nn.Parameter(...)
    torch.testing.assert_close(packed(x, other), F.linear(x, other), atol=1e-5, rtol=1e-5)


def test_inference_tensors_are_not_packed():
    with torch.inference_mode():
        weight = torch.randn(8, 4)
    assert not is_onednn_linear_available(weight)  # no version counter to follow changes by


def test_only_large_weights_are_worth_packing(monkeypatch):
    monkeypatch.undo()  # the engine tests' conftest packs every head; the default threshold here
    assert not is_worth_packing(torch.zeros(100, 96))  # the demo's head: oneDNN's call overhead loses
    assert is_worth_packing(torch.zeros(32000, 384))


@pytest.mark.parametrize("tie", [False, True])
def test_engine_with_packed_head_matches_the_plain_head(tmp_path, tie):
    path = make_hf_checkpoint(tmp_path / "ckpt", "qwen2", seed=5, tie=tie)
    prompts = [[5, 6, 7, 8, 9], [20, 21], [30, 31, 32, 33, 34, 35, 36, 37]]
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=7, n=3)

    def run(is_packed: bool):
        config = EngineConfig(num_kv_blocks=64, block_size=4, cpu_pack_lm_head=is_packed)
        engine = LLMEngine(load_model(path), config=config)
        assert (engine.runner.packed_lm_head is not None) == is_packed
        return engine.generate(prompts, params)

    assert_same_completions(run(True), run(False), atol=1e-5)
