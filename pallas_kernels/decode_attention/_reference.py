"""Plain-jnp reference of the decode kernels (float32): dequantize every tier, one softmax.

Every backend variant computes this same function, so they share it: `decode_attention_reference`
is the `*_reference` of `_triton.py`, `_triton_lowbit.py` and `_tpu.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.pallas_kernels.decode_attention._tiers import FullTier, Int8Tier, LowBitTier

Array = jax.Array
_HI = jax.lax.Precision.HIGHEST


def unpack_codes(packed: Array, bits: int) -> Array:
    """[..., Dp] uint8 → [..., Dp·8/bits] float32 codes (sub-block i = bits at i·bits)."""
    mask = (1 << bits) - 1
    blocks = [(packed >> (i * bits)) & mask for i in range(8 // bits)]
    return jnp.concatenate(blocks, axis=-1).astype(jnp.float32)


def _visible(pos: Array, extent: Array, q_pos: Array) -> Array:
    idx = jnp.arange(pos.shape[-1], dtype=jnp.int32)
    return (pos >= 0) & (pos <= q_pos[:, None, None]) & (idx < extent[..., None])


def _dequantized(full, int8, lowbit, bits, q_pos):
    """[(k [B, Hkv, N, D] f32, v, visible [B, Hkv, N])] per given tier."""
    segs = [
        (
            full.k.astype(jnp.float32),
            full.v.astype(jnp.float32),
            _visible(full.pos, full.extent, q_pos),
        )
    ]
    if int8 is not None:
        k = int8.k.astype(jnp.float32) * int8.k_scale[..., None]
        v = int8.v.astype(jnp.float32) * int8.v_scale[..., None]
        segs.append((k, v, _visible(int8.pos, int8.extent, q_pos)))
    if lowbit is not None:
        b, h, p, tp, _ = lowbit.k.shape
        k = (
            unpack_codes(lowbit.k, bits) * lowbit.k_scale[:, :, :, None]
            + lowbit.k_zero[:, :, :, None]
        )
        vc = unpack_codes(lowbit.v, bits)
        ng = lowbit.v_scale.shape[-1]
        vc = vc.reshape(b, h, p, tp, ng, -1)
        v = vc * lowbit.v_scale[..., None] + lowbit.v_zero[..., None]
        page_seen = jnp.arange(p, dtype=jnp.int32)[:, None] < lowbit.extent[..., None, None]
        seen = (lowbit.pos >= 0) & (lowbit.pos <= q_pos[:, None, None, None]) & page_seen
        flat = lambda x: x.reshape(b, h, p * tp, *x.shape[4:])
        segs.append((flat(k), v.reshape(b, h, p * tp, -1), flat(seen)))
    return segs


def decode_attention_reference(
    q: Array,
    q_pos: Array,
    *,
    full: FullTier,
    int8: Int8Tier | None = None,
    lowbit: LowBitTier | None = None,
    bits: int = 2,
    scale: float,
) -> tuple[Array, Array, tuple[Array, ...]]:
    """One decode query per sequence over all given tiers, in float32.

    Args:
        q: [B, Hkv, G, D] queries grouped by KV head.
        q_pos: [B] int32 query positions.
        full, int8, lowbit: the tiers (see _tiers.py).
        bits: code width of the low-bit tier.
        scale: logit scale.

    Returns:
        out [B, Hkv, G, D] float32, lse [B, Hkv, G] float32, and per given tier its scaled logits
        [B, Hkv, G, N] float32 (-inf where not visible).
    """
    qf = q.astype(jnp.float32)
    logits, values = [], []
    for k, v, seen in _dequantized(full, int8, lowbit, bits, q_pos):
        s = jnp.einsum("bhgd,bhnd->bhgn", qf, k, precision=_HI) * scale
        logits.append(jnp.where(seen[:, :, None, :], s, -jnp.inf))
        values.append(v)
    s = jnp.concatenate(logits, axis=-1)
    m = jnp.max(s, axis=-1)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m[..., None])
    den = jnp.sum(p, axis=-1)
    has = den > 0
    out = jnp.einsum("bhgn,bhnd->bhgd", p, jnp.concatenate(values, axis=2), precision=_HI)
    out = out / jnp.where(has, den, 1.0)[..., None]
    lse = jnp.where(has, m + jnp.log(jnp.where(has, den, 1.0)), -jnp.inf)
    return out, lse, tuple(logits)
