"""Sliding window: the last `budget` tokens, in a ring of slots."""

from __future__ import annotations

import dataclasses

from kvjax.policies._base import PositionalPolicy


@dataclasses.dataclass(frozen=True, kw_only=True)
class WindowPolicy(PositionalPolicy):
    """Keeps the most recent `budget` tokens (slot = position mod budget).

    Attributes:
        budget: tokens kept per KV head, >= 1.
    """

    name = "window"
    budget: int

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ValueError(f"WindowPolicy.budget must be >= 1, got {self.budget}")

    def capacity(self, max_len: int) -> int:
        del max_len
        return self.budget

    def slot_of(self, pos, capacity):
        return pos % capacity

    def survives(self, pos, last_pos, capacity):
        return pos > last_pos - capacity
