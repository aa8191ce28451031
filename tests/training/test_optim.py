"""The optimizer tether builds: AdamW with decay on matrices only, whichever kernel it picked."""

from __future__ import annotations

import copy

import torch

from tether.training.optim import build_optimizer


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(32, 48)), torch.nn.Parameter(torch.randn(48)),
            torch.nn.Parameter(torch.randn(48, 16))]


def _train(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 1e-2
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
