"""Plain-jnp attention over the slot cache plus this call's new tokens (the reference path)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax._numerics import einsum_f32
from kvjax.attention._types import AttnStats
from kvjax.cache import LayerCache

Array = jax.Array

_NEG = -1e30


def attend_xla(q: Array, layer: LayerCache, k_new: Array, v_new: Array, q_pos: Array,
               new_valid: Array, query_weight: Array, *, scale: float) -> tuple[Array, AttnStats]:
    """Softmax attention of T queries over [cache slots ‖ new tokens].

    Args:
        q: [B, T, Hq, D] queries (after RoPE).
        layer: the layer's cache (slots hold only tokens before this call's tokens).
        k_new: [B, T, Hkv, D] keys of this call's tokens (after RoPE).
        v_new: [B, T, Hkv, D] values of this call's tokens.
        q_pos: [B, T] int32 positions of the queries (= positions of the new tokens).
        new_valid: [B, T] bool, token is real (not padding).
        query_weight: [B, T] float32 weight of each query in the returned mass.
        scale: logit scale (1/sqrt(D) usually).

    Returns:
        out [B, T, Hq, D] in q's dtype, and AttnStats.
    """
    b, t, hq, d = q.shape
    hkv = layer.k.shape[1]
    g = hq // hkv
    qg = q.reshape(b, t, hkv, g, d)
    f32 = jnp.float32
    s_cache = einsum_f32("bthgd,bhcd->bhgtc", qg, layer.k) * scale
    s_new = einsum_f32("bthgd,bshd->bhgts", qg, k_new) * scale
    # [B, Hkv, 1, T, C]: a slot is visible if occupied and not after the query.
    vis_cache = (layer.pos[:, :, None, None, :] >= 0) & (
        layer.pos[:, :, None, None, :] <= q_pos[:, None, None, :, None])
    # [B, 1, 1, T, S]: a new token is visible if real and not after the query (causal).
    vis_new = new_valid[:, None, None, None, :] & (
        q_pos[:, None, None, None, :] <= q_pos[:, None, None, :, None])
    s_cache = jnp.where(vis_cache, s_cache, _NEG)
    s_new = jnp.where(vis_new, s_new, _NEG)
    m = jnp.maximum(jnp.max(s_cache, axis=-1), jnp.max(s_new, axis=-1))  # [B, Hkv, G, T]
    p_cache = jnp.exp(s_cache - m[..., None])
    p_new = jnp.exp(s_new - m[..., None])
    denom = jnp.sum(p_cache, axis=-1) + jnp.sum(p_new, axis=-1)  # [B, Hkv, G, T]
    p_cache = p_cache / denom[..., None]
    p_new = p_new / denom[..., None]
    out = (einsum_f32("bhgtc,bhcd->bthgd", p_cache.astype(layer.v.dtype), layer.v)
           + einsum_f32("bhgts,bshd->bthgd", p_new.astype(v_new.dtype), v_new))
    w = query_weight.astype(f32)[:, None, None, :, None]  # [B, 1, 1, T, 1]
    stats = AttnStats(
        slot_mass=jnp.sum(p_cache * w, axis=(2, 3)),
        new_mass=jnp.sum(p_new * w, axis=(2, 3)),
        lse=jnp.transpose(m + jnp.log(denom), (0, 3, 1, 2)).reshape(b, t, hq),
    )
    return out.reshape(b, t, hq, d).astype(q.dtype), stats
