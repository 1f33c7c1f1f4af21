"""adakv in the compress-once mode: AdaKV's allocation over a press's scores and the pooled
append-only cache the question and answer join.

The append-only cache is one pool per layer (`AppendPolicy(pooled=True)`): the kept context as
a dense prefix of Hkv·n slots (heads in any shares), then Hkv slots per question or answer token,
so the layer's K/V bytes are the kept tokens' plus the room's, as in the generate loop.

Every step is jitted on shapes fixed by the context's length and the budget, never by the
heads' shares (which differ per sample): an evaluation grid compiles them once per cell, not once
per sample and layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.cache import Cache, CacheSpec, LayerCache, init_cache
from kvjax.policies import adakv_keep

Array = jax.Array


@jax.jit
def pooled_top_mask(scores: Array, n: Array | int, n_safe: Array | int) -> Array:
    """AdaKV's allocation of H·n slots over scores [B, H, S] float (each head's top `n_safe`
    first, then the top scores over all heads; `adakv_keep`): [B, H, S] bool, the kept slots."""
    b, h, s = scores.shape
    head = jnp.broadcast_to(jnp.repeat(jnp.arange(h, dtype=jnp.int32), s), (b, h * s))
    everything = jnp.ones((b, h * s), bool)
    keep = adakv_keep(
        scores.reshape(b, h * s).astype(jnp.float32), head, ~everything, everything,
        h, n_safe, h * n,
    )  # fmt: skip
    return keep.reshape(b, h, s)


def pool_append_cache(
    config, layers, keep, room: int, length: int, dtype, min_slots: int = 0
) -> tuple[Cache, tuple[int, ...], tuple[int, ...]]:
    """The pooled append-only cache: per layer the kept tokens of its per-head or pooled
    `layers` as a dense prefix of one pool (head-major, each head in position order), then
    H·room free slots (the pool rounded up to a multiple of H), or up to H·min_slots in all.

    Args:
        layers: batch-1 layers, per-head (a full cache) or pooled (adakv's).
        keep: per layer [1, H, S] bool, the kept slots of a per-head layer, or None: every
            occupied slot of a pooled layer.

    Returns:
        (cache, mean slots per KV head of each layer, kept tokens per KV head of each layer (the
        layer's total over H, floored)).
    """
    h = config.num_kv_heads
    # One device-to-host copy of the counts: they size the pools (static shapes).
    counts = jax.device_get([_kept_count(ly, k) for ly, k in zip(layers, keep, strict=True)])
    slots = tuple(max(-(-(int(n) + h * room) // h), min_slots) for n in counts)
    spec = CacheSpec(
        batch=1, num_kv_heads=h, head_dim=config.head_dim, capacities=slots, dtype=dtype,
        pooled=True,
    )  # fmt: skip
    out = tuple(
        _fill_pool(empty, ly, k)
        for ly, k, empty in zip(layers, keep, init_cache(spec).layers, strict=True)
    )
    cache = Cache(layers=out, length=jnp.asarray([length], jnp.int32))
    return cache, slots, tuple(int(n) // h for n in counts)


def _candidates(layer: LayerCache, keep: Array | None) -> tuple[Array, Array, Array, Array]:
    """A batch-1 layer's slots as one flat list of X candidates: k, v [X, D], pos [X] int32
    (-1 = not kept), head [X] int32; X = H·S per-head slots or the pool's P."""
    if keep is None:  # a pool: its occupied slots are the kept ones
        return layer.k[0, 0], layer.v[0, 0], layer.pos[0, 0], layer.head[0, 0]
    _, h, s, d = layer.k.shape
    pos = jnp.where(keep, layer.pos, -1)[0].reshape(h * s)
    head = jnp.repeat(jnp.arange(h, dtype=jnp.int32), s)
    return layer.k[0].reshape(h * s, d), layer.v[0].reshape(h * s, d), pos, head


@jax.jit
def _kept_count(layer: LayerCache, keep: Array | None) -> Array:
    """[] int32: the layer's kept tokens over all its KV heads."""
    return jnp.sum(_candidates(layer, keep)[2] >= 0, dtype=jnp.int32)


@jax.jit
def _fill_pool(empty: LayerCache, layer: LayerCache, keep: Array | None) -> LayerCache:
    """The empty pooled layer [1, 1, P] with `layer`'s kept tokens as its prefix, head-major
    and each head in position order (a head holds a position once); the rest stays empty."""
    k, v, pos, head = _candidates(layer, keep)
    order = jnp.lexsort((pos, head, pos < 0))  # kept first, then by head, then by position
    p, x = empty.pos.shape[-1], pos.shape[0]
    order = order[:p] if x >= p else jnp.pad(order, (0, p - x), constant_values=x)
    kept = jnp.take(pos, order, mode="fill", fill_value=-1) >= 0  # [P]; past X: empty
    pick = lambda a, fill: jnp.where(
        kept.reshape(kept.shape + (1,) * (a.ndim - 1)), jnp.take(a, order, axis=0, mode="clip"),
        fill,
    )  # fmt: skip
    return empty.replace(
        k=pick(k, 0).astype(empty.k.dtype)[None, None],
        v=pick(v, 0).astype(empty.v.dtype)[None, None],
        pos=pick(pos, -1)[None, None],
        head=pick(head, 0)[None, None],
    )
