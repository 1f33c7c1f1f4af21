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


def _reduce(fn, x: Array) -> Array:
    """fn over the chunk's entries, then over the chunks: [B, C, w] -> [B]."""
    return fn(fn(x, axis=-1), axis=-1)


def confidence(logits: Array) -> Confidence:
    """Confidence statistics of logits [B, V] (any float dtype; computed in float32).

    The same quantities as `log_softmax` then `top_k(logp, 2)`: the top-2 log-probabilities
    are the row's max and the next value (the max again where it occurs twice), so no sort
    runs; every reduction goes over vocabulary chunks first (`chunk_width`)."""
    if logits.ndim != 2:
        raise ValueError(f"confidence: logits must be [B, V], got shape {logits.shape}")
    b, v = logits.shape
    if v < 2:
        raise ValueError(f"confidence: needs at least 2 logits a row (top-2 margin), got {v}")
    w = chunk_width(v)
    x = logits.astype(jnp.float32).reshape(b, v // w, w)
    top = _reduce(jnp.max, x)  # [B]
    # One pass over the row after its max: s = Σ e and t = Σ e·(x − max), e = exp(x − max),
    # so log p1 = −log s and the entropy is log s − t/s (plain sums after the max, no running
    # rescale), and the max's count, as one sum over the three stacked (one kernel for their
    # inputs and one reduction, where each sum read an input materialized by a kernel of its
    # own); then the largest value below the max.
    d = x - top[:, None, None]
    e = jnp.exp(d)
    at_top = d == 0
    # (a masked −inf entry adds 0 to t; the count is exact in float32 up to 2^24 entries)
    sums = _reduce(jnp.sum, jnp.stack([e, jnp.where(e > 0, e * d, 0.0), at_top.astype(e.dtype)]))
    s, t, count = sums[0], sums[1], sums[2]
    second = jnp.where(count > 1, top, _reduce(jnp.max, jnp.where(at_top, -jnp.inf, x)))
    return Confidence(
        entropy_norm=(jnp.log(s) - t / s) / jnp.log(v),
        margin=top - second,
        top1=1.0 / s,
    )
