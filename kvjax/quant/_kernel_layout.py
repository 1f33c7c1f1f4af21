"""Low-bit pages quantized straight into the Mosaic GPU decode kernel's layout (int4 codes,
values channel-major, statistics stacked and kernel-ready), and back.

The kernel reads a page's codes as signed int4 nibbles and turns code slice c of a nibble into
(code − offset)·2^(c·bits) with one mask (`decode_attention_lowbit_mgpu`): the offset is 0 for
a bottom slice and 2^(bits−1) for the top one (every nibble is stored XOR 8, so the top slice
reads as signed). Folding that offset into a stored zero point after quantizing would round it
to bfloat16 a second time; here each group is quantized around its offset from the start
(`quantize_offset`), so the statistics the kernel applies are exactly the ones the codes were
computed against and the error bound stays |x − dequantized| ≤ scale / 2.

Shapes, for a page of T tokens and D channels at `bits` ∈ {2, 4} (n = 4 // bits slices a
nibble; at 2 bits D = 128 and two value groups of 64 channels, one slice each):

    k:       [..., T, D·bits/4] int4   key codes, channel c and c + D/n of slice 0 and 1
    v:       [..., D·bits/4, T] int4   value codes, channel-major, value group g = slice g
    k_stats: [..., 2, D] bfloat16      (scale·2^-(c·bits), zero) per channel
    v_stats: [..., 2, NG, T] bfloat16  (scale·2^-(c·bits), zero) per value group and token
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.quant._checks import as_float, check_out_dtype
from kvjax.quant._lowbit import STAT_DTYPE, _to_bf16

Array = jax.Array

NIBBLE_SIGN = 8  # XOR of every stored nibble: its top code slice held sign-flipped
KERNEL_BITS = (2, 4)


def quantize_offset(x: Array, bits: int, axis: int, offset: Array) -> tuple[Array, Array, Array]:
    """Asymmetric quantization around an offset code: x ≈ (codes − offset)·scale + zero.

    Offset 0 is `kvjax.quant`'s rule (zero = min rounded down to bfloat16, scale = (max −
    zero)/L rounded up, L = 2^bits − 1). Offset o > 0 puts `zero` o steps above the bottom of
    the grid: zero = min + o·(max − min)/L rounded to the nearest bfloat16, then scale = the
    smallest bfloat16 ≥ max((zero − min)/o, (max − zero)/(L − o)), so the grid [zero − o·scale,
    zero + (L − o)·scale] covers [min, max] and |x − dequantized| ≤ scale/2 (plus float32
    rounding), with scale ≤ (1 + 2^-7)·((max − min)/L + 2^-8·|zero|/min(o, L − o)).

    Args:
        x: float array; statistics are taken along `axis` (kept as size 1 in the results).
        bits: 2, 4 or 8 (static).
        axis: the reduced axis.
        offset: integer array broadcastable to the statistics' shape, each 0 ≤ o < L.

    Returns:
        codes uint8 shaped like x in [0, L]; scale, zero `STAT_DTYPE` with `axis` kept as 1.
    """
    x = as_float(x, "x")
    levels = (1 << bits) - 1
    xf = x.astype(jnp.float32)
    lo = jnp.min(xf, axis=axis, keepdims=True)
    hi = jnp.max(xf, axis=axis, keepdims=True)
    off = jnp.broadcast_to(jnp.asarray(offset, jnp.float32), lo.shape)
    z0 = _to_bf16(lo, up=False)
    s0 = _to_bf16((hi - z0) / levels, up=True)
    zc = (lo + off * (hi - lo) / levels).astype(STAT_DTYPE).astype(jnp.float32)
    sc = _to_bf16(
        jnp.maximum((zc - lo) / jnp.maximum(off, 1.0), (hi - zc) / (levels - off)), up=True
    )
    zero = jnp.where(off > 0, zc, z0)
    scale = jnp.where(off > 0, sc, s0)
    safe = jnp.where(scale > 0, scale, jnp.ones_like(scale))
    codes = jnp.clip(jnp.round((xf - zero) / safe) + off, 0, levels).astype(jnp.uint8)
    return codes, scale.astype(STAT_DTYPE), zero.astype(STAT_DTYPE)


def pack_nibbles(codes: Array, bits: int, axis: int) -> Array:
    """Unsigned codes → int4, 4/bits of them a nibble: slice i of `axis` (split in 4/bits
    contiguous blocks) at bits i·bits, every nibble XOR 8 and read as signed (the top slice is
    then linear in its code)."""
    n = 4 // bits
    parts = jnp.split(codes.astype(jnp.int8), n, axis=axis)
    nib = parts[0]
    for i in range(1, n):
        nib = nib | (parts[i] << jnp.int8(i * bits))
    nib = nib ^ jnp.int8(NIBBLE_SIGN)
    return jnp.where(nib >= 8, nib - 16, nib).astype(jnp.int4)


def slice_values(nibbles: Array, bits: int, axis: int) -> Array:
    """What the kernel reads from int4 nibbles, as float32 along `axis` (4/bits slices
    concatenated): slice c is the nibble masked to its bits, (code − offset)·2^(c·bits)."""
    x = nibbles.astype(jnp.int8)
    n = 4 // bits
    out = []
    for c in range(n):
        mask = ((1 << bits) - 1) << (c * bits)
        out.append((x & jnp.int8(mask - 16 if mask >= 8 else mask)).astype(jnp.float32))
    return jnp.concatenate(out, axis=axis)


def _slice_of(n_items: int, bits: int) -> np.ndarray:
    """The code slice each of n_items (channels or value groups, split in 4/bits blocks) is in."""
    n = 4 // bits
    return np.arange(n_items) // (n_items // n)


def _offset(slices: np.ndarray, bits: int) -> np.ndarray:
    """The offset code of each slice: 2^(bits−1) for the top one, else 0."""
    return np.where(slices == 4 // bits - 1, 1 << (bits - 1), 0)


def check_kernel_layout(head_dim: int, bits: int, value_groups: int) -> None:
    """A ValueError unless the kernel layout holds D = head_dim at `bits` with that many value
    groups: bits 2 or 4, D a multiple of 64, value groups of a multiple of 64 channels, and at 2
    bits D = 128 with two value groups (each 64-channel half one slice of a nibble)."""
    if bits not in KERNEL_BITS:
        raise ValueError(f"the kernel layout holds {KERNEL_BITS}-bit codes, got bits={bits}")
    if head_dim % 64 or value_groups <= 0 or head_dim % value_groups:
        raise ValueError(
            f"the kernel layout needs head_dim a multiple of 64 split in whole value groups, "
            f"got head_dim={head_dim} and {value_groups} value groups"
        )
    if (head_dim // value_groups) % 64:
        raise ValueError(
            f"the kernel layout needs value groups of a multiple of 64 channels, got "
            f"{head_dim // value_groups}"
        )
    if bits == 2 and (head_dim != 128 or value_groups != 2):
        raise ValueError(
            "the kernel layout at 2 bits needs head_dim 128 and value groups of 64 channels "
            f"(each half one slice of a nibble), got head_dim={head_dim} and {value_groups} "
            "value groups"
        )


def quantize_kernel_pages(
    xk: Array, xv: Array, bits: int, value_groups: int
) -> tuple[Array, Array, Array, Array]:
    """Pages of keys and values [..., T, D] → (k, v, k_stats, v_stats) in the kernel layout
    (module docstring): keys per channel over the page's T tokens, values per token over
    `value_groups` groups of channels, each around its slice's offset (`quantize_offset`)."""
    xk, xv = as_float(xk, "xk"), as_float(xv, "xv")
    if xk.ndim < 2 or xk.shape != xv.shape:
        raise ValueError(f"xk and xv must be [..., T, D] alike, got {xk.shape} and {xv.shape}")
    d = xk.shape[-1]
    check_kernel_layout(d, bits, value_groups)
    kslice = _slice_of(d, bits)
    lead = (1,) * (xk.ndim - 2)
    koff = _offset(kslice, bits).reshape(*lead, 1, d)
    kc, ks, kz = quantize_offset(xk, bits, -2, koff)  # [.., T, D], [.., 1, D]
    gslice = _slice_of(value_groups, bits)  # at 4 bits every group is slice 0 (the top)
    grouped = xv.reshape(*xv.shape[:-1], value_groups, d // value_groups)
    goff = _offset(gslice, bits).reshape(*lead, 1, value_groups, 1)
    vc, vs, vz = quantize_offset(grouped, bits, -1, goff)
    vc = vc.reshape(xv.shape)  # [.., T, D]
    kpow = jnp.asarray(np.exp2(-(kslice * bits)), jnp.float32).reshape(*lead, d)
    vpow = jnp.asarray(np.exp2(-(gslice * bits)), jnp.float32).reshape(*lead, 1, value_groups)
    f32 = lambda a: a.astype(jnp.float32)  # x·2^-k is exact; stacked and stored as bfloat16
    k_stats = jnp.stack([f32(ks[..., 0, :]) * kpow, f32(kz[..., 0, :])], axis=-2)  # [.., 2, D]
    v_stats = jnp.stack([f32(vs[..., 0]) * vpow, f32(vz[..., 0])], axis=-3)  # [.., 2, T, NG]
    return (
        pack_nibbles(kc, bits, axis=-1),
        pack_nibbles(jnp.swapaxes(vc, -1, -2), bits, axis=-2),
        k_stats.astype(STAT_DTYPE),
        jnp.swapaxes(v_stats, -1, -2).astype(STAT_DTYPE),  # [.., 2, NG, T]
    )


def dequantize_kernel_pages(
    k: Array, v: Array, k_stats: Array, v_stats: Array, bits: int, dtype: Any = jnp.float32
) -> tuple[Array, Array]:
    """Inverse of `quantize_kernel_pages`: keys and values [..., T, D] `dtype`, computed in
    float32 as the kernel does (slice value × kernel-ready scale + zero)."""
    if k.dtype != jnp.int4 or v.dtype != jnp.int4:
        raise ValueError(f"kernel-layout codes must be int4, got {k.dtype} and {v.dtype}")
    kf = slice_values(k, bits, axis=-1)  # [.., T, D]
    ks = k_stats.astype(jnp.float32)
    xk = kf * ks[..., :1, :] + ks[..., 1:, :]
    vf = jnp.swapaxes(slice_values(v, bits, axis=-2), -1, -2)  # [.., T, D]
    ng = v_stats.shape[-2]
    vs = jnp.swapaxes(v_stats.astype(jnp.float32), -1, -2)  # [.., 2, T, NG]
    grouped = vf.reshape(*vf.shape[:-1], ng, vf.shape[-1] // ng)
    xv = grouped * vs[..., 0, :, :, None] + vs[..., 1, :, :, None]
    out = check_out_dtype(dtype)
    return xk.astype(out), xv.reshape(vf.shape).astype(out)
