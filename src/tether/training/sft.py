"""Supervised fine-tuning: next-token loss on completion tokens only, padding-free micro-batches.

One ``train_step`` is one optimizer step over a batch of examples, accumulated over micro-batches
cut by a token budget; the loss is normalised by the batch's total number of target tokens so
accumulation gives exactly the full-batch gradient.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tether.data.batching import PackedBatch, pack_by_token_budget, shift_targets
from tether.data.tokenize import SFTExample
from tether.models.attention import PackedAttention, sliding_window_args
from tether.training.optim import clipped_step


def packed_nll(model: torch.nn.Module, batch: PackedBatch) -> tuple[torch.Tensor, int]:
    """Summed next-token negative log-likelihood over the batch's targets, and their count."""
    attention = PackedAttention(batch.seq_lens, **sliding_window_args(model.config))
    hidden = model(batch.input_ids, batch.positions, attention)  # [1, T, H]
    targets, target_mask = shift_targets(batch)  # [1, T] each
    index = target_mask[0].nonzero().squeeze(-1)  # [M] positions that predict a target
    # Only target positions go through the LM head: on small models it is most of the cost.
    logits = model.compute_logits(hidden[0, index]).float()  # [M, V]
    return F.cross_entropy(logits, targets[0, index], reduction="sum"), int(index.numel())


class SFTTrainer:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, *, micro_batch_tokens: int,
                 grad_clip: float) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.micro_batch_tokens = micro_batch_tokens
        self.grad_clip = grad_clip

    def train_step(self, examples: Sequence[SFTExample]) -> dict[str, float]:
        start = time.perf_counter()
        self.model.train()
        micro_batches = pack_by_token_budget(examples, self.micro_batch_tokens)
        num_targets = sum(b.num_loss_tokens for b in micro_batches)
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for batch in micro_batches:
            nll, _ = packed_nll(self.model, batch)
            (nll / max(num_targets, 1)).backward()
            total += nll.item()
        grad_norm, stepped = clipped_step(self.optimizer, self.grad_clip, "sft")
        lr = self.optimizer.param_groups[0]["lr"]
        if stepped:  # the schedule counts updates made (as DeepSpeed's skips)
            self.scheduler.step()
        elapsed = time.perf_counter() - start
        num_tokens = sum(b.num_tokens for b in micro_batches)
        return {"loss/sft": total / max(num_targets, 1), "grad_norm": grad_norm, "lr": lr,
                "optim/skipped_steps": int(not stepped), "time/step_s": elapsed,
                "throughput/train_tokens_per_s": num_tokens / elapsed}

    @torch.no_grad()
    def eval_loss(self, examples: Sequence[SFTExample]) -> float:
        """Mean next-token loss per target token over ``examples``."""
        self.model.eval()
        total, count = 0.0, 0
        for batch in pack_by_token_budget(examples, self.micro_batch_tokens):
            nll, num = packed_nll(self.model, batch)
            total += float(nll)
            count += num
        self.model.train()
        return total / max(count, 1)
