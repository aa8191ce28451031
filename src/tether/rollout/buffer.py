"""The versioned rollout buffer: scored groups in, batches within the staleness bound out.

The unit is a ``GroupRollout``: one prompt, its ``G`` samples (every token stamped with the policy
version that sampled it) and their rewards. Staleness is defined once, here:

    lag(sample) = trainer version at the step that consumes it - version of its OLDEST token

and a group is consumable at trainer version ``v`` when every sample's lag is ``<= max_staleness``.
Groups past the bound are handed back (not silently dropped) so the caller re-issues their prompts.
Everything here is plain data, so the buffer's state saves and travels between processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tether.data.records import PromptRecord
from tether.engine.types import Completion
from tether.rewards.compute import RewardResult


def oldest_token_version(completion: Completion, default: int) -> int:
    """The policy version of a sample's oldest token (``default`` for an empty completion): the
    version its lag is counted from."""
    return min(completion.versions, default=default)


@dataclass(slots=True)
class GroupRollout:
    """One prompt's group of samples, finished and scored."""

    uid: int  # admission number on the generator (a re-issued prompt gets a new one)
    record: PromptRecord
    prompt_ids: list[int]
    completions: list[Completion]  # [G] in sample order
    texts: list[str]  # [G] decoded completions, as the reward functions saw them
    scores: RewardResult  # rewards of the G samples (totals [G], components, errors)
    start_version: int  # generator policy version when the group was admitted
    # [G] version of each sample's oldest token (the start version for an empty completion), and
    # their minimum; fixed once the group is finished (the buffer reads them on every poll).
    oldest_versions: list[int] = field(init=False)
    oldest_version: int = field(init=False)

    def __post_init__(self) -> None:
        self.oldest_versions = [oldest_token_version(c, self.start_version) for c in self.completions]
        self.oldest_version = min(self.oldest_versions, default=self.start_version)

    @property
    def has_reward_variance(self) -> bool:
        """False when every sample got the same reward: a GRPO group with no learning signal."""
        return len(set(self.scores.totals)) > 1

    def lags(self, trainer_version: int) -> list[int]:
        return [trainer_version - v for v in self.oldest_versions]


def is_consumable(group: GroupRollout, trainer_version: int, max_staleness: int) -> bool:
    """True when the group, trained on at ``trainer_version``, stays within ``max_staleness``."""
    return trainer_version - group.oldest_version <= max_staleness


@dataclass(slots=True)
class BatchTake:
    groups: list[GroupRollout] | None  # a full batch, or None when not enough groups are ready
    stale: list[GroupRollout] = field(default_factory=list)  # dropped: re-issue their prompts


class RolloutBuffer:
    """Finished groups waiting for the trainer; hands out batches oldest first."""

    def __init__(self, max_staleness: int) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.max_staleness = max_staleness
        self.groups: list[GroupRollout] = []

    def __len__(self) -> int:
        return len(self.groups)

    def add(self, groups: list[GroupRollout]) -> None:
        self.groups.extend(groups)

    def take_batch(self, num_groups: int, trainer_version: int) -> BatchTake:
        """Drop groups too stale for ``trainer_version``; then ``num_groups`` groups if that many are left.

        Oldest groups go first: they are the nearest to expiring. Ties keep admission order.
        """
        fresh: list[GroupRollout] = []
        stale: list[GroupRollout] = []
        for group in self.groups:
            (fresh if is_consumable(group, trainer_version, self.max_staleness) else stale).append(group)
        if len(fresh) < num_groups:
            self.groups = fresh
            return BatchTake(None, stale)
        fresh.sort(key=lambda g: (g.oldest_version, g.uid))
        self.groups = fresh[num_groups:]
        return BatchTake(fresh[:num_groups], stale)

    def state_dict(self) -> dict[str, Any]:
        return {"max_staleness": self.max_staleness, "groups": list(self.groups)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.max_staleness = state["max_staleness"]
        self.groups = list(state["groups"])
