"""The optimizer tether builds: AdamW with decay on matrices only, whichever kernel it picked."""

from __future__ import annotations

import copy

import pytest
import torch

from tether.training.optim import build_optimizer, build_scheduler, clip_and_norm, clipped_step


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(32, 48)), torch.nn.Parameter(torch.randn(48)),
            torch.nn.Parameter(torch.randn(48, 16))]


def _train(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int,
           one_sign: bool = False) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            grad = torch.randn(p.shape, generator=g) * 1e-2
            p.grad = (grad.abs() if one_sign else grad).to(p.dtype)
        optimizer.step()


def test_build_optimizer_matches_reference_adamw_over_many_steps() -> None:
    # Reference: the single-tensor (for-loop) AdamW, decay on the matrices, none on the vector.
    ours, ref = _params(), _params()
    _train(build_optimizer(ours, lr=3e-3, weight_decay=0.1), ours, 100)
    groups = [{"params": [ref[0], ref[2]], "weight_decay": 0.1}, {"params": [ref[1]], "weight_decay": 0.0}]
    _train(torch.optim.AdamW(groups, lr=3e-3, foreach=False), ref, 100)
    for a, b, start in zip(ours, ref, _params()):
        assert (a - start).abs().max() > 0.01  # 100 steps of lr 3e-3 moved every parameter
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)  # the kernels differ only in rounding


def test_optimizer_state_resumes_into_a_fresh_optimizer() -> None:
    # A checkpoint's optimizer state loads into a newly built optimizer and continues identically.
    a, b = _params(), _params()
    opt_a = build_optimizer(a, lr=1e-3, weight_decay=0.1)
    _train(opt_a, a, 5)
    state = copy.deepcopy(opt_a.state_dict())  # as a checkpoint holds it: not the live tensors
    with torch.no_grad():
        for x, y in zip(a, b):
            y.copy_(x)
    opt_b = build_optimizer(b, lr=1e-3, weight_decay=0.1)
    opt_b.load_state_dict(state)
    _train(opt_a, a, 5)
    _train(opt_b, b, 5)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def _bf16(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in params]


def test_bf16_parameters_follow_the_fp32_trajectory_through_fp32_master_weights() -> None:
    """lr 1e-4 on weights of ~1 moves each step by far less than half a bf16 ulp (2^-8 at 1): without
    fp32 masters the weights would never move. With them, 300 steps one way move every weight by
    several ulps, and the bf16 model is the fp32 run rounded."""
    fp32, bf16 = _params(), _bf16(_params())
    start = [p.detach().clone() for p in bf16]
    _train(build_optimizer(fp32, lr=1e-4, weight_decay=0.1), fp32, 300, one_sign=True)
    _train(build_optimizer(bf16, lr=1e-4, weight_decay=0.1), bf16, 300, one_sign=True)
    for ours, ref, before in zip(bf16, fp32, start):
        assert ours.dtype == torch.bfloat16
        assert (ours != before).float().mean() > 0.9  # nearly every weight moved
        # Two bf16 roundings apart (of the start and of the end: 2^-8 relative each), plus what the
        # gradients' rounding to bf16 moved (< 1e-3 in total).
        torch.testing.assert_close(ours.float(), ref.detach(), rtol=2 ** -7, atol=1e-3)


def test_bf16_optimizer_state_resumes_with_its_fp32_masters() -> None:
    a, b = _bf16(_params()), _bf16(_params())
    opt_a = build_optimizer(a, lr=1e-4)
    _train(opt_a, a, 5)
    state = copy.deepcopy(opt_a.state_dict())
    opt_b = build_optimizer(b, lr=1e-4)  # built on the initial weights: the masters bring the trained ones
    opt_b.load_state_dict(state)
    _train(opt_a, a, 5)
    _train(opt_b, b, 5)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("bf16", [False, True])
def test_a_non_finite_gradient_skips_the_step_and_leaves_weights_and_moments_as_they_were(bad, bf16) -> None:
    params = _bf16(_params()) if bf16 else _params()
    optimizer = build_optimizer(params, lr=1e-2, weight_decay=0.1)
    _train(optimizer, params, 3)
    weights, state = copy.deepcopy([p.detach() for p in params]), copy.deepcopy(optimizer.state_dict())
    for p in params:
        p.grad = torch.ones_like(p)
    params[1].grad[5] = bad
    norm, stepped = clipped_step(optimizer, max_norm=1.0)
    assert not stepped and not norm < float("inf")  # nan or inf
    assert all(p.grad is None for p in params)
    assert all(torch.equal(a, b) for a, b in zip(params, weights))
    torch.testing.assert_close(optimizer.state_dict(), state, rtol=0, atol=0)
    for p in params:
        p.grad = torch.ones_like(p)
    norm, stepped = clipped_step(optimizer, max_norm=1.0)
    assert stepped and norm == pytest.approx(sum(p.numel() for p in params) ** 0.5, rel=1e-2 if bf16 else 1e-6)
    assert all(not torch.equal(a, b) for a, b in zip(params, weights))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_large_finite_gradient_norm_is_clipped_in_every_dtype(dtype) -> None:
    """fp16 gradients of norm 8e4 (each element 2e4, finite) are clipped, not taken for an overflow."""
    param = torch.nn.Parameter(torch.zeros(4, 4, dtype=dtype))
    optimizer = build_optimizer([param], lr=1e-2)
    param.grad = torch.full_like(param, 2e4)  # 19,968 in bf16
    expected = 4 * param.grad[0, 0].item()
    norm, stepped = clipped_step(optimizer, max_norm=1.0)
    assert stepped and norm == pytest.approx(expected) and bool((param != 0).all())
    param.grad = torch.full_like(param, 2e4)
    clip_and_norm([param], max_norm=1.0)
    assert torch.linalg.vector_norm(param.grad.float()).item() == pytest.approx(1.0, rel=1e-2)


def test_an_unknown_schedule_is_refused_when_built_even_with_warm_up() -> None:
    optimizer = build_optimizer(_params(), lr=1e-3)
    with pytest.raises(ValueError, match="unknown schedule 'cosin'; use constant, linear, cosine"):
        build_scheduler(optimizer, warmup_steps=3, max_steps=10, schedule="cosin")


def test_bf16_gradients_of_micro_batches_add_up_in_fp32_on_the_masters() -> None:
    """1 + 2**-9 rounds to 1 in bf16: summed in the parameter's dtype, two micro-batches of 2**-9
    after one of 1 would vanish; on the fp32 masters they add up exactly."""
    param = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    optimizer = build_optimizer([param], lr=1e-2)
    for scale in (1.0, 2**-9, 2**-9):
        (param * scale).sum().backward()
    assert param.grad is None  # moved to the master by the hook
    [master] = optimizer.param_groups[0]["params"] + optimizer.param_groups[1]["params"]
    assert master.dtype == torch.float32 and torch.equal(master.grad, torch.full((4,), 1 + 2 * 2**-9))
    norm, stepped = clipped_step(optimizer, max_norm=0.0)
    assert stepped and norm == pytest.approx(2 * (1 + 2 * 2**-9))
    assert bool((param != 0).all()) and torch.equal(param, master.to(torch.bfloat16))


def test_a_second_optimizer_on_the_same_bf16_model_gets_the_gradients() -> None:
    """run_sft then run_grpo on one model object build two optimizers: the first one's hook must
    not keep taking the gradients into masters no one steps."""
    param = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    first = build_optimizer([param], lr=1e-2)
    second = build_optimizer([param], lr=1e-2)
    (param * 2.0).sum().backward()
    norm, stepped = clipped_step(second, max_norm=0.0)
    assert stepped and norm == pytest.approx(4.0) and bool((param < 1).all())
    assert all(p.grad is None for group in first.param_groups for p in group["params"])
