"""Plain-jnp attention over the slot cache plus this call's new tokens (the reference path).

Quantized tiers are dequantized in XLA and attended together with the full-precision slots in one
softmax; the Pallas kernels fuse that dequantization into their loads instead. A pooled layer
(`CacheSpec.pooled`: one pool of slots shared by the KV heads, each slot carrying its head) is
read once for all heads, each head's queries masked to the slots it owns.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from kvjax._numerics import einsum_f32
from kvjax.attention._types import AttnStats, KeyShift, turn_keys
from kvjax.cache import LayerCache
from kvjax.quant import dequantize_int8

Array = jax.Array

_NEG = -1e30


def attend_xla(
    q: Array,
    layer: LayerCache,
    k_new: Array,
    v_new: Array,
    q_pos: Array,
    new_valid: Array,
    query_weight: Array,
    *,
    scale: float,
    key_shift: KeyShift | None = None,
    rotate: Callable[[Array, Array], Array] | None = None,
) -> tuple[Array, AttnStats]:
    """Softmax attention of T queries over [full slots ‖ INT8 slots ‖ low-bit ‖ new tokens].

    Args:
        q: [B, T, Hq, D] queries (after RoPE).
        layer: the layer's cache (slots hold only tokens before this call's tokens).
        k_new: [B, T, Hkv, D] keys of this call's tokens (after RoPE).
        v_new: [B, T, Hkv, D] values of this call's tokens.
        q_pos: [B, T] int32 positions of the queries (= positions of the new tokens).
        new_valid: [B, T] bool, token is real (not padding).
        query_weight: [B, T] float32 weight of each query in the returned mass.
        scale: logit scale (1/sqrt(D) usually).
        key_shift: None, or positions by which each cached key (every tier; the INT8 and
            low-bit ones after dequantization) is turned before it is scored, by `rotate`
            (the model's RoPE). This call's own keys are never turned; masks stay on the
            original positions.
        rotate: `rotate(x [B, T, H, D], by [B, T])`, needed with `key_shift`.

    Returns:
        out [B, T, Hq, D] in q's dtype, and AttnStats.
    """
    b, t, hq, d = q.shape
    hkv = layer.num_kv_heads
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    qpos = q_pos[:, None, None, :, None]  # [B, 1, 1, T, 1]
    # Segments of keys: (keys [B, Hkv, S, D], values, positions [B, Hkv, S]); a pooled layer's
    # keys/values are [B, 1, P, D], shared by every head (its `owner` mask picks each head's).
    turn = lambda k, by: k if key_shift is None else turn_keys(k, by, rotate)
    if key_shift is not None and (rotate is None or layer.head is not None):
        raise ValueError("key_shift needs `rotate` and a per-head (not pooled) cache layer")
    shift = KeyShift(full=None) if key_shift is None else key_shift
    cache_segs = [(turn(layer.k, shift.full), layer.v, layer.pos)]
    owner = None
    if layer.head is not None:  # [B, Hkv, 1, 1, P]: the slot belongs to this KV head
        heads = jnp.arange(hkv, dtype=jnp.int32)[None, :, None, None, None]
        owner = layer.head[:, :, None, None, :] == heads
    if layer.int8 is not None:
        t8 = layer.int8
        cache_segs.append(
            (
                turn(dequantize_int8(t8.k, t8.k_scale, q.dtype), shift.int8),
                dequantize_int8(t8.v, t8.v_scale, q.dtype),
                t8.pos,
            )
        )
    if layer.lowbit is not None:
        lb = layer.lowbit
        b_, h_, p_, g_ = lb.pos.shape
        k8, v8 = lb.dequantize(q.dtype)  # [B, Hkv, P, G, D], either layout
        flat = lambda x: x.reshape(b_, h_, p_ * g_, *x.shape[4:])
        by = None if shift.lowbit is None else shift.lowbit.reshape(b_, h_, p_ * g_)
        cache_segs.append((turn(flat(k8), by), flat(v8), lb.pos.reshape(b_, h_, p_ * g_)))
    scores, masks = [], []
    for k, _, pos in cache_segs:
        if k.shape[1] == hkv:
            scores.append(einsum_f32("bthgd,bhcd->bhgtc", qg, k) * scale)
        else:  # the pool: its keys read once, scored against every head's queries
            scores.append(einsum_f32("bthgd,bcd->bhgtc", qg, k[:, 0]) * scale)
        p = pos[:, :, None, None, :]
        masks.append((p >= 0) & (p <= qpos))  # occupied and not after the query
    if owner is not None:
        masks[0] = masks[0] & owner
    scores.append(einsum_f32("bthgd,bshd->bhgts", qg, k_new) * scale)
    masks.append(
        new_valid[:, None, None, None, :] & (q_pos[:, None, None, None, :] <= qpos)
    )  # causal within the call
    scores = [jnp.where(m, s, _NEG) for s, m in zip(scores, masks, strict=True)]
    m = scores[0].max(axis=-1)
    for s in scores[1:]:
        m = jnp.maximum(m, s.max(axis=-1))  # [B, Hkv, G, T]
    probs = [jnp.exp(s - m[..., None]) for s in scores]
    denom = sum(p.sum(axis=-1) for p in probs)
    probs = [p / denom[..., None] for p in probs]
    out = sum(
        einsum_f32("bhgtc,bhcd->bthgd", p.astype(v.dtype), v)
        if v.shape[1] == hkv
        else einsum_f32("bhgtc,bcd->bthgd", p.astype(v.dtype), v[:, 0])
        for p, (_, v, _) in zip(probs[:-1], cache_segs, strict=True)
    )
    out = out + einsum_f32("bhgts,bshd->bthgd", probs[-1].astype(v_new.dtype), v_new)
    w = query_weight.astype(jnp.float32)[:, None, None, :, None]  # [B, 1, 1, T, 1]
    mass = [jnp.sum(p * w, axis=(2, 3)) for p in probs]
    if owner is not None:  # a pool slot's mass comes from its own head only (others are 0)
        mass[0] = jnp.sum(mass[0], axis=1, keepdims=True)  # [B, 1, P]
    tiers = iter(mass[1:-1])
    int8_mass = next(tiers) if layer.int8 is not None else None
    lowbit_mass = next(tiers).reshape(layer.lowbit.pos.shape) if layer.lowbit is not None else None
    stats = AttnStats(
        slot_mass=mass[0],
        new_mass=mass[-1],
        lse=jnp.transpose(m + jnp.log(denom), (0, 3, 1, 2)).reshape(b, t, hq),
        int8_mass=int8_mass,
        lowbit_mass=lowbit_mass,
    )
    return out.reshape(b, t, hq, d).astype(q.dtype), stats
