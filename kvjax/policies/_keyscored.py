"""Ranked policies scored from the keys themselves rather than from attention mass (Knorm,
KeyDiff): before each write the policy computes every held and new token's score from its key,
then the ranked engine keeps the top scores as usual."""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from kvjax.policies._ranked import RankedPolicy

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class KeyScoredPolicy(RankedPolicy):
    """Base of key-scored policies: subclasses implement `key_scores`.

    Attributes:
        budget: tokens attended per step per KV head per layer (the current one included).
        window: newest tokens never evicted (kvpress's key scores have none; the engine needs
            >= 1: the token just written).
    """

    budget: int
    window: int = 1
    uses_attention_mass: ClassVar[bool] = False

    def __post_init__(self) -> None:
        self._check()

    @property
    def ring(self) -> int:
        return self.window

    @abc.abstractmethod
    def key_scores(self, layer, k_new: Array, pos_new: Array, valid: Array):
        """Scores from keys (higher = keep).

        Args:
            layer: the layer's cache before this call (keys [B, Hkv, C, D], pos [B, Hkv, C]).
            k_new: [B, T, Hkv, D] this call's keys after RoPE.
            pos_new: [B, T] int32 positions; valid: [B, T] bool.

        Returns:
            (slot scores [B, Hkv, C] or None to keep the stored ones, new scores [B, Hkv, T]),
            float32.
        """

    def update_score(self, score, mass, pos, cur, state, layer_index):
        del mass, pos, cur, state, layer_index
        return score  # `_keyed` already wrote the scores of this call

    def init_score(self, mass, pos, state, layer_index):
        del pos, state, layer_index
        return mass  # `_keyed` passes the new tokens' key scores in place of their mass

    def _keyed(self, layer, k_new, pos_new, valid, stats):
        slot, new = self.key_scores(layer, k_new, pos_new, valid)
        if slot is not None:
            layer = layer.replace(score=jnp.where(layer.pos >= 0, slot, 0.0))
        return layer, stats.replace(new_mass=new.astype(jnp.float32))

    def write(self, layer, k_new, v_new, pos_new, valid, stats, state, *, layer_index):
        layer, stats = self._keyed(layer, k_new, pos_new, valid, stats)
        return RankedPolicy.write(
            self, layer, k_new, v_new, pos_new, valid, stats, state, layer_index=layer_index
        )

    def write_layers(self, layers, k_new, v_new, pos_new, valid, stats, state):
        """Scores every layer from its keys, then writes through the ranked engine (a decode
        step: its joint plan for all layers, one budget cond per step)."""
        trio = zip(layers, k_new, stats, strict=True)
        keyed = [self._keyed(ly, k, pos_new, valid, st) for ly, k, st in trio]
        layers = [ly for ly, _ in keyed]
        stats = [st for _, st in keyed]
        if k_new[0].shape[1] != 1:
            return tuple(
                RankedPolicy.write(self, ly, k, v, pos_new, valid, st, state, layer_index=i)
                for i, (ly, k, v, st) in enumerate(zip(layers, k_new, v_new, stats, strict=True))
            )
        return self._apply(self._decode_plans(layers, k_new, v_new, pos_new, valid, stats, state))


def key_norm(k: Array) -> Array:
    """L2 norm over the last axis in float32."""
    return jnp.sqrt(jnp.sum(jnp.square(k.astype(jnp.float32)), axis=-1))
