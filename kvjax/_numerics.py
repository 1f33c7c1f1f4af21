"""Numerics shared by every layer of the library (a leaf module: imports nothing of kvjax)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def einsum_f32(spec: str, a: Array, b: Array) -> Array:
    """einsum with float32 accumulation and a float32 result, for any input dtype.

    XLA:CPU has no bf16 x bf16 -> f32 dot, so on CPU low-precision inputs are upcast first;
    on GPU/TPU the inputs stay low-precision and only the accumulator is float32.
    """
    if jax.default_backend() == "cpu" and (a.dtype != jnp.float32 or b.dtype != jnp.float32):
        return jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32))
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)
