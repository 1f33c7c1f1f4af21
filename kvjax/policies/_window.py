"""Sliding window: the last `budget` tokens (the current one included), in a ring of slots."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax.policies._base import PositionalPolicy, cached_tokens


@dataclasses.dataclass(frozen=True, kw_only=True)
class WindowPolicy(PositionalPolicy):
    """Attends the most recent `budget` tokens, the current one included (Mistral's
    `sliding_window`): the cache keeps the `budget - 1` before it (slot = position mod that).

    Attributes:
        budget: tokens attended per step per KV head, >= 1 (1: the current token only).
    """

    name = "window"
    budget: int

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ValueError(f"WindowPolicy.budget must be >= 1, got {self.budget}")

    @property
    def _kept(self) -> int:
        return cached_tokens(self.budget)

    def capacity(self, max_len: int) -> int:
        del max_len
        return max(1, self._kept)  # budget 1 keeps nothing: one slot that stays empty

    def slot_of(self, pos, capacity):
        return pos % capacity

    def survives(self, pos, last_pos, capacity):
        del capacity
        return (pos > last_pos - self._kept) & jnp.bool_(self._kept > 0)
