"""Small pure building blocks shared by the model families."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from kvjax._numerics import project
from kvjax.models._config import RopeScaling

Array = jax.Array


def _expand(w: Array, like: Array) -> Array:
    """A [E] vector as float32 with leading unit axes to match `like` (explicit ranks)."""
    return w.astype(jnp.float32).reshape((1,) * (like.ndim - 1) + w.shape)


def rms_norm(x: Array, weight: Array | None, eps: float) -> Array:
    """RMSNorm computed in float32, returned in x's dtype. x: [..., E], weight: [E], or None
    where it is folded into the next projection's weights (`fuse_projections`)."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y if weight is None else y * _expand(weight, y)).astype(x.dtype)


def layer_norm(x: Array, weight: Array, bias: Array, eps: float) -> Array:
    """LayerNorm computed in float32, returned in x's dtype. x: [..., E]."""
    xf = x.astype(jnp.float32)
    mu = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
    y = (xf - mu) * jax.lax.rsqrt(var + eps)
    return (y * _expand(weight, y) + _expand(bias, y)).astype(x.dtype)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> Array:
    """[D/2] float32 inverse frequencies of RoPE, with Llama-3.1 ("llama3") or linear scaling.

    llama3 (as transformers' `_compute_llama3_parameters`): with wavelength λ = 2π / f and
    L0 = original_max_positions, frequencies with λ < L0 / high_freq_factor are kept, those with
    λ > L0 / low_freq_factor are divided by `factor`, and the band between blends the two with
    s = (L0 / λ − low_freq_factor) / (high_freq_factor − low_freq_factor):
    f' = (1 − s) · f / factor + s · f.
    """
    d = head_dim
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))  # [D/2]
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    old = float(scaling.original_max_positions)
    low_wavelen = old / scaling.low_freq_factor
    high_wavelen = old / scaling.high_freq_factor
    wavelen = 2.0 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1.0 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, blended, scaled)


def apply_rope(
    x: Array, positions: Array, theta: float, scaling: RopeScaling | None = None
) -> Array:
    """Rotary embedding, half-split ("rotate_half") layout as in Hugging Face Llama.

    Args:
        x: [B, T, H, D].
        positions: [B, T] int32 original token positions.
        theta: RoPE base.
        scaling: frequency scaling (None: plain RoPE).
    """
    return apply_rope_table(x, rope_table(positions, x.shape[-1], theta, scaling))


def rope_table(
    positions: Array, head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> tuple[Array, Array]:
    """(cos, sin) [B, T, 1, D/2] float32 of the rotary angles at `positions` [B, T], what
    `apply_rope_table` turns keys and queries by. Every layer of a step turns by the same
    table, so a model computes it once per call, outside its layers (in a layer scan, a kernel
    of its own in every layer otherwise)."""
    inv_freq = rope_frequencies(head_dim, theta, scaling)  # [D/2]
    ang = positions.astype(jnp.float32)[..., None] * inv_freq[None, None, :]  # [B, T, D/2]
    return jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]


def apply_rope_table(x: Array, table: tuple[Array, Array]) -> Array:
    """x [B, T, H, D] turned by a `rope_table` (half-split layout), in x's dtype."""
    cos, sin = table
    d = x.shape[-1]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def gelu_tanh(x: Array) -> Array:
    """GPT-2's GELU (tanh approximation), in float32."""
    return jax.nn.gelu(x.astype(jnp.float32), approximate=True).astype(x.dtype)


def dense(x: Array, w: Array, b: Array | None = None) -> Array:
    """x: [..., In] @ w: [In, Out] (+ b: [Out]) with float32 accumulation."""
    y = project(x, w)
    if b is not None:
        y = y + _expand(b, y)
    return y.astype(x.dtype)
