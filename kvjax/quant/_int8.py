"""INT8 symmetric quantization (CONF-KV's storage tier for older retained tokens).

Symmetric, no zero point: scale = max|x| / 127 and codes = clip(round(x / scale), -127, 127), so
-128 is never used and the code range is symmetric. 127 (not 127.5) is the largest code, and the
clip guards against float32 rounding of x / scale past 127. An all-zero group gets scale 0, codes 0
and dequantizes to exactly 0 (the division uses 1 in place of a zero scale).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from kvjax.quant._checks import as_codes, as_float, as_stat, check_out_dtype

Array = jax.Array

INT8_MAX = 127


def _symmetric(x: Array, axis: int) -> tuple[Array, Array]:
    """codes int8 shaped like x, scale float32 with `axis` reduced (kept as size 1)."""
    xf = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(xf), axis=axis, keepdims=True) / INT8_MAX
    safe = jnp.where(scale > 0, scale, jnp.ones_like(scale))
    codes = jnp.clip(jnp.round(xf / safe), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return codes, scale


def quantize_int8(x: Array) -> tuple[Array, Array]:
    """Symmetric INT8, one scale per vector over the last axis (per token and head).

    Args:
        x: [..., D] any float dtype; computed in float32.

    Returns:
        codes: [..., D] int8 in [-127, 127].
        scale: [...] float32, max|x| / 127 (0 for an all-zero vector).
    """
    x = as_float(x, "x")
    codes, scale = _symmetric(x, axis=-1)
    return codes, scale[..., 0]


def dequantize_int8(codes: Array, scale: Array, dtype: Any = jnp.float32) -> Array:
    """Inverse of `quantize_int8`.

    Args:
        codes: [..., D] int8.
        scale: [...] float.
        dtype: dtype of the result.

    Returns:
        [..., D] `dtype`, codes * scale computed in float32.
    """
    codes = as_codes(codes, jnp.int8, "codes")
    scale = as_stat(scale, codes.shape[:-1], "scale")
    out = codes.astype(jnp.float32) * scale[..., None]
    return out.astype(check_out_dtype(dtype))


def quantize_int8_channel(x: Array) -> tuple[Array, Array]:
    """Symmetric INT8, one scale per channel over the token axis (for per-channel calibration).

    Args:
        x: [..., T, D] any float dtype; computed in float32.

    Returns:
        codes: [..., T, D] int8 in [-127, 127].
        scale: [..., D] float32, max over T of |x| / 127.
    """
    x = as_float(x, "x")
    if x.ndim < 2 or x.shape[-2] == 0:
        raise ValueError(f"x must be [..., T, D] with T >= 1, got shape {x.shape}")
    codes, scale = _symmetric(x, axis=-2)
    return codes, scale[..., 0, :]


def dequantize_int8_channel(codes: Array, scale: Array, dtype: Any = jnp.float32) -> Array:
    """Inverse of `quantize_int8_channel`.

    Args:
        codes: [..., T, D] int8.
        scale: [..., D] float.
        dtype: dtype of the result.

    Returns:
        [..., T, D] `dtype`.
    """
    codes = as_codes(codes, jnp.int8, "codes")
    if codes.ndim < 2:
        raise ValueError(f"codes must be [..., T, D], got shape {codes.shape}")
    scale = as_stat(scale, codes.shape[:-2] + codes.shape[-1:], "scale")
    out = codes.astype(jnp.float32) * scale[..., None, :]
    return out.astype(check_out_dtype(dtype))


def int8_bytes_per_token(head_dim: int, *, scale_bytes: int = 4) -> int:
    """Storage of one token of one KV head in the per-token INT8 tier.

    Formula: `2 * head_dim` (one int8 code per channel, K and V) `+ 2 * scale_bytes` (one scale per
    token for K and one for V). E.g. head_dim 64, float32 scales: 128 + 8 = 136 bytes.
    """
    if head_dim <= 0 or scale_bytes < 0:
        raise ValueError(
            f"need head_dim > 0 and scale_bytes >= 0, got head_dim={head_dim}, "
            f"scale_bytes={scale_bytes}"
        )
    return 2 * head_dim + 2 * scale_bytes
