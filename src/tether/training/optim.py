"""Optimizer and learning-rate schedule builders: plain arguments in, torch objects out."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def build_optimizer(params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float = 0.0,
                    betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> torch.optim.AdamW:
    """AdamW; decay applies to matrices only (norm gains and biases are not decayed)."""
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # Fused: one kernel per parameter for the whole update (4x faster than foreach on CPU for the
    # demo's 40 small tensors: 1.0 vs 4.1 ms). foreach where this torch has no fused kernel for the
    # parameters' device or dtype (AdamW checks that when it is built).
    try:
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)
    except RuntimeError:
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=True)


def lr_factor(step: int, *, warmup_steps: int, max_steps: int, schedule: str,
              min_lr_ratio: float = 0.0) -> float:
    """Multiplier of the peak LR at optimizer step ``step`` (0-based): linear warm-up, then decay.

    >>> lr_factor(0, warmup_steps=2, max_steps=10, schedule="constant")
    0.5
    >>> round(lr_factor(10, warmup_steps=0, max_steps=10, schedule="cosine", min_lr_ratio=0.1), 6)
    0.1
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    if schedule == "linear":
        decay = 1.0 - progress
    elif schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown schedule {schedule!r}; use constant, linear or cosine")
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay


def build_scheduler(optimizer: torch.optim.Optimizer, *, warmup_steps: int, max_steps: int,
                    schedule: str, min_lr_ratio: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    lr_factor(0, warmup_steps=warmup_steps, max_steps=max_steps, schedule=schedule)  # validate name
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup_steps=warmup_steps, max_steps=max_steps,
                                          schedule=schedule, min_lr_ratio=min_lr_ratio))


def clip_and_norm(params: Iterable[torch.nn.Parameter], max_norm: float) -> float:
    """Clip the global gradient norm (0 disables clipping) and return the norm before clipping."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return 0.0
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    else:
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
    return float(norm)  # host sync: once per optimizer step
