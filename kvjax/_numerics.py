"""Numerics shared by every layer of the library (a leaf module: imports nothing of kvjax)."""

from __future__ import annotations

import math

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


# Weight-streaming GEMMs of a decode step (one or a few rows against a large weight) on GPU:
# two XLA behaviours cost whole copies of weights every step, so `project` and `separate` shape
# the dots around them (measured: docs/lab/2026-12-04-h200-decode-gemms.md).
FEW_ROWS = 128  # rows (batch x tokens) up to which a dot is a weight-streaming decode GEMM


def _gpu() -> bool:
    return jax.default_backend() == "gpu"


def project(x: Array, w: Array, *, w_transposed: bool = False) -> Array:
    """x [..., In] @ w [In, Out] (w [Out, In] when `w_transposed`), float32 accumulation and
    result, as `einsum_f32`.

    On GPU a single row (batch 1 decode) is padded to two: with cuBLAS dots (the layer scan's
    setting) XLA runs a one-row bfloat16 dot with a float32 result as a float32 matrix-vector
    product and converts the whole weight to float32 first, every call; two rows take the
    mixed-precision GEMM that reads the weight as stored. Rows are independent, so the result
    is the same; the barriers keep XLA from slicing the padding back off before the dot.
    """
    spec = "...i,oi->...o" if w_transposed else "...i,io->...o"
    if not (_gpu() and x.ndim >= 1 and x.size == x.shape[-1]):
        return einsum_f32(spec, x, w)
    row = x.reshape(1, x.shape[-1])
    two = jax.lax.optimization_barrier(jnp.concatenate([row, jnp.zeros_like(row)]))
    y = jax.lax.optimization_barrier(einsum_f32(spec, two, w))
    return y[:1].reshape(*x.shape[:-1], y.shape[-1])


def separate(x: Array, n: int) -> tuple[Array, ...]:
    """`n` copies of x that XLA sees as different values, for the dots of one input.

    XLA's GPU compiler merges dots that share an operand (its dot merger) by concatenating their
    weights, and in a decode loop it concatenates them again every step (the weights are
    loop-invariant, the concatenation is not hoisted): at Llama-3-8B shapes the q, k and v
    projections copy 48 MB a layer a step. Each dot reading its own copy of x reads its weight
    in place. Only on GPU and for few rows (decode), where a merged dot gains nothing: its
    weights are read once either way.
    """
    if not _gpu() or math.prod(x.shape[:-1]) > FEW_ROWS or n < 2:
        return (x,) * n
    return tuple(jax.lax.optimization_barrier((x,) * n))
