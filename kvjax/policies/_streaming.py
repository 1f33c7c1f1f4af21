"""StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language Models with Attention Sinks"):
the first `sinks` tokens plus the most recent `budget - sinks` tokens (the current one included)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax.policies._base import PositionalPolicy, cached_tokens


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamingPolicy(PositionalPolicy):
    """Attention sinks + sliding window; `budget` is StreamingLLM's cache size: tokens attended
    per step, sinks and the current token included (the cache keeps `budget - 1`).

    Attributes:
        budget: total tokens attended per step per KV head; must exceed `sinks`.
        sinks: leading tokens never evicted (default 4, as in the paper).
    """

    name = "streaming"
    budget: int
    sinks: int = 4

    def __post_init__(self) -> None:
        if self.sinks < 0:
            raise ValueError(f"StreamingPolicy.sinks must be >= 0, got {self.sinks}")
        if self.budget <= self.sinks:
            raise ValueError(
                f"StreamingPolicy.budget ({self.budget}) must be larger than sinks "
                f"({self.sinks}): no room is left for the recent window"
            )

    @property
    def _recent(self) -> int:
        """Recent tokens cached (the current one is attended on top)."""
        return cached_tokens(self.budget) - self.sinks

    def capacity(self, max_len: int) -> int:
        del max_len
        return self.sinks + max(1, self._recent)  # no recent tokens: one slot stays empty

    def slot_of(self, pos, capacity):
        ring = capacity - self.sinks
        return jnp.where(pos < self.sinks, pos, self.sinks + (pos - self.sinks) % ring)

    def survives(self, pos, last_pos, capacity):
        del capacity
        recent = (pos > last_pos - self._recent) & jnp.bool_(self._recent > 0)
        return (pos < self.sinks) | recent
