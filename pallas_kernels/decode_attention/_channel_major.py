"""The low-bit tier's layout for the Mosaic GPU kernel (`ChannelMajorLowBitTier`), from the
token-major `LowBitTier` that kvjax's cache holds.

Three changes, each for the kernel's tokens-on-M dots (docs/decisions.md): values packed along
a page's tokens, so that the A operand V^T [channels, tokens] of the PV dot unpacks in place;
every byte XOR 0x80, so that masking a code slice and reading it as int8 is linear (8-bit
shifts do not lower in Mosaic GPU, masks do); statistics pre-multiplied per code slice
(`kernel_stats`), so that the kernel does no arithmetic on them.

`native=True` (4 bits only) stores the codes as JAX `int4` arrays instead: keys [.., Tp, D] and
values [.., D, Tp] two to a byte in their natural order, each code minus 8 (so the signed value
is linear in it), the statistics (scale, zero + 8·scale). Mosaic GPU converts int4 registers to
bfloat16 without a conversion instruction (a byte permute, a mask-or and a bfloat16 subtract
for two values), where the byte layout above needs an int8 → bfloat16 conversion per value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.pallas_kernels.decode_attention._reference import unpack_codes
from kvjax.pallas_kernels.decode_attention._tiers import ChannelMajorLowBitTier, LowBitTier

Array = jax.Array
PAGE = 64  # tokens per page: the rows of a warpgroup dot
SIGN = 0x80  # XOR of every stored byte: the top code slice is held sign-flipped


def _pack_tokens(codes: Array, bits: int) -> Array:
    """[..., T, D] codes → [..., D, T·bits/8] packed along T (sub-block i = bits at i·bits)."""
    ct = jnp.swapaxes(codes, -1, -2).astype(jnp.uint8)  # [..., D, T]
    parts = jnp.split(ct, 8 // bits, axis=-1)
    out = parts[0]
    for i in range(1, len(parts)):
        out = out | (parts[i] << jnp.uint8(i * bits))
    return out


def kernel_stats(scale: Array, zero: Array, slice_of: Array, bits: int) -> Array:
    """(scale, zero) as the kernel applies them to `_slice`'s values, stacked on a new axis -2,
    bfloat16: scale·2^-(c·bits) and zero (+ 2^(bits-1)·scale for the top slice, whose codes
    are stored sign-flipped). Computed in float32 and rounded once.

    Args:
        scale, zero: [..., N] float statistics of N channels (keys) or tokens (values).
        slice_of: [N] int32, the code slice c that each of the N lies in.
        bits: 2 or 4.
    """
    scale, zero = scale.astype(jnp.float32), zero.astype(jnp.float32)
    lead = (1,) * (scale.ndim - 1)
    top = (slice_of == 8 // bits - 1).astype(jnp.float32).reshape(*lead, -1)
    s = scale * jnp.exp2(-(slice_of * bits).astype(jnp.float32)).reshape(*lead, -1)
    z = zero + top * float(1 << (bits - 1)) * scale
    return jnp.stack([s, z], axis=-2).astype(jnp.bfloat16)


def native_stats(scale: Array, zero: Array, bits: int) -> Array:
    """(scale, zero + 2^(bits-1)·scale) stacked on a new axis -2, bfloat16: the statistics of
    codes stored minus 2^(bits-1) (signed), computed in float32 and rounded once."""
    scale, zero = scale.astype(jnp.float32), zero.astype(jnp.float32)
    return jnp.stack([scale, zero + float(1 << (bits - 1)) * scale], axis=-2).astype(jnp.bfloat16)


def _native_codes(codes: Array, bits: int) -> Array:
    """Unsigned codes → signed int4 codes minus 2^(bits-1)."""
    return (codes.astype(jnp.int8) - jnp.int8(1 << (bits - 1))).astype(jnp.int4)


def to_channel_major(
    tier: LowBitTier, bits: int, *, native: bool = False
) -> ChannelMajorLowBitTier:
    """The same tokens and codes in the Mosaic GPU kernel's layout, statistics kernel-ready
    (`native`: int4 arrays, 4 bits only; module docstring)."""
    if native:
        if bits != 4:
            raise ValueError(
                f"to_channel_major(native=True) stores int4 codes: bits must be 4, not {bits}"
            )
        kcodes = unpack_codes(tier.k, bits)  # [B, Hkv, P, Tp, D]
        vcodes = jnp.swapaxes(unpack_codes(tier.v, bits), -1, -2)  # [B, Hkv, P, D, Tp]
        vsc, vze = (jnp.swapaxes(x, -1, -2) for x in (tier.v_scale, tier.v_zero))  # [.., NG, Tp]
        return ChannelMajorLowBitTier(
            _native_codes(kcodes, bits),
            _native_codes(vcodes, bits),
            native_stats(tier.k_scale, tier.k_zero, bits),
            jnp.swapaxes(native_stats(vsc, vze, bits), -2, -3),
            tier.pos,
            tier.extent,
        )
    d, tp = tier.k_scale.shape[-1], tier.k.shape[3]
    n = 8 // bits
    chan = jnp.arange(d, dtype=jnp.int32) // (d // n)
    tok = jnp.arange(tp, dtype=jnp.int32) // (tp // n)
    vcodes = unpack_codes(tier.v, bits).astype(jnp.uint8)  # [B, Hkv, P, Tp, D]
    k_stats = kernel_stats(tier.k_scale, tier.k_zero, chan, bits)  # [B, Hkv, P, 2, D]
    vsc, vze = (jnp.swapaxes(x, -1, -2) for x in (tier.v_scale, tier.v_zero))  # [.., NG, Tp]
    v_stats = jnp.swapaxes(kernel_stats(vsc, vze, tok, bits), -2, -3)  # [B, Hkv, P, 2, NG, Tp]
    sign = jnp.uint8(SIGN)
    return ChannelMajorLowBitTier(
        tier.k ^ sign, _pack_tokens(vcodes, bits) ^ sign, k_stats, v_stats, tier.pos, tier.extent
    )
