"""Random eviction at the same rate (CONF-KV's ablation): the same ring and budget as a ranked
policy, but the token evicted from the ranked region is chosen uniformly at random (seeded)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from kvjax.policies._ranked import RankedPolicy


def hash_uniform(seed: int, layer, pos, shape) -> jnp.ndarray:
    """Deterministic pseudo-random floats in [0, 1) from (seed, layer, KV head, position)."""
    h = jnp.arange(shape[1], dtype=jnp.uint32)[None, :, None]
    x = (
        pos.astype(jnp.uint32) * jnp.uint32(0x9E3779B1)
        + h * jnp.uint32(0x85EBCA77)
        + jnp.uint32((seed * 1000003) & 0xFFFFFFFF)
        # layer is a Python int, or a traced int32 under a stacked write (`write_stack`): its
        # hash term is computed in uint32 either way (a traced `& 0xFFFFFFFF` overflows int32)
        + jnp.asarray(layer).astype(jnp.uint32) * jnp.uint32(7919)
    )
    for shift, mul in ((16, 0x7FEB352D), (15, 0x846CA68B), (16, 1)):
        x = (x ^ (x >> jnp.uint32(shift))) * jnp.uint32(mul)
    return (x >> jnp.uint32(8)).astype(jnp.float32) / jnp.float32(1 << 24)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RandomPolicy(RankedPolicy):
    """Random keep-priorities drawn once per token.

    Attributes:
        budget: tokens attended per step per KV head per layer (the current one included).
        recent: protected recent window (default 32, CONF-KV's P).
        seed: random seed.
    """

    name = "random"
    uses_attention_mass: ClassVar[bool] = False
    budget: int
    recent: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        self._check()

    @property
    def ring(self) -> int:
        return self.recent

    def update_score(self, score, mass, pos, cur, state, layer_index):
        del mass, pos, cur, state, layer_index
        return score

    def init_score(self, mass, pos, state, layer_index):
        del state
        return hash_uniform(self.seed, layer_index, jnp.broadcast_to(pos, mass.shape), mass.shape)
