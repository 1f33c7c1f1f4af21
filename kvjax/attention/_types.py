"""What attention returns besides its output: the per-slot mass policies score with."""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import struct

Array = jax.Array


@struct.dataclass
class AttnStats:
    """Attention probability mass, summed over the G query heads of each KV head and over the
    (weighted) queries of the call.

    Attributes:
        slot_mass: [B, Hkv, C] float32 mass on each full-precision cache slot ([B, 1, P] on a
            pooled layer: each pool slot gets the mass of its own KV head).
        new_mass: [B, Hkv, T] float32 mass on each of the T tokens of this call.
        lse: [B, T, Hq] float32 log-sum-exp of each query's scaled logits.
        int8_mass: [B, Hkv, Cq] float32 mass on each INT8 slot (None without an INT8 tier).
        lowbit_mass: [B, Hkv, P, G] float32 mass on each low-bit slot (None without that tier).
    """

    slot_mass: Array
    new_mass: Array
    lse: Array
    int8_mass: Array | None = None
    lowbit_mass: Array | None = None


@struct.dataclass
class KeyShift:
    """Positions by which attention turns each cached key before scoring it (keys are cached
    after RoPE at their original positions; RoPE is a rotation, so turning a key by s positions
    makes the query see it s positions later). Values are never touched.

    Attributes:
        full: [B, Hkv, C] int32 shift of each full-precision slot.
        int8: [B, Hkv, Cq] int32 shift of each INT8 slot (None without an INT8 tier).
        lowbit: [B, Hkv, P, G] int32 shift of each low-bit slot (None without that tier).
    """

    full: Array
    int8: Array | None = None
    lowbit: Array | None = None


def turn_keys(k: Array, by: Array, rotate: Callable[[Array, Array], Array]) -> Array:
    """Keys k [B, Hkv, N, D] each turned by `by` [B, Hkv, N] int32 positions with `rotate`
    (the model's RoPE, `rotate(x [B', T, H, D], by [B', T])`), in k's dtype."""
    b, h, n, d = k.shape
    turned = rotate(k.reshape(b * h, n, 1, d), by.reshape(b * h, n))
    return turned.reshape(b, h, n, d)
