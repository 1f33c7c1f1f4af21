"""Positions within the cache (StreamingLLM §3.2) for an arbitrary kept set: the key of rank r
among the n tokens a (sequence, KV head) has cached is attended as if at position r and the query
as if at n, so no distance exceeds the cache size however long the stream.

Keys are cached after RoPE at their original positions p, and RoPE is a rotation, so attention
only has to turn each key by r − p (plus the call's constant offset, below) before scoring it;
the cache itself is never rewritten.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.attention import KeyShift
from kvjax.cache import LayerCache

Array = jax.Array


def cache_position_shift(layer: LayerCache, first_pos: Array) -> KeyShift:
    """Turn each cached key from its position p to r + (first_pos − n): r its rank by original
    position among the n occupied slots of its (sequence, KV head), over every tier.

    The query at first_pos then sees the key of rank r at distance n − r, as if the key sat at
    r and the query at n. RoPE sees only differences, so the offset first_pos − n, shared by a
    (sequence, KV head), leaves this call's own tokens at their true positions: the call's
    token i (position first_pos + i) is at cache position n + i, one past the cached tokens.

    Args:
        layer: the layer's cache before this call's write (slots hold positions < first_pos).
        first_pos: [B] int32 position of this call's first query.

    Returns:
        the shift of every slot of every tier (0 on empty slots).

    Raises:
        ValueError: a pooled layer (slots shared by the KV heads; not supported).

    A sort of the N = C (+ Cq + P·G) slot positions per (sequence, KV head): O(N log N) per
    layer per call, small next to attention's N·D reads (the rank needs an order over the
    kept set, which changes with every eviction).
    """
    if layer.head is not None:
        raise ValueError("positions within the cache are not supported for a pooled layer")
    tiers = [layer.pos]
    if layer.int8 is not None:
        tiers.append(layer.int8.pos)
    if layer.lowbit is not None:
        b, h = layer.lowbit.pos.shape[:2]
        tiers.append(layer.lowbit.pos.reshape(b, h, -1))
    pos = jnp.concatenate(tiers, axis=-1)  # [B, Hkv, N]
    occupied = pos >= 0
    n = jnp.sum(occupied, axis=-1, dtype=jnp.int32)[..., None]  # [B, Hkv, 1]
    order = jnp.argsort(jnp.where(occupied, pos, jnp.iinfo(jnp.int32).max), axis=-1)
    b, h, size = pos.shape
    bi, hi = jnp.arange(b)[:, None, None], jnp.arange(h)[None, :, None]
    ranks = jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32), pos.shape)
    rank = jnp.zeros_like(pos).at[bi, hi, order].set(ranks)  # [B, Hkv, N]
    shift = rank + (first_pos.astype(jnp.int32)[:, None, None] - n) - pos
    shift = jnp.where(occupied, shift, 0)
    cuts = [t.shape[-1] for t in tiers]
    full, rest = shift[..., : cuts[0]], shift[..., cuts[0] :]
    int8 = lowbit = None
    if layer.int8 is not None:
        int8, rest = rest[..., : cuts[1]], rest[..., cuts[1] :]
    if layer.lowbit is not None:
        lowbit = rest.reshape(layer.lowbit.pos.shape)
    return KeyShift(full=full, int8=int8, lowbit=lowbit)
