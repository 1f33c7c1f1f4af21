"""Confidence of the next-token distribution (CONF-KV's signal, also logged as telemetry)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

Array = jax.Array


@struct.dataclass
class Confidence:
    """Per-row statistics of next-token logits, all float32 [B].

    Attributes:
        entropy_norm: entropy / log(V), in [0, 1].
        margin: log p1 - log p2 (top-2 log-probability margin), >= 0.
        top1: probability of the most likely token.
    """

    entropy_norm: Array
    margin: Array
    top1: Array

    def score(self, w_entropy: float = 0.4, w_margin: float = 0.3, w_top1: float = 0.3) -> Array:
        """c = w_H (1 - Ĥ) + w_m σ(m) + w_p p1 (CONF-KV's confidence, default weights)."""
        return (
            w_entropy * (1.0 - self.entropy_norm)
            + w_margin * jax.nn.sigmoid(self.margin)
            + w_top1 * self.top1
        )


def confidence(logits: Array) -> Confidence:
    """Confidence statistics of logits [B, V] (any float dtype; computed in float32)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    p = jnp.exp(logp)
    entropy = -jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1)
    top2 = jax.lax.top_k(logp, 2)[0]
    return Confidence(
        entropy_norm=entropy / jnp.log(logits.shape[-1]),
        margin=top2[:, 0] - top2[:, 1],
        top1=jnp.exp(top2[:, 0]),
    )
