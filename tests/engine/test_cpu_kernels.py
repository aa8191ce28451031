"""``PackedLinear`` / ``PackedWeights`` (oneDNN-reordered linear weights on CPU) against plain
``nn.Linear``, alone and inside the engine."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers.hf_tiny import make_hf_checkpoint
from helpers.reference import assert_same_completions
from tether.engine import EngineConfig, LLMEngine, SamplingParams, cpu_kernels
from tether.engine.cpu_kernels import (
    PackedLinear,
    PackedWeights,
    is_onednn_bf16_available,
    is_onednn_linear_available,
    is_worth_packing,
    pack_linears,
)
from tether.errors import ConfigError
from tether.models import load_model

pytestmark = pytest.mark.skipif(
    not is_onednn_linear_available(torch.zeros(8, 8)), reason="this torch build has no oneDNN linear"
)


class TwoLinears(nn.Module):
    """A stand-in decoder: a layer linear with a bias, then a bias-free vocabulary projection."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 48)
        self.lm_head = nn.Linear(48, 300, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.proj(x)))


needs_bf16 = pytest.mark.skipif(not is_onednn_bf16_available(), reason="oneDNN has no bf16 kernels for this CPU")
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16)]


def packed_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[TwoLinears, PackedWeights]:
    torch.manual_seed(seed)
    model = TwoLinears().to(dtype)
    return model, pack_linears(model, is_lm_head_packed=True, layer_mode="always")


def plain_forward(model: TwoLinears, x: torch.Tensor) -> torch.Tensor:
    return F.linear(torch.tanh(F.linear(x, model.proj.weight, model.proj.bias)), model.lm_head.weight)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [1, 2, 7, 64])
def test_packed_linears_equal_linear(num_rows, dtype):
    model, packed = packed_model(dtype=dtype)
    assert isinstance(model.proj, PackedLinear) and isinstance(model.lm_head, PackedLinear)
    assert len(packed) == 2
    x = torch.randn(3, num_rows, 32, dtype=dtype)  # leading dims are kept
    with torch.inference_mode(), packed.serving():
        out = model(x)
    assert out.dtype == dtype
    # bf16: the same bf16 products with fp32 accumulation; a rounding apart at most
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, plain_forward(model, x), atol=tol, rtol=tol)
    assert packed.num_reorders == 2
    if dtype == torch.bfloat16:  # a bf16 head multiplies its packed copy even for one row
        assert model.lm_head.__dict__["min_rows"] == 1


@needs_bf16
@pytest.mark.parametrize("change", ["copy_ through .data", "in-place op through .data", "in-place op"])
def test_bf16_packed_weights_follow_changes_without_a_version_bump(change):
    """bf16 weights are sampled as 16-bit patterns: a change no version counter shows is still found."""
    model, packed = packed_model(dtype=torch.bfloat16)
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    with torch.inference_mode(), packed.serving():
        model(x)
    with torch.no_grad():
        CHANGES[change](model.lm_head.weight)
    with torch.inference_mode(), packed.serving():
        out = model(x)
    torch.testing.assert_close(out, plain_forward(model, x), atol=1e-2, rtol=1e-2)
    assert packed.num_reorders == 3


def test_packed_linear_is_plain_linear_outside_serving():
    """Training and any forward outside an engine step use the parameters themselves: gradients flow."""
    model, packed = packed_model()
    with torch.inference_mode(), packed.serving():
        model(torch.randn(4, 32))
    x = torch.randn(4, 32)
    model(x).sum().backward()
    assert model.proj.weight.grad is not None and model.lm_head.weight.grad is not None
    assert [name for name, _ in model.named_parameters()] == ["proj.weight", "proj.bias", "lm_head.weight"]


def test_a_forward_recording_gradients_during_a_step_multiplies_the_parameters():
    model, packed = packed_model()
    x = torch.randn(4, 32)
    with packed.serving():  # e.g. a trainer thread on the same model while the engine steps
        model(x).sum().backward()
    assert model.proj.weight.grad is not None and model.lm_head.weight.grad is not None


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


@pytest.mark.parametrize("which", ["proj", "lm_head"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_packed_weights_follow_every_kind_of_weight_change(change, which):
    model, packed = packed_model()
    x = torch.randn(5, 32)
    for _ in range(2):
        with torch.inference_mode(), packed.serving():
            model(x)
    assert packed.num_reorders == 2  # steps alone never reorder again
    with torch.no_grad():
        CHANGES[change](getattr(model, which).weight)
    with torch.inference_mode(), packed.serving():
        out = model(x)
    torch.testing.assert_close(out, plain_forward(model, x), atol=1e-5, rtol=1e-5)
    assert packed.num_reorders == 3  # only the changed weight


def test_packed_weights_follow_two_storage_swaps_and_a_new_parameter():
    """A freed storage's address can come back for the next tensor: the copy's source is held."""
    model, packed = packed_model()
    x = torch.randn(5, 32)
    with torch.inference_mode(), packed.serving():
        model(x)
    for _ in range(2):
        model.lm_head.weight.data = torch.randn(300, 48)
    model.proj.weight = nn.Parameter(torch.randn(48, 32))  # e.g. a checkpoint loaded by assignment
    with torch.inference_mode(), packed.serving():
        out = model(x)
    torch.testing.assert_close(out, plain_forward(model, x), atol=1e-5, rtol=1e-5)


def test_nan_weights_are_packed_once():
    """Change detection compares bits: NaN entries equal themselves, so no reorder every step."""
    model, packed = packed_model()
    with torch.no_grad():
        model.proj.weight[0, 0] = float("nan")
    for _ in range(3):
        with torch.inference_mode(), packed.serving():
            model(torch.randn(2, 32))
    assert packed.num_reorders == 2


def test_a_packed_model_copies_and_pickles_without_its_copies():
    model, packed = packed_model()
    with packed.serving():  # while the modules hold their copies
        with torch.inference_mode():
            model(torch.randn(2, 32))
        clone = copy.deepcopy(model)
        buffer = io.BytesIO()
        torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.randn(3, 32)
    for other in (clone, loaded):
        torch.testing.assert_close(other(x), model(x))  # plain nn.Linear: no engine serves them


def test_pack_linears_modes():
    torch.manual_seed(0)
    model = TwoLinears()
    assert len(pack_linears(model, is_lm_head_packed=False, layer_mode="never")) == 0
    assert type(model.proj) is nn.Linear and type(model.lm_head) is nn.Linear
    assert len(pack_linears(model, is_lm_head_packed=False, layer_mode="always")) == 1  # the layer only
    assert isinstance(model.proj, PackedLinear) and type(model.lm_head) is nn.Linear
    # A second engine on the same model packs the same modules again, with copies of its own.
    again = pack_linears(model, is_lm_head_packed=True, layer_mode="always")
    assert len(again) == 2 and isinstance(model.lm_head, PackedLinear)


def test_packing_keeps_the_module_its_hooks_and_mode():
    """The switch happens in place: references, hooks and train/eval mode survive, outside a step too."""
    torch.manual_seed(0)
    model = TwoLinears().eval()
    proj, calls = model.proj, []
    proj.register_forward_hook(lambda module, args, out: calls.append(out.shape))
    packed = pack_linears(model, is_lm_head_packed=True, layer_mode="always")
    assert model.proj is proj and not proj.training and len(packed) == 2
    x = torch.randn(2, 32)
    before = plain_forward(model, x)
    with torch.inference_mode(), packed.serving():
        torch.testing.assert_close(model(x), before, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model(x), before)
    assert len(calls) == 2  # the hook ran in the step and outside it


class ScaledLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2.0 * super().forward(x)


def test_linear_subclasses_keep_their_own_forward():
    torch.manual_seed(0)
    model = nn.Sequential(ScaledLinear(32, 48))
    assert len(pack_linears(model, is_lm_head_packed=True, layer_mode="always")) == 0
    assert type(model[0]) is ScaledLinear


def test_partial_row_changes_are_sampled_in_many_rows():
    """The sampled entries fall in distinct rows, whatever the shape: a write through ``.data`` to a
    few rows (no version bump) is seen when it touches a sampled row, which a stride dividing the
    row length missed for all but a handful of rows."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 300))
    model[0].weight.data = model[0].weight.data.t().contiguous().t()  # the engine's CPU layout
    packed = pack_linears(model, is_lm_head_packed=False, layer_mode="always")
    x = torch.randn(4, 48)
    with torch.inference_mode(), packed.serving():
        model(x)
    sample = cpu_kernels._sample(model[0].weight)  # a view of the [48, 300] storage of W^T
    sampled_rows = {(sample.storage_offset() + i * sample.stride(0)) % 300 for i in range(64)}
    assert len(sampled_rows) == 64
    row = sorted(sampled_rows)[10]
    with torch.no_grad():
        model[0].weight.data[row] = 0.0
    with torch.inference_mode(), packed.serving():
        out = model(x)
    torch.testing.assert_close(out, F.linear(x, model[0].weight, model[0].bias), atol=1e-5, rtol=1e-5)


def test_a_weight_swapped_for_one_onednn_cannot_serve_goes_plain():
    model, packed = packed_model()
    with torch.inference_mode(), packed.serving():
        model(torch.randn(2, 32))
    model.proj.weight.data = torch.randn(96, 32)[::2]  # a strided view: no storage-span sampling
    x = torch.randn(2, 32)
    with torch.inference_mode(), packed.serving():
        out = model(x)
    torch.testing.assert_close(out, plain_forward(model, x), atol=1e-5, rtol=1e-5)


def test_auto_packs_wide_layers_only_where_mkl_is_slow(monkeypatch):
    monkeypatch.undo()  # the engine tests' conftest packs every linear
    wide, narrow = torch.zeros(1536, 384), torch.zeros(128, 384)
    monkeypatch.setattr(cpu_kernels, "cpu_vendor", lambda: "AuthenticAMD")
    assert cpu_kernels.is_layer_worth_packing(wide) and not cpu_kernels.is_layer_worth_packing(narrow)
    assert cpu_kernels.choose_decode_layout() is False  # [C, D] keys
    monkeypatch.setattr(cpu_kernels, "cpu_vendor", lambda: "GenuineIntel")
    assert not cpu_kernels.is_layer_worth_packing(wide)
    assert cpu_kernels.choose_decode_layout() is True


def test_inference_tensors_are_not_packed():
    with torch.inference_mode():
        weight = torch.randn(8, 8)
    assert not is_onednn_linear_available(weight)  # no version counter to follow changes by


def test_only_large_heads_are_worth_packing(monkeypatch):
    monkeypatch.undo()  # the engine tests' conftest packs every head; the default threshold here
    assert not is_worth_packing(torch.zeros(100, 96))  # the demo's head: oneDNN's call overhead loses
    assert is_worth_packing(torch.zeros(32000, 384))


@needs_bf16
def test_auto_packs_every_bf16_linear(monkeypatch):
    """A plain bf16 linear is oneDNN's too (reordering its weight every call): every one is packed."""
    monkeypatch.undo()
    monkeypatch.setattr(cpu_kernels, "cpu_vendor", lambda: "GenuineIntel")  # not decided by MKL's speed
    assert is_worth_packing(torch.zeros(100, 96, dtype=torch.bfloat16))
    assert cpu_kernels.is_layer_worth_packing(torch.zeros(128, 96, dtype=torch.bfloat16))
    assert not is_onednn_linear_available(torch.zeros(8, 8, dtype=torch.float16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tie", [False, True])
def test_engine_with_packed_linears_matches_plain_linears(tmp_path, tie, dtype):
    path = make_hf_checkpoint(tmp_path / "ckpt", "qwen2", seed=5, tie=tie)
    prompts = [[5, 6, 7, 8, 9], [20, 21], [30, 31, 32, 33, 34, 35, 36, 37]]
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=7, n=3)

    def run(is_packed: bool):
        mode = "always" if is_packed else "never"
        config = EngineConfig(num_kv_blocks=64, block_size=4, cpu_pack_lm_head=is_packed, cpu_pack_linears=mode,
                              batch_invariant=False)  # which linears are packed is the invariant path's choice
        engine = LLMEngine(load_model(path).to(dtype), config=config)
        num_linears = sum(isinstance(m, nn.Linear) for m in engine.model.modules())
        assert len(engine.runner.packed) == (num_linears if is_packed else 0)
        return engine.generate(prompts, params)

    # bf16: the same products (identical bits but for rare single roundings), a rounding apart
    assert_same_completions(run(True), run(False), atol=1e-5 if dtype == torch.float32 else 2e-2)


def test_a_bad_pack_mode_is_a_config_error():
    with pytest.raises(ConfigError, match="engine.cpu_pack_linears must be one of"):
        EngineConfig(cpu_pack_linears="sometimes")
