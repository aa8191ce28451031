"""The typed batch the policy trainer consumes, and how it is cut into micro-batches.

Completions are ragged; per-token tensors are right-padded to the longest completion ``T`` with a
``mask`` of valid tokens. Prompt ids travel with them because the trainer re-scores whole sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class RolloutBatch:
    prompt_ids: list[list[int]]  # [B] ragged prompt token ids
    completion_ids: torch.Tensor  # LongTensor[B, T] right-padded with 0
    mask: torch.Tensor  # BoolTensor[B, T] valid completion tokens
    behaviour_logprobs: torch.Tensor  # FloatTensor[B, T] fp32 log-probs reported by the engine
    versions: torch.Tensor  # LongTensor[B, T] policy version that sampled each token
    rewards: torch.Tensor  # FloatTensor[B]
    advantages: torch.Tensor  # FloatTensor[B] sequence-level advantage
    group_size: int

    def __post_init__(self) -> None:
        num_seqs = len(self.prompt_ids)
        for name in ("completion_ids", "mask", "behaviour_logprobs", "versions"):
            tensor = getattr(self, name)
            if tensor.shape[0] != num_seqs or tensor.shape != self.completion_ids.shape:
                raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected [{num_seqs}, T]")
        if self.rewards.shape != (num_seqs,) or self.advantages.shape != (num_seqs,):
            raise ValueError("rewards and advantages must be [B]")

    @property
    def num_seqs(self) -> int:
        return len(self.prompt_ids)

    @property
    def completion_lens(self) -> list[int]:
        return self.mask.sum(dim=1).tolist()

    def select(self, rows: list[int]) -> RolloutBatch:
        index = torch.tensor(rows, dtype=torch.long)
        return RolloutBatch(
            prompt_ids=[self.prompt_ids[r] for r in rows], completion_ids=self.completion_ids[index],
            mask=self.mask[index], behaviour_logprobs=self.behaviour_logprobs[index],
            versions=self.versions[index], rewards=self.rewards[index],
            advantages=self.advantages[index], group_size=self.group_size)


def split_by_tokens(prompt_ids: list[list[int]], completion_lens: list[int], max_tokens: int, *,
                    share_prompts: bool = False) -> list[list[int]]:
    """Consecutive row indices whose tokens fit ``max_tokens`` per micro-batch (a longer row goes alone).

    A row costs its prompt plus its completion; with ``share_prompts`` a row whose prompt already
    appears in the micro-batch costs only its completion, as the trainer then scores that prompt once.

    >>> split_by_tokens([[1], [1], [2], [3, 3]], [2, 2, 2, 3], 8)
    [[0, 1], [2, 3]]
    >>> split_by_tokens([[1], [1], [2], [3, 3]], [2, 2, 2, 3], 8, share_prompts=True)
    [[0, 1, 2], [3]]
    """
    chunks: list[list[int]] = []
    current: list[int] = []
    seen: set[tuple[int, ...]] = set()
    used = 0
    for row, (prompt, num_completion) in enumerate(zip(prompt_ids, completion_lens)):
        key = tuple(prompt)
        cost = num_completion + (0 if share_prompts and key in seen else len(prompt))
        if current and used + cost > max_tokens:
            chunks.append(current)
            current, used, seen = [], 0, set()
            cost = num_completion + len(prompt)
        current.append(row)
        seen.add(key)
        used += cost
    if current:
        chunks.append(current)
    return chunks
