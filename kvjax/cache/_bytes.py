"""Memory accounting, two ways never mixed up.

* physical bytes: everything the cache allocates (data, positions, scores), used or not;
* live bytes: K and V data of the tokens a decode step attends, the number papers report as "KV
  memory": the occupied slots plus the current token (attended from the step's own K/V, one
  full-precision token per KV head and layer), see `attended_slots_per_layer`.

Inside jit we count slots (int32); bytes are computed on the host in int64, because byte counts of
real caches overflow int32 and lose exactness in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache._stack import is_stacked, num_layers
from kvjax.cache._state import Cache, LayerCache

Array = jax.Array


# Order of the tier axis in live counts. Full and INT8 count slots; the low-bit tier counts pages.
TIERS = ("full", "int8", "lowbit")


def layer_slot_bytes(layer: LayerCache) -> tuple[int, int, int]:
    """K/V bytes of one unit of one KV head of this layer, per tier (0 for an absent tier).

    Full precision: 2·D·itemsize per slot. INT8: 2·D codes + two float32 scales per slot.
    Low-bit: one page of G tokens, codes + per-channel key and per-token value scales/zeros.
    """
    full = layer.k.shape[-1] * layer.k.dtype.itemsize + layer.v.shape[-1] * layer.v.dtype.itemsize
    return (
        full,
        0 if layer.int8 is None else layer.int8.slot_bytes(),
        0 if layer.lowbit is None else layer.lowbit.page_bytes(),
    )


def slot_bytes_per_layer(cache: Cache) -> np.ndarray:
    """[L, 3] int64: K/V bytes of one unit of one KV head, per layer and tier (a stacked
    cache's layers share one shape, hence one row repeated)."""
    if is_stacked(cache):
        return np.array([layer_slot_bytes(cache.layers)] * num_layers(cache), np.int64)
    return np.array([layer_slot_bytes(layer) for layer in cache.layers], np.int64)


def physical_bytes(cache: Cache) -> int:
    """Bytes the cache allocates (a static number: shapes are fixed)."""
    return int(sum(_nbytes(x) for x in jax.tree_util.tree_leaves(cache)))


def _nbytes(x: Array) -> int:
    """Bytes of an array as a device stores it (int4: two values a byte)."""
    if jnp.issubdtype(x.dtype, jnp.integer):
        return x.size * jnp.iinfo(x.dtype).bits // 8
    return x.size * x.dtype.itemsize


def _layer_tier_slots(layer: LayerCache) -> Array:
    """[B, 3] int32 occupied units per tier (slots, slots, pages), summed over KV heads
    ([L, B, 3] for a stacked layer)."""
    full = jnp.sum(layer.live_slots(), axis=-1)
    zero = jnp.zeros_like(full)
    q = zero if layer.int8 is None else jnp.sum(layer.int8.live_slots(), axis=-1)
    lb = zero if layer.lowbit is None else jnp.sum(layer.lowbit.live_pages(), axis=-1)
    return jnp.stack([full, q, lb], axis=-1)


def live_slots_per_layer(cache: Cache) -> Array:
    """[B, L, 3] int32: occupied units per layer and tier (full slots, INT8 slots, low-bit
    pages), summed over KV heads."""
    if is_stacked(cache):
        return jnp.swapaxes(_layer_tier_slots(cache.layers), 0, 1)
    return jnp.stack([_layer_tier_slots(layer) for layer in cache.layers], axis=1)


def attended_slots_per_layer(cache: Cache) -> Array:
    """[B, L, 3] int32: units a decode step attends per layer and tier — the occupied units of
    `live_slots_per_layer` plus the current token (one full-precision slot per KV head) in rows
    that have consumed a token. Measured after a step's write, it is what the step attended
    (a budget of N: at most N tokens)."""
    live = live_slots_per_layer(cache)
    hkv = (cache.layers if is_stacked(cache) else cache.layers[0]).num_kv_heads
    cur = jnp.where(cache.length > 0, hkv, 0).astype(jnp.int32)  # [B]
    return live.at[:, :, 0].add(cur[:, None])


def slots_to_bytes(slots, slot_bytes: np.ndarray) -> np.ndarray:
    """[..., L, 3] unit counts and [L, 3] unit bytes → [...] int64 live bytes."""
    s = np.asarray(slots, np.int64)
    return np.sum(s * np.asarray(slot_bytes, np.int64), axis=(-2, -1))


def live_bytes(cache: Cache) -> np.ndarray:
    """[B] int64: K/V bytes a decode step attends (occupied slots of all tiers plus the current
    token), all layers and KV heads (host side)."""
    return slots_to_bytes(attended_slots_per_layer(cache), slot_bytes_per_layer(cache))
