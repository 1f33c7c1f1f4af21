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


MAX_CHUNK = 2048  # widest vocabulary chunk a row's reductions run over


def chunk_width(vocab: int) -> int:
    """The widest divisor of `vocab` up to MAX_CHUNK (1 for a prime above it: one reduction
    over the row, as without chunks). The logits are reduced as [B, V/w, w] rows, then over
    the chunks: one reduction over a whole vocabulary row gives a GPU few, long rows (eight at
    batch 8) and the CPU a sort for the top two. No padding, so a vocabulary-sharded row stays
    a reshape."""
    for w in range(min(vocab, MAX_CHUNK), 0, -1):
        if vocab % w == 0:
            return w
    raise ValueError(f"vocabulary size must be >= 1, got {vocab}")


def _stats(m: Array, s: Array, t: Array, m2: Array, axis: int):
    """Merge softmax statistics along `axis` in one variadic reduction: running max m, its
    sum s = Σ e^(x − m), t = Σ (x − m) e^(x − m) and the second largest value m2 (the max
    again where it occurs twice)."""

    def merge(a, b):
        (ma, sa, ta, m2a), (mb, sb, tb, m2b) = a, b
        m = jnp.maximum(ma, mb)

        def part(mi, si, ti):
            d = jnp.where(mi == m, 0.0, mi - m)  # <= 0; -inf for an empty or masked part
            alpha = jnp.exp(d)
            return alpha * si, jnp.where(alpha > 0, alpha * (ti + d * si), 0.0)

        (sa, ta), (sb, tb) = part(ma, sa, ta), part(mb, sb, tb)
        return m, sa + sb, ta + tb, jnp.maximum(jnp.minimum(ma, mb), jnp.maximum(m2a, m2b))

    neg = jnp.float32(-jnp.inf)
    init = (neg, jnp.float32(0), jnp.float32(0), neg)
    return jax.lax.reduce((m, s, t, m2), init, merge, (axis,))


def confidence(logits: Array) -> Confidence:
    """Confidence statistics of logits [B, V] (any float dtype; computed in float32).

    The same quantities as `log_softmax` then `top_k(logp, 2)`, from one pass over the logits:
    each chunk's running max, softmax sum, the sum of (x − max)·e^(x − max) (the entropy's
    part) and second largest value merge in one variadic reduction (`_stats`), then over the
    chunks (`chunk_width`): entropy = log s − t/s, p1 = 1/s, margin = max − second. No sort;
    two reductions where separate ones for the max, the sums and the second value were ten
    (each a kernel or two to compile)."""
    if logits.ndim != 2:
        raise ValueError(f"confidence: logits must be [B, V], got shape {logits.shape}")
    b, v = logits.shape
    if v < 2:
        raise ValueError(f"confidence: needs at least 2 logits a row (top-2 margin), got {v}")
    w = chunk_width(v)
    x = logits.astype(jnp.float32).reshape(b, v // w, w)
    ones, zeros = jnp.ones_like(x), jnp.zeros_like(x)
    chunk = _stats(x, ones, zeros, jnp.full_like(x, -jnp.inf), axis=2)  # [B, C] each
    top, s, t, second = _stats(*chunk, axis=1)  # [B]
    return Confidence(
        entropy_norm=(jnp.log(s) - t / s) / jnp.log(v),
        margin=top - second,
        top1=1.0 / s,
    )
