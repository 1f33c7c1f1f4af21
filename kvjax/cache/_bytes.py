"""Memory accounting, two ways never mixed up.

* physical bytes: everything the cache allocates (data, positions, scores), used or not;
* live bytes: K and V data of occupied slots only, the number papers report as "KV memory".

Inside jit we count slots (int32); bytes are computed on the host in int64, because byte counts of
real caches overflow int32 and lose exactness in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache._state import Cache, LayerCache

Array = jax.Array


def layer_slot_bytes(layer: LayerCache) -> int:
    """Bytes of K and V data in one slot of one KV head of this layer."""
    return layer.k.shape[-1] * layer.k.dtype.itemsize + layer.v.shape[-1] * layer.v.dtype.itemsize


def slot_bytes_per_layer(cache: Cache) -> np.ndarray:
    """[L] int64: K/V bytes of one slot of one KV head, per layer."""
    return np.array([layer_slot_bytes(layer) for layer in cache.layers], np.int64)


def physical_bytes(cache: Cache) -> int:
    """Bytes the cache allocates (a static number: shapes are fixed)."""
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(cache)))


def live_slots_per_layer(cache: Cache) -> Array:
    """[B, L] int32: occupied slots of each layer, summed over KV heads (jit-friendly)."""
    return jnp.stack([jnp.sum(layer.live_slots(), axis=-1) for layer in cache.layers], axis=-1)


def slots_to_bytes(slots_per_layer, slot_bytes: np.ndarray) -> np.ndarray:
    """[..., L] slot counts → [...] int64 live bytes."""
    return np.asarray(slots_per_layer, np.int64) @ slot_bytes


def live_bytes(cache: Cache) -> np.ndarray:
    """[B] int64: K/V bytes of occupied slots, summed over layers and KV heads (host side)."""
    return slots_to_bytes(live_slots_per_layer(cache), slot_bytes_per_layer(cache))
