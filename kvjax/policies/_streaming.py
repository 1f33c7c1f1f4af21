"""StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language Models with Attention Sinks"):
the first `sinks` tokens plus the most recent `budget - sinks` tokens."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax.policies._base import PositionalPolicy


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamingPolicy(PositionalPolicy):
    """Attention sinks + sliding window.

    Attributes:
        budget: total tokens kept per KV head (sinks included); must exceed `sinks`.
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

    def capacity(self, max_len: int) -> int:
        del max_len
        return self.budget

    def slot_of(self, pos, capacity):
        ring = capacity - self.sinks
        return jnp.where(pos < self.sinks, pos, self.sinks + (pos - self.sinks) % ring)

    def survives(self, pos, last_pos, capacity):
        return (pos < self.sinks) | (pos > last_pos - (capacity - self.sinks))
