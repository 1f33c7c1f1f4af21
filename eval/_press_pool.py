"""adakv in the compress-once mode: AdaKV's allocation over a press's scores, each KV head's
kept slots of a pooled cache, and the pooled append-only cache the question and answer join.

The append-only cache is one pool per layer (`AppendPolicy(pooled=True)`): the kept context as
a dense prefix of Hkv·n slots (heads in any shares), then Hkv slots per question or answer token,
so the layer's K/V bytes are the kept tokens' plus the room's, as in the generate loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import Cache, CacheSpec, init_cache
from kvjax.policies import adakv_keep

Array = jax.Array


def pooled_top_slots(scores: Array, n: int, n_safe: int) -> Array:
    """AdaKV's allocation of H·n slots over scores [B, H, S] (each head's top `n_safe` first,
    then the top scores over all heads; `adakv_keep`): [B, H, m] each head's kept slots in
    slot order, m = the largest share, -1 after a head's last."""
    b, h, s = scores.shape
    head = jnp.broadcast_to(jnp.repeat(jnp.arange(h, dtype=jnp.int32), s), (b, h * s))
    everything = jnp.ones((b, h * s), bool)
    keep = adakv_keep(
        scores.reshape(b, h * s).astype(jnp.float32), head, ~everything, everything,
        h, n_safe, h * n,
    ).reshape(b, h, s)  # fmt: skip
    m = int(jnp.max(jnp.sum(keep, axis=-1)))
    slot = jnp.where(keep, jnp.arange(s, dtype=jnp.int32), s)
    order = jnp.sort(slot, axis=-1)[..., :m]
    return jnp.where(order < s, order, -1)


def pool_slots(pos: Array, head: Array, heads: int) -> Array:
    """A pooled layer's pos, head [B, 1, P] → [B, H, m] each KV head's pool slots ordered by
    position, m = the largest share, -1 after a head's last."""
    mine = (head == jnp.arange(heads, dtype=jnp.int32)[None, :, None]) & (pos >= 0)
    m = int(jnp.max(jnp.sum(mine, axis=-1)))
    key = jnp.where(mine, pos, jnp.iinfo(jnp.int32).max)
    order = jnp.argsort(key, axis=-1, stable=True)[..., :m]
    return jnp.where(jnp.take_along_axis(mine, order, -1), order, -1)


def pool_append_cache(config, layers, keep, room: int, length: int, dtype, min_slots: int = 0):
    """The pooled append-only cache: per layer the slots `keep` [1, H, m] (-1 = none) of its
    per-head or pooled `layers` as a dense prefix of one pool, then H·room free slots (the pool
    rounded up to a multiple of H), or up to H·min_slots in all. Returns (cache, mean slots
    per KV head of each layer, kept tokens per KV head of each layer (the layer's total over H,
    floored))."""
    h = config.num_kv_heads
    parts, slots, kept = [], [], []
    for ly, idx in zip(layers, keep, strict=True):
        safe = jnp.maximum(idx, 0)

        def take(a, safe=safe):
            a = jnp.broadcast_to(a, (a.shape[0], h, *a.shape[2:]))
            return jnp.take_along_axis(a, safe.reshape(safe.shape + (1,) * (a.ndim - 3)), 2)

        pos = np.asarray(jnp.where(idx >= 0, take(ly.pos), -1))[0]  # [H, m]
        hh, jj = np.nonzero(pos >= 0)  # head-major, each head in position order
        parts.append((take(ly.k)[0, hh, jj], take(ly.v)[0, hh, jj], pos[hh, jj], hh))
        slots.append(max(-(-(hh.size + h * room) // h), min_slots))
        kept.append(hh.size // h)
    spec = CacheSpec(
        batch=1, num_kv_heads=h, head_dim=config.head_dim, capacities=tuple(slots), dtype=dtype,
        pooled=True,
    )  # fmt: skip
    out = []
    for (k, v, pos, head), empty in zip(parts, init_cache(spec).layers, strict=True):
        n = pos.size
        out.append(
            empty.replace(
                k=empty.k.at[0, 0, :n].set(k.astype(empty.k.dtype)),
                v=empty.v.at[0, 0, :n].set(v.astype(empty.v.dtype)),
                pos=empty.pos.at[0, 0, :n].set(jnp.asarray(pos, jnp.int32)),
                head=empty.head.at[0, 0, :n].set(jnp.asarray(head, jnp.int32)),
            )
        )
    cache = Cache(layers=tuple(out), length=jnp.asarray([length], jnp.int32))
    return cache, tuple(slots), tuple(kept)
