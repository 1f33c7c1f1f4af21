"""Pure cache updates: writing tokens into slots (in place under jit, no copy of the cache)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.cache._state import LayerCache

Array = jax.Array


def write_slots(
    layer: LayerCache,
    k_new: Array,
    v_new: Array,
    pos_new: Array,
    slots: Array,
    score_new: Array | None = None,
) -> LayerCache:
    """Scatter this call's tokens into chosen slots, per KV head.

    Args:
        layer: the layer's cache.
        k_new: [B, T, Hkv, D] keys after RoPE.
        v_new: [B, T, Hkv, D] values.
        pos_new: [B, T] int32 original positions.
        slots: [B, T, Hkv] int32 target slot per token and head; any value outside [0, C)
            (use C) drops the token. Two kept tokens must never share a slot.
        score_new: [B, T, Hkv] float32 initial score of each written slot (default 0).

    Returns:
        The updated LayerCache (an in-place scatter when the input buffer is dead afterwards).
    """
    b, t, h, _ = k_new.shape
    bi = jnp.arange(b)[:, None, None]
    hi = jnp.arange(h)[None, None, :]
    pos = jnp.broadcast_to(pos_new[:, :, None], (b, t, h)).astype(jnp.int32)
    if score_new is None:
        score_new = jnp.zeros((b, t, h), jnp.float32)
    return layer.replace(
        k=layer.k.at[bi, hi, slots].set(k_new.astype(layer.k.dtype), mode="drop"),
        v=layer.v.at[bi, hi, slots].set(v_new.astype(layer.v.dtype), mode="drop"),
        pos=layer.pos.at[bi, hi, slots].set(pos, mode="drop"),
        score=layer.score.at[bi, hi, slots].set(score_new, mode="drop"),
    )
