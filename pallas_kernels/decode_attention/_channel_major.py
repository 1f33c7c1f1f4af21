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
import numpy as np

from kvjax.pallas_kernels.decode_attention._reference import unpack_codes
from kvjax.pallas_kernels.decode_attention._tiers import ChannelMajorLowBitTier, LowBitTier

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


WORD_BASE = 128.0  # what the words layout's conversion adds to a code: bfloat16 0x4300


def _word_place(bits: int, k: int, rows=None, cols=None) -> tuple:
    """Where each code of a [64, k] wgmma A tile lies in the words layout: (thread, the
    thread's word j, shift window sh, place pos), each [64, k] (numpy; or of the given row and
    column index arrays, numpy or jnp alike).

    Register (k8, r2) of thread t = 32·warp + lane holds row 16·warp + 8·r2 + lane // 4 and
    columns 8·k8 + 2·(lane % 4) + e, e = 0, 1 (the wgmma fragment). Its pair of codes sits in
    word j at bits 4·sh + pos (e = 0) and 16 + 4·sh + pos (e = 1): 2 bits: four k8 a word, the
    rows' two halves r2 in neighbouring windows, pos = 2·(k8 mod 2); 4 bits: two k8 a word,
    pos = 0. A window holds one pair (4 bits) or two (2 bits) within the 7 mantissa bits."""
    if rows is None:
        rows, cols = np.meshgrid(np.arange(64), np.arange(k), indexing="ij")
    warp, r2 = rows // 16, (rows % 16) // 8
    lane = (rows % 8) * 4 + (cols % 8) // 2
    k8 = cols // 8
    if bits == 2:
        j, a = k8 // 4, k8 % 4
        sh, pos = 2 * (a // 2) + r2, 2 * (a % 2)
    else:
        j, a = k8 // 2, k8 % 2
        sh, pos = 2 * a + r2, a * 0
    return warp * 32 + lane, j, sh, pos


def word_source_of(bits: int, k: int, parts: int, part, rows, cols) -> tuple:
    """(flat word index, bit) of the codes at `rows`, `cols` of tile `part` (index arrays,
    numpy or jnp): `word_source` for given indices, so that a kernel can compute it."""
    thread, j, sh, pos = _word_place(bits, k, rows, cols)
    jj = part * (k * bits // 64) + j
    return ((jj // 4) * 128 + thread) * 4 + jj % 4, 4 * sh + pos + 16 * (cols % 2)


def word_factor(bits: int, k: int) -> np.ndarray:
    """[k] float32: the power of two 2^pos that the words layout's conversion multiplies the
    codes of each column of a [64, k] A tile by (`_word_place`)."""
    return np.exp2(_word_place(bits, k)[3][0]).astype(np.float32)


def word_source(bits: int, k: int, parts: int) -> tuple[np.ndarray, np.ndarray]:
    """(flat word index [parts, 64, k], bit [parts, 64, k]) of each code of `parts` [64, k] A
    tiles in the words array [W, 128] of W = parts·k·bits/64 words a thread, flattened: the
    thread's word J lies at ((J // 4)·128 + thread)·4 + J % 4, so that one 128-bit load in
    Mosaic GPU's strided layout (WG_STRIDED, 4 words a thread) reads four of its words."""
    part, rows, cols = np.meshgrid(np.arange(parts), np.arange(64), np.arange(k), indexing="ij")
    return word_source_of(bits, k, parts, part, rows, cols)


def pack_words(tiles: Array, bits: int) -> Array:
    """Codes of `parts` [64, k] A tiles [..., parts, 64, k] (unsigned, < 2^bits) → the words
    layout [..., W, 128] uint32 (`word_source`)."""
    parts, _, k = tiles.shape[-3:]
    flat, bit = word_source(bits, k, parts)
    w = parts * k * bits // 64
    slot = np.full((w * 128, 32 // bits), -1, np.int64)  # the code each slot of a word holds
    slot[flat.ravel(), bit.ravel() // bits] = np.arange(flat.size)
    assert (slot >= 0).all(), "the words layout must fill every slot"
    codes = tiles.reshape(*tiles.shape[:-3], -1).astype(jnp.uint32)[..., slot]  # [.., W·128, n]
    shifts = jnp.arange(0, 32, bits, dtype=jnp.uint32).reshape((1,) * (codes.ndim - 1) + (-1,))
    words = jnp.sum(codes << shifts, axis=-1, dtype=jnp.uint32)  # disjoint bits: sum = OR
    return words.reshape(*tiles.shape[:-3], w, 128)


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
