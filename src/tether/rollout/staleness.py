"""The capacity controller: how many groups the generator may have started, given its version.

AReaL's rule (Fu et al. 2025, "AReaL", section 5.1), with ``B`` groups per batch and staleness
bound ``S``: group number ``g`` (0-based, in start order) may start only when

    g // B <= v_gen + S        i.e.  num_started < (v_gen + S + 1) * B

where ``v_gen`` is the policy version the generator currently holds. Batch ``k`` is trained at
trainer version ``k``, and a group that counts toward batch ``k = g // B`` starts at a version
``>= k - S``, so its lag at consumption is at most ``S``. ``num_extra`` over-samples: that many
more groups may be in flight, so a batch can close on the fastest groups (the early cut); the rest
keep running into the next batch. Groups that will never be trained on (dropped as too stale,
filtered by dynamic sampling, aborted) are ``release``d: they no longer count toward a batch,
which lets a replacement start. Out-of-order finishing (over-sampling, dropped groups) can still
push a group past ``S``; the buffer drops it at consumption and its prompt is re-issued.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class CapacityController:
    groups_per_batch: int  # B
    max_staleness: int  # S
    num_extra: int = 0  # over-sampling: groups allowed beyond the staleness window
    num_started: int = 0  # groups started that still count toward a batch

    def __post_init__(self) -> None:
        if self.groups_per_batch < 1:
            raise ValueError(f"groups_per_batch must be >= 1, got {self.groups_per_batch}")
        if self.max_staleness < 0 or self.num_extra < 0:
            raise ValueError("max_staleness and num_extra must be >= 0")

    def limit(self, version: int) -> int:
        """Most groups that may have started while the generator holds policy ``version``."""
        return (version + self.max_staleness + 1) * self.groups_per_batch + self.num_extra

    def may_start(self, version: int) -> bool:
        return self.num_started < self.limit(version)

    def start(self) -> int:
        """Count one started group; returns its number ``g``."""
        self.num_started += 1
        return self.num_started - 1

    def release(self, num_groups: int = 1) -> None:
        """Groups that will never be trained on stop counting, so replacements may start."""
        if num_groups > self.num_started:
            raise ValueError(f"release({num_groups}) with only {self.num_started} groups started")
        self.num_started -= num_groups

    def state_dict(self) -> dict[str, int]:
        return {"num_started": self.num_started}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.num_started = state["num_started"]
