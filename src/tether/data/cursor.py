"""A deterministic, resumable cursor over a dataset (prompts for RL, examples for SFT).

All of its state (epoch, position, seed) is explicit, for the run's checkpoints to save (resume is
planned; no run saves it yet): the order of epoch ``e`` is a permutation drawn from the string
``"seed:e"`` (Python hashes a string seed by SHA-512, so seeds s and s + 1 do not share epochs, as
``seed + e`` made them: run s + 1's first epoch was run s's second), and restarting at (epoch,
position) replays exactly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(slots=True)
class CursorState:
    epoch: int = 0
    position: int = 0


class DataCursor(Generic[T]):
    def __init__(self, items: list[T], seed: int, shuffle: bool = True) -> None:
        if not items:
            raise ValueError("the dataset is empty")
        self.items = items
        self.seed = seed
        self.shuffle = shuffle
        self.state = CursorState()
        self._order = self._order_of(0)

    def _order_of(self, epoch: int) -> list[int]:
        order = list(range(len(self.items)))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def take(self, num: int) -> list[T]:
        """The next ``num`` items, wrapping into a freshly shuffled epoch when one runs out."""
        out: list[T] = []
        while len(out) < num:
            if self.state.position == len(self.items):
                self.state = CursorState(self.state.epoch + 1, 0)
                self._order = self._order_of(self.state.epoch)
            out.append(self.items[self._order[self.state.position]])
            self.state.position += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.state.epoch, "position": self.state.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed = state["seed"]
        self.state = CursorState(state["epoch"], state["position"])
        self._order = self._order_of(self.state.epoch)
