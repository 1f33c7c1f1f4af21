"""Low-bit asymmetric quantization, KIVI / QEvict style: keys per channel, values per token.

For every group of numbers (the statistics axis): levels = 2**bits - 1, scale = (max - min) /
levels, zero = min, codes = clip(round((x - zero) / scale), 0, levels) as uint8, and
x ≈ codes * scale + zero. Keys have outlier channels, so they are grouped per channel over a block
of tokens; values are grouped per token over (groups of) channels (KIVI, Liu et al. 2024; QEvict
uses one key group per (head, channel, window)). Bits 8 is the same scheme with codes 0..255.

The statistics are stored as bfloat16 (`STAT_DTYPE`, half the bytes of float32; see
docs/decisions.md), rounded in the direction that keeps every input on the code grid: zero is
min rounded down to a bfloat16 and scale is (max - zero) / levels rounded up, and the codes are
computed against these stored values. So the rounding only widens the step: with u = 2**-7 (the
bfloat16 spacing relative to its value), |x - dequantized| <= scale / 2 and
scale <= (1 + u) * (max - min + u * |min|) / levels (plus float32 rounding). A group whose
minimum is a bfloat16 (e.g. a constant bfloat16 group) keeps its zero exactly; a constant group
whose constant is a bfloat16 gets scale 0 and dequantizes to exactly its constant (the division
uses 1 in place of a zero scale). Everything else is computed in float32.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.quant._checks import as_codes, as_float, as_stat, check_bits, check_out_dtype
from kvjax.quant._pack import codes_per_byte

Array = jax.Array

STAT_DTYPE = jnp.bfloat16  # storage dtype of low-bit scales and zero points


def _to_bf16(x: Array, up: bool) -> Array:
    """float32 x rounded to a bfloat16 toward +inf (up) or -inf (not up), as float32.

    Truncating the low 16 bits of a float32 rounds its magnitude down; one bfloat16 ulp more
    magnitude (+0x10000 on the bits) rounds it up. Exact for every finite x.
    """
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    trunc = bits & jnp.uint32(0xFFFF0000)
    inexact = (bits & jnp.uint32(0xFFFF)) != 0
    away = inexact & ((x > 0) if up else (x < 0))  # the direction that grows the magnitude
    out = jnp.where(away, trunc + jnp.uint32(0x10000), trunc)
    return jax.lax.bitcast_convert_type(out, jnp.float32)


def _asymmetric(x: Array, bits: int, axis: int) -> tuple[Array, Array, Array]:
    """codes uint8 shaped like x; scale, zero `STAT_DTYPE` with `axis` reduced (kept as size 1)."""
    levels = (1 << check_bits(bits)) - 1
    xf = x.astype(jnp.float32)
    zero = _to_bf16(jnp.min(xf, axis=axis, keepdims=True), up=False)
    scale = _to_bf16((jnp.max(xf, axis=axis, keepdims=True) - zero) / levels, up=True)
    return _codes(xf, zero, scale, levels), scale.astype(STAT_DTYPE), zero.astype(STAT_DTYPE)


def _codes(xf: Array, zero: Array, scale: Array, levels: int) -> Array:
    """uint8 codes of float32 xf against its (broadcast) rounded statistics: round((x -
    zero) / scale) in [0, levels], a zero scale (constant x) read as 1."""
    safe = jnp.where(scale > 0, scale, jnp.ones_like(scale))
    return jnp.clip(jnp.round((xf - zero) / safe), 0, levels).astype(jnp.uint8)


def _value_group(d: int, group: int | None) -> int:
    """Channels per value group: `group`, or all D for None; a ValueError unless it divides D."""
    group = d if group is None else group
    if group <= 0 or d % group:
        raise ValueError(f"group must be > 0 and divide D={d}, got group={group}")
    return group


def quantize_per_channel(x: Array, bits: int) -> tuple[Array, Array, Array]:
    """Asymmetric quantization with statistics per channel over a group of T tokens (keys).

    Args:
        x: [..., T, D] any float dtype, the T tokens of one group (e.g. a QEvict window).
        bits: 2, 4 or 8 (static).

    Returns:
        codes: [..., T, D] uint8 in [0, 2**bits - 1].
        scale: [..., D] bfloat16, (max - zero) / (2**bits - 1) over T, rounded up.
        zero: [..., D] bfloat16, min over T, rounded down.
    """
    x = as_float(x, "x")
    if x.ndim < 2 or x.shape[-2] == 0:
        raise ValueError(f"x must be [..., T, D] with T >= 1, got shape {x.shape}")
    codes, scale, zero = _asymmetric(x, bits, axis=-2)
    return codes, scale[..., 0, :], zero[..., 0, :]


def dequantize_per_channel(
    codes: Array, scale: Array, zero: Array, dtype: Any = jnp.float32
) -> Array:
    """Inverse of `quantize_per_channel`.

    Args:
        codes: [..., T, D] uint8 (unpacked).
        scale: [..., D] float.
        zero: [..., D] float.
        dtype: dtype of the result.

    Returns:
        [..., T, D] `dtype`, codes * scale + zero computed in float32.
    """
    codes = as_codes(codes, jnp.uint8, "codes")
    if codes.ndim < 2:
        raise ValueError(f"codes must be [..., T, D], got shape {codes.shape}")
    stat_shape = codes.shape[:-2] + codes.shape[-1:]
    scale = as_stat(scale, stat_shape, "scale")
    zero = as_stat(zero, stat_shape, "zero")
    out = codes.astype(jnp.float32) * scale[..., None, :] + zero[..., None, :]
    return out.astype(check_out_dtype(dtype))


def quantize_per_token(x: Array, bits: int, group: int | None = None) -> tuple[Array, Array, Array]:
    """Asymmetric quantization with statistics per token over groups of channels (values).

    Args:
        x: [..., D] any float dtype.
        bits: 2, 4 or 8 (static).
        group: channels per group (static); must divide D. None: one group of all D channels.

    Returns:
        codes: [..., D] uint8 in [0, 2**bits - 1].
        scale: [..., D // group] bfloat16 (None: [..., 1]), rounded up as in the keys.
        zero: [..., D // group] bfloat16 (None: [..., 1]), rounded down.
    """
    x = as_float(x, "x")
    d = x.shape[-1]
    group = _value_group(d, group)
    grouped = x.reshape(*x.shape[:-1], d // group, group)
    codes, scale, zero = _asymmetric(grouped, bits, axis=-1)
    return codes.reshape(x.shape), scale[..., 0], zero[..., 0]


def quantize_keys_values(
    k: Array, v: Array, bits: int, group: int | None = None
) -> tuple[tuple[Array, Array, Array], tuple[Array, Array, Array]]:
    """`quantize_per_channel(k, bits)` and `quantize_per_token(v, bits, group)` at once: the
    same codes and statistics, with the statistics' roundings done once over both end to end
    (under jit a kernel each for the two tensors together, not one each per tensor).

    Args:
        k: [..., T, D] keys, any float dtype.
        v: [..., T, D] values (the same leading axes, T and D).
        bits: 2, 4 or 8 (static).
        group: channels per value group (static; None: all D).

    Returns:
        (codes, scale, zero) of the keys, as `quantize_per_channel`, and of the values, as
        `quantize_per_token`.
    """
    k, v = as_float(k, "k"), as_float(v, "v")
    if k.ndim < 2 or k.shape[-2] == 0 or k.shape != v.shape:
        raise ValueError(f"k and v must be [..., T, D] of one shape, got {k.shape}, {v.shape}")
    *lead, t, d = k.shape
    group = _value_group(d, group)
    levels = (1 << check_bits(bits)) - 1
    kf = k.astype(jnp.float32)
    vf = v.astype(jnp.float32).reshape(*lead, t, d // group, group)
    # [..., D + T·D/group]: the keys' statistics per channel, then the values' per token and group
    n_v = t * (d // group)
    at = np.arange(d + n_v) < d
    pad = lambda x, lo, hi: jnp.pad(x, ((0, 0),) * len(lead) + ((lo, hi),))
    both = lambda f: jnp.where(
        at, pad(f(kf, axis=-2), 0, n_v), pad(f(vf, axis=-1).reshape(*lead, -1), d, 0)
    )
    # Each materialized once (else XLA fuses the rounding into every consumer, a kernel each).
    zero = jax.lax.optimization_barrier(_to_bf16(both(jnp.min), up=False))
    scale = jax.lax.optimization_barrier(_to_bf16((both(jnp.max) - zero) / levels, up=True))
    k_codes = _codes(kf, zero[..., None, :d], scale[..., None, :d], levels)
    vz, vs = (x[..., d:].reshape(*lead, t, d // group, 1) for x in (zero, scale))
    v_codes = _codes(vf, vz, vs, levels).reshape(k.shape)
    stat = lambda x, part: x[..., part].astype(STAT_DTYPE)
    v_stat = lambda x: stat(x, slice(d, None)).reshape(*lead, t, d // group)
    return (
        (k_codes, stat(scale, slice(d)), stat(zero, slice(d))),
        (v_codes, v_stat(scale), v_stat(zero)),
    )


def dequantize_per_token(
    codes: Array, scale: Array, zero: Array, dtype: Any = jnp.float32
) -> Array:
    """Inverse of `quantize_per_token`; the group size is D // scale.shape[-1].

    Args:
        codes: [..., D] uint8 (unpacked).
        scale: [..., D // group] float.
        zero: [..., D // group] float.
        dtype: dtype of the result.

    Returns:
        [..., D] `dtype`, codes * scale + zero computed in float32.
    """
    codes = as_codes(codes, jnp.uint8, "codes")
    d = codes.shape[-1]
    num_groups = jnp.shape(scale)[-1] if jnp.ndim(scale) else 0
    if num_groups <= 0 or d % num_groups:
        raise ValueError(f"scale's last axis must divide D={d}, got scale shape {jnp.shape(scale)}")
    stat_shape = codes.shape[:-1] + (num_groups,)
    scale = as_stat(scale, stat_shape, "scale")
    zero = as_stat(zero, stat_shape, "zero")
    grouped = codes.reshape(*stat_shape, d // num_groups).astype(jnp.float32)
    out = grouped * scale[..., None] + zero[..., None]
    return out.reshape(codes.shape).astype(check_out_dtype(dtype))


def bytes_per_token(
    head_dim: int,
    bits: int,
    *,
    key_group: int,
    value_group: int | None,
    scale_bytes: int = 2,
) -> float:
    """Exact storage of one token of one KV head: packed K and V codes plus amortized statistics.

    With D = head_dim and s = scale_bytes:

        bytes = 2 * D * bits / 8            # packed K and V codes
              + 2 * s * D / key_group       # K: scale and zero per channel, shared by key_group
              + 2 * s * (D / value_group)   # V: scale and zero per channel group of this token

    value_group None counts one value group (D / value_group = 1). E.g. D 64, bits 2, key_group 32,
    value_group 32, bfloat16 statistics: 32 + 8 + 8 = 48 bytes (64 with float32 statistics), vs
    256 for bfloat16 K and V.

    Args:
        head_dim: D; must be a multiple of 8 // bits (so codes pack into whole bytes).
        bits: 2, 4 or 8.
        key_group: tokens sharing one key scale/zero per channel (T of `quantize_per_channel`).
        value_group: channels per value group (`group` of `quantize_per_token`); must divide D.
        scale_bytes: bytes of one stored scale or zero (2 for the stored bfloat16, 4 for float32).
    """
    n = codes_per_byte(bits)
    if head_dim <= 0 or head_dim % n:
        raise ValueError(
            f"head_dim must be a positive multiple of {n} for {bits}-bit codes, "
            f"got head_dim={head_dim}"
        )
    if key_group <= 0:
        raise ValueError(f"key_group must be > 0, got {key_group}")
    value_group = head_dim if value_group is None else value_group
    if value_group <= 0 or head_dim % value_group:
        raise ValueError(
            f"value_group must be > 0 and divide head_dim={head_dim}, got {value_group}"
        )
    if scale_bytes < 0:
        raise ValueError(f"scale_bytes must be >= 0, got {scale_bytes}")
    codes = 2 * head_dim * bits // 8
    key_stats = 2 * scale_bytes * head_dim / key_group
    value_stats = 2 * scale_bytes * (head_dim // value_group)
    return float(codes + key_stats + value_stats)
