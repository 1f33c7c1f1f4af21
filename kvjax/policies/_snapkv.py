"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation"):
the prompt's last `observation` queries vote for the prompt tokens worth keeping; votes are
max-pooled over neighbouring positions (kernel `pool`) so whole phrases survive; the top tokens per
KV head are kept. During decode the selected prompt tokens stay and new tokens use a window.

Chunked prefill: each prompt chunk is compressed with the observation window at *its* end (the
prompt can be longer than the cache); for a prompt that fits in one chunk this is exactly SnapKV.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from kvjax.policies._ranked import RankedPolicy
from kvjax.policies._regions import Tokens


@dataclasses.dataclass(frozen=True, kw_only=True)
class SnapKVPolicy(RankedPolicy):
    """Prefill-time selection by pooled observation-window attention, then a decode window.

    Attributes:
        budget: tokens attended per step per KV head per layer (the current one and the
            window included).
        window: recent tokens always kept (the observation window's tokens and decode's window).
        observation: prompt queries that vote (paper: 32).
        pool: max-pool kernel over positions (paper: 5-7; odd).
    """

    name = "snapkv"
    budget: int
    window: int = 32
    observation: int = 32
    pool: int = 7
    frozen_in_decode = True
    uses_attention_mass: ClassVar[bool] = False  # votes are cast in prefill only

    def __post_init__(self) -> None:
        if self.observation < 1:
            raise ValueError(f"SnapKVPolicy.observation must be >= 1, got {self.observation}")
        if self.pool < 1 or self.pool % 2 == 0:
            raise ValueError(f"SnapKVPolicy.pool must be an odd number >= 1, got {self.pool}")
        self._check()

    @property
    def ring(self) -> int:
        return self.window

    def query_weight(self, pos_new, valid):
        last = jnp.max(jnp.where(valid, pos_new, -1), axis=1, keepdims=True)
        return (valid & (pos_new > last - self.observation)).astype(jnp.float32)

    def update_score(self, score, mass, pos, cur, state, layer_index):
        del score, pos, cur, state, layer_index
        return mass  # this chunk's observation window votes afresh

    def candidate_scores(self, cands: Tokens) -> jax.Array:
        """Max-pool the votes over `pool` neighbouring positions (in position order)."""
        big = jnp.iinfo(jnp.int32).max
        order = jnp.argsort(jnp.where(cands.pos >= 0, cands.pos, big), axis=-1)
        votes = jnp.take_along_axis(jnp.where(cands.pos >= 0, cands.score, -jnp.inf), order, -1)
        pooled = jax.lax.reduce_window(
            votes, -jnp.inf, jax.lax.max, (1, 1, self.pool), (1, 1, 1), "SAME"
        )
        # Neighbours are neighbours in position order among the candidates still held.
        return jnp.take_along_axis(pooled, jnp.argsort(order, axis=-1), -1)
