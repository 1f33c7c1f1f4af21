"""Combining split/tier partials and turning logits into attention mass (plain jnp, tiny arrays)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from kvjax.pallas_kernels.decode_attention._tiers import Partials

Array = jax.Array


def combine(parts: Sequence[Partials]) -> tuple[Array, Array]:
    """Log-sum-exp combine of partial attentions over disjoint slot sets.

    Args:
        parts: Partials of one or more tiers (out [B, Hkv, S, G, D], lse [B, Hkv, S, G]).

    Returns:
        out [B, Hkv, G, D] float32 (0 where nothing was visible) and lse [B, Hkv, G] float32
        (-inf where nothing was visible).
    """
    out = jnp.concatenate([p.out for p in parts], axis=2)
    lse = jnp.concatenate([p.lse for p in parts], axis=2)
    m = jnp.max(lse, axis=2)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse - m[:, :, None])  # [B, Hkv, S, G]; -inf splits weigh 0
    den = jnp.sum(w, axis=2)
    has = den > 0
    out = jnp.sum(w[..., None] * out, axis=2) / jnp.where(has, den, 1.0)[..., None]
    return out, jnp.where(has, m + jnp.log(jnp.where(has, den, 1.0)), -jnp.inf)


def attention_mass(logits: Array, lse: Array, visible: Array, weight: Array) -> Array:
    """Probability mass per slot, summed over the G query heads of each KV head.

    Args:
        logits: [B, Hkv, G, N] float32 scaled logits (arbitrary where not visible).
        lse: [B, Hkv, G] float32 final log-sum-exp of each query head (all tiers and new tokens).
        visible: [B, Hkv, N] bool, slot attended.
        weight: [B] float32 weight of the query.

    Returns:
        [B, Hkv, N] float32.
    """
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    p = jnp.where(visible[:, :, None, :], jnp.exp(logits - lse[..., None]), 0.0)
    return jnp.sum(p, axis=2) * weight[:, None, None]
