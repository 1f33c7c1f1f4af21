"""Static (shape and dtype) argument checks shared by the quantizers; all of them work under jit."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array

BITS = (2, 4, 8)  # code widths a byte splits into evenly


def check_bits(bits: int) -> int:
    """`bits` itself if it is one of BITS, else a ValueError (bits must be a static int)."""
    if isinstance(bits, bool) or bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    return bits


def as_float(x: Any, name: str) -> Array:
    """`x` as a jax array with a floating dtype and at least one axis."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating array, got dtype {x.dtype}")
    if x.ndim == 0:
        raise ValueError(f"{name} needs at least one axis, got a scalar")
    return x


def as_codes(codes: Any, dtype: Any, name: str) -> Array:
    """`codes` as a jax array of exactly `dtype` (codes are never silently cast)."""
    codes = jnp.asarray(codes)
    if codes.dtype != jnp.dtype(dtype):
        raise ValueError(f"{name} must have dtype {jnp.dtype(dtype)}, got {codes.dtype}")
    if codes.ndim == 0:
        raise ValueError(f"{name} needs at least one axis, got a scalar")
    return codes


def as_stat(stat: Any, shape: tuple[int, ...], name: str) -> Array:
    """A float scale/zero array of exactly `shape`, as float32."""
    stat = jnp.asarray(stat)
    if not jnp.issubdtype(stat.dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating array, got dtype {stat.dtype}")
    if stat.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {stat.shape}")
    return stat.astype(jnp.float32)


def check_out_dtype(dtype: Any) -> Any:
    """The requested output dtype, which must be floating."""
    if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        raise ValueError(f"dtype must be a floating dtype, got {jnp.dtype(dtype)}")
    return dtype
