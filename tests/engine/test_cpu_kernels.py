"""``PackedLinear`` (oneDNN-reordered vocabulary projection on CPU) against plain ``F.linear``, alone
and inside the engine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.hf_tiny import make_hf_checkpoint
from helpers.reference import assert_same_completions
from tether.engine import EngineConfig, LLMEngine, SamplingParams, cpu_kernels
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
    torch.testing.assert_close(PackedLinear(weight)(x), F.linear(x, weight), atol=1e-5, rtol=1e-5)


def test_packed_linear_follows_in_place_changes_and_reorders_only_then():
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(300, 32))
    x = torch.randn(5, 32)
    packed = PackedLinear(weight)
    packed(x), packed(x)
    assert packed.num_reorders == 1  # calls alone never reorder again
    with torch.no_grad():
        weight.mul_(-2.0)  # an optimizer step, update_weights' copy_: the version counter moves
    torch.testing.assert_close(packed(x), F.linear(x, weight), atol=1e-5, rtol=1e-5)
    weight.data = torch.randn(300, 32)  # a storage swap keeps the version but not the pointer
    torch.testing.assert_close(packed(x), F.linear(x, weight), atol=1e-5, rtol=1e-5)
    assert packed.num_reorders == 3


def test_inference_tensors_are_not_packed():
    with torch.inference_mode():
        weight = torch.randn(8, 4)
    assert not is_onednn_linear_available(weight)  # no version counter to follow changes by


def test_only_large_weights_are_worth_packing():
    assert not is_worth_packing(torch.zeros(100, 96))  # the demo's head: oneDNN's call overhead loses
    assert is_worth_packing(torch.zeros(32000, 384))


@pytest.mark.parametrize("tie", [False, True])
def test_engine_with_packed_head_matches_the_plain_head(tmp_path, tie, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "MIN_PACKED_BYTES", 0)  # pack the tiny test head too
    path = make_hf_checkpoint(tmp_path / "ckpt", "qwen2", seed=5, tie=tie)
    prompts = [[5, 6, 7, 8, 9], [20, 21], [30, 31, 32, 33, 34, 35, 36, 37]]
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=7, n=3)

    def run(is_packed: bool):
        config = EngineConfig(num_kv_blocks=64, block_size=4, cpu_pack_lm_head=is_packed)
        engine = LLMEngine(load_model(path), config=config)
        assert (engine.runner.packed_lm_head is not None) == is_packed
        return engine.generate(prompts, params)

    assert_same_completions(run(True), run(False), atol=1e-5)
