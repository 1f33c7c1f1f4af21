"""The low-bit tier's layout for the Mosaic GPU kernel (`ChannelMajorLowBitTier`), from the
token-major `LowBitTier` that kvjax's cache holds.

Three changes, each for the kernel's tokens-on-M dots (docs/decisions.md): values packed along
a page's tokens, so that the A operand V^T [channels, tokens] of the PV dot unpacks in place;
every byte XOR 0x80, so that masking a code slice and reading it as int8 is linear (8-bit
shifts do not lower in Mosaic GPU, masks do); statistics pre-multiplied per code slice
(`kernel_stats`), so that the kernel does no arithmetic on them.

`native=True` stores the codes as JAX `int4` arrays instead, which Mosaic GPU converts to
bfloat16 without a conversion instruction (a byte permute, a mask-or and a bfloat16 subtract
for two values), where the byte layout above needs an int8 → bfloat16 conversion per value. The
same scheme one level down: a nibble holds 4/bits code slices (4 bits: one code; 2 bits: channel
c and c + D/2 of a key, channel c and c + 64 of a value), every nibble XOR 8 so that a masked
top slice read as signed int4 is linear, statistics per slice by `kernel_stats`. Keys
[.., Tp, D·bits/4], values [.., D·bits/4, Tp]; at 2 bits D = 128 with value groups of 64.

`words=True` stores each page's codes as 32-bit words in the order of the dots' registers
(`word_source`): thread t of the warpgroup finds the codes of its wgmma A fragment in words it
reads with one 128-bit load each, and turns a pair of them into the two bfloat16 values of a
register with one AND-OR (a LOP3) and, for every other pair, a shift: the code lies in the low
mantissa bits of bfloat16 128.0 (0x4300), so the value is 128 + code·2^pos, pos the code's
place in its half-word. The kernel takes the 128 back out through the statistics (as for
`int4_offset`) and the power of two through kernel-ready statistics: key zeros times 2^pos of
their channel (the kernel divides q by it), value scales divided by 2^pos of their token. Keys
and values [.., D·bits/64, 128] uint32; needs D·bits a multiple of 256.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.pallas_kernels.decode_attention._reference import unpack_codes
from kvjax.pallas_kernels.decode_attention._tiers import ChannelMajorLowBitTier, LowBitTier
from kvjax.quant._words_layout import pack_words, word_factor  # the placement: array math

Array = jax.Array
PAGE = 64  # tokens per page: the rows of a warpgroup dot
SIGN = 0x80  # XOR of every stored byte: the top code slice is held sign-flipped


def _pack_split(codes: Array, n: int, bits: int, axis: int) -> Array:
    """Codes (an integer dtype) packed n a word along `axis`: the axis split in n sub-blocks,
    sub-block i at bits i·bits of each word."""
    parts = jnp.split(codes, n, axis=axis)
    out = parts[0]
    for i in range(1, n):
        out = out | (parts[i] << codes.dtype.type(i * bits))
    return out


def _pack_tokens(codes: Array, bits: int) -> Array:
    """[..., T, D] codes → [..., D, T·bits/8] packed along T (sub-block i = bits at i·bits)."""
    ct = jnp.swapaxes(codes, -1, -2).astype(jnp.uint8)  # [..., D, T]
    return _pack_split(ct, 8 // bits, bits, axis=-1)


def kernel_stats(
    scale: Array, zero: Array, slice_of: Array, bits: int, slices: int | None = None
) -> Array:
    """(scale, zero) as the kernel applies them to `_slice`'s values, stacked on a new axis -2,
    bfloat16: scale·2^-(c·bits) and zero (+ 2^(bits-1)·scale for the top slice, whose codes
    are stored sign-flipped). Computed in float32 and rounded once.

    Args:
        scale, zero: [..., N] float statistics of N channels (keys) or tokens (values).
        slice_of: [N] int32, the code slice c that each of the N lies in.
        bits: 2 or 4.
        slices: code slices a stored word (8/bits a byte, the default; 4/bits a nibble).
    """
    scale, zero = scale.astype(jnp.float32), zero.astype(jnp.float32)
    lead = (1,) * (scale.ndim - 1)
    top = (slice_of == (slices or 8 // bits) - 1).astype(jnp.float32).reshape(*lead, -1)
    s = scale * jnp.exp2(-(slice_of * bits).astype(jnp.float32)).reshape(*lead, -1)
    z = zero + top * float(1 << (bits - 1)) * scale
    return jnp.stack([s, z], axis=-2).astype(jnp.bfloat16)


NIBBLE_SIGN = 8  # XOR of every stored int4 code: its top code slice held sign-flipped


def _nibbles(codes: Array, bits: int, axis: int) -> Array:
    """Unsigned codes → int4 codes, 4/bits of them a nibble: slice i of `axis` (split in
    4/bits) at bits i·bits, every nibble XOR 8 and read as signed (so the top slice is linear
    in its code, as `SIGN` does for bytes)."""
    nib = _pack_split(codes.astype(jnp.int8), 4 // bits, bits, axis) ^ jnp.int8(NIBBLE_SIGN)
    return jnp.where(nib >= 8, nib - 16, nib).astype(jnp.int4)


def _native(tier: LowBitTier, bits: int) -> ChannelMajorLowBitTier:
    """`to_channel_major(native=True)`: the codes as int4 arrays (module docstring)."""
    d = tier.k_scale.shape[-1]
    ng = tier.v_scale.shape[-1]
    n = 4 // bits  # code slices a nibble
    if bits == 2 and (d != 128 or ng != 2):
        raise ValueError(
            "to_channel_major(native=True) at 2 bits needs D = 128 and value groups of 64 "
            f"channels (each 64-channel half one slice of a nibble), got D={d} and {ng} groups"
        )
    kcodes = unpack_codes(tier.k, bits)  # [B, Hkv, P, Tp, D]
    vcodes = jnp.swapaxes(unpack_codes(tier.v, bits), -1, -2)  # [B, Hkv, P, D, Tp]
    chan = jnp.arange(d, dtype=jnp.int32) // (d // n)
    # Values: at 4 bits the whole page; at 2 bits a nibble holds channel c and c + 64 (the
    # kernel's two 64-channel halves, each its own value group: slice = group).
    vslice = jnp.zeros((ng,), jnp.int32) if n == 1 else jnp.arange(ng, dtype=jnp.int32)
    v_stats = kernel_stats(tier.v_scale, tier.v_zero, vslice, bits, slices=n)  # [.., Tp, 2, NG]
    return ChannelMajorLowBitTier(
        _nibbles(kcodes, bits, axis=-1),  # [B, Hkv, P, Tp, D·bits/4]
        _nibbles(vcodes, bits, axis=-2),  # [B, Hkv, P, D·bits/4, Tp]
        kernel_stats(tier.k_scale, tier.k_zero, chan, bits, slices=n),  # [B, Hkv, P, 2, D]
        jnp.moveaxis(v_stats, -3, -1),  # [.., Tp, 2, NG] → [B, Hkv, P, 2, NG, Tp]
        tier.pos,
        tier.extent,
    )


def to_channel_major(
    tier: LowBitTier, bits: int, *, native: bool = False, words: bool = False
) -> ChannelMajorLowBitTier:
    """The same tokens and codes in the Mosaic GPU kernel's layout, statistics kernel-ready
    (`native`: int4 arrays; `words`: 32-bit words in the dots' register order; module
    docstring)."""
    if native and words:
        raise ValueError("to_channel_major: native and words are two layouts; pick one")
    if words:
        return _words(tier, bits)
    if native:
        return _native(tier, bits)
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


def _words(tier: LowBitTier, bits: int) -> ChannelMajorLowBitTier:
    """`to_channel_major(words=True)` (module docstring)."""
    d = tier.k_scale.shape[-1]
    if (d * bits) % 256:
        raise ValueError(
            f"to_channel_major(words=True) needs D·bits a multiple of 256 (whole 128-bit loads "
            f"a thread), got D={d} at {bits} bits"
        )
    kcodes = unpack_codes(tier.k, bits)  # [B, Hkv, P, Tp, D]
    vcodes = jnp.swapaxes(unpack_codes(tier.v, bits), -1, -2)  # [B, Hkv, P, D, Tp]
    vt = vcodes.reshape(*vcodes.shape[:3], d // 64, 64, vcodes.shape[-1])  # 64-channel halves
    kf = jnp.asarray(word_factor(bits, d))  # per key channel
    vf = jnp.asarray(word_factor(bits, vcodes.shape[-1]))  # per token
    f32 = jnp.float32
    k_stats = jnp.stack(
        [tier.k_scale.astype(f32), tier.k_zero.astype(f32) * kf[None, None, None]], axis=-2
    ).astype(jnp.bfloat16)  # [B, Hkv, P, 2, D]
    vsc, vze = (jnp.swapaxes(x, -1, -2).astype(f32) for x in (tier.v_scale, tier.v_zero))
    v_stats = jnp.stack([vsc / vf[None, None, None, None], vze], axis=-3)  # [B, Hkv, P, 2, NG, Tp]
    v_stats = v_stats.astype(jnp.bfloat16)
    return ChannelMajorLowBitTier(
        pack_words(kcodes[..., None, :, :], bits),
        pack_words(vt, bits),
        k_stats,
        v_stats,
        tier.pos,
        tier.extent,
    )
