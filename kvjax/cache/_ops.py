"""Pure cache updates: writing tokens into slots (in place under jit, no copy of the cache)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.cache._state import LayerCache

Array = jax.Array


def put_rows(a: Array, idx: Array, x: Array, *, head_axis: int = 1) -> Array:
    """a[b, h, idx[...]] = x per (batch, KV head): one XLA scatter whose batch and head axes are
    scatter batching dimensions (no index arrays built per call), indices out of [0, N)
    above dropped, negative ones counted from the end (as `a.at[bi, hi, idx].set(x,
    mode="drop")`, which this replaces: the same scatter, a fraction of its traced ops).

    Args:
        a: [B, H, N, ...] the array written (slots or pages along axis 2).
        idx: int [B, H, M] (head_axis=1) or [B, M, H] (head_axis=2) target index of each row.
        x: rows broadcastable to idx's shape + a.shape[3:] (cast to a's dtype).
        head_axis: idx's head axis.

    Returns:
        a with the rows written (in place when a's buffer is dead afterwards).
    """
    n = a.shape[2]
    idx = jnp.where(idx < 0, idx + n, idx)
    rest = a.ndim - 3
    dims = jax.lax.ScatterDimensionNumbers(
        update_window_dims=tuple(range(3, 3 + rest)),
        inserted_window_dims=(2,),
        scatter_dims_to_operand_dims=(2,),
        operand_batching_dims=(0, 1),
        scatter_indices_batching_dims=(0, head_axis),
    )
    x = jnp.broadcast_to(x.astype(a.dtype), idx.shape + a.shape[3:])
    mode = jax.lax.GatherScatterMode.FILL_OR_DROP
    return jax.lax.scatter(a, idx[..., None], x, dims, mode=mode)


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
    pos = jnp.broadcast_to(pos_new[:, :, None], (b, t, h)).astype(jnp.int32)
    if score_new is None:
        score_new = jnp.zeros((b, t, h), jnp.float32)
    put = lambda a, x: put_rows(a, slots, x, head_axis=2)
    return layer.replace(
        k=put(layer.k, k_new),
        v=put(layer.v, v_new),
        pos=put(layer.pos, pos),
        score=put(layer.score, score_new),
    )
