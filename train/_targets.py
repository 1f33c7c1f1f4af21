"""KVpop targets: the log future attention mass of every key (METHODS.md, "KVpop" 2–3).

    m_t = (1/N_t) Σ_{d = t+w}^{S−1} p(d→t),   N_t = max(1, S − (t + w)),   r_t = log m_t,

aggregated over the G query heads of a KV head (max by default). `log_future_mass` is the
*transposed* attention pass: keys act as queries, each original query's softmax is recovered
from the teacher's per-query log-sum-exp, and an online log-sum-exp runs over blocks of queries,
so memory is O(S·(Hq + D)) plus one block × block tile — never S × S.
`dense_log_future_mass` is the S × S reference for short sequences (tests).
"""

from __future__ import annotations

import enum
import math

import jax
import jax.numpy as jnp

Array = jax.Array
_NEG = -1e30


class HeadAggregate(enum.StrEnum):
    MAX = "max"
    MEAN = "mean"


def _check(q: Array, k: Array, window: int) -> None:
    if q.ndim != 4 or k.ndim != 4 or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q must be [B, S, Hq, D] and k [B, S, Hkv, D], got {q.shape}, {k.shape}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"Hq ({q.shape[2]}) must be a multiple of Hkv ({k.shape[2]})")
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")


def _aggregate(log_mass: Array, how: HeadAggregate) -> Array:
    """[B, Hkv, G, S] → [B, Hkv, S] over the query heads of each KV head."""
    how = HeadAggregate(how)
    if how == HeadAggregate.MAX:
        return jnp.max(log_mass, axis=2)
    return jax.nn.logsumexp(log_mass, axis=2) - math.log(log_mass.shape[2])


def _finish(log_sum: Array, s: int, window: int, how: HeadAggregate) -> tuple[Array, Array]:
    t = jnp.arange(s)
    n = jnp.maximum(1, s - (t + window)).astype(jnp.float32)
    log_mass = _aggregate(log_sum - jnp.log(n)[None, None, None, :], how)
    has_future = jnp.broadcast_to(t + window <= s - 1, log_mass.shape)
    return jnp.where(has_future, log_mass, -jnp.inf), has_future


def dense_log_future_mass(
    q: Array, k: Array, *, window: int, aggregate: HeadAggregate = HeadAggregate.MAX
) -> tuple[Array, Array]:
    """Reference with the full S × S causal softmax (short sequences only).

    Args:
        q: [B, S, Hq, D] queries after RoPE.
        k: [B, S, Hkv, D] keys after RoPE.
        window: w, the protected window (queries d >= t + w count).
        aggregate: how the G query heads of a KV head combine.

    Returns:
        log_mass [B, Hkv, S] float32 (-inf where t + w > S − 1) and has_future [B, Hkv, S] bool.
    """
    _check(q, k, window)
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.astype(jnp.float32).reshape(b, s, hkv, hq // hkv, d)
    logits = jnp.einsum("bdhgx,bthx->bhgdt", qg, k.astype(jnp.float32)) * d**-0.5
    causal = jnp.arange(s)[:, None] >= jnp.arange(s)[None, :]  # [d, t]
    p = jax.nn.softmax(jnp.where(causal, logits, _NEG), axis=-1)
    future = jnp.arange(s)[:, None] >= jnp.arange(s)[None, :] + window
    mass = jnp.sum(jnp.where(future, p, 0.0), axis=3)  # [B, Hkv, G, S]
    return _finish(jnp.log(mass), s, window, aggregate)


def log_future_mass(
    q: Array,
    k: Array,
    lse: Array,
    *,
    window: int,
    aggregate: HeadAggregate = HeadAggregate.MAX,
    block: int = 128,
) -> tuple[Array, Array]:
    """Targets by the transposed attention pass (memory O(S·(Hq + D) + block²)).

    Args:
        q: [B, S, Hq, D] queries after RoPE.
        k: [B, S, Hkv, D] keys after RoPE.
        lse: [B, S, Hq] float32 log-sum-exp of each query's scaled logits (the teacher's).
        window: w, the protected window.
        aggregate: how the G query heads of a KV head combine.
        block: keys and queries per tile.

    Returns:
        log_mass [B, Hkv, S] float32 (-inf where t + w > S − 1) and has_future [B, Hkv, S] bool.
    """
    _check(q, k, window)
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    if lse.shape != (b, s, hq):
        raise ValueError(f"lse must be [B, S, Hq] = {(b, s, hq)}, got {lse.shape}")
    if block <= 0:
        raise ValueError(f"block must be > 0, got {block}")
    nb = -(-s // block)
    pad = nb * block - s
    padded = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    qb = padded(q.astype(jnp.float32)).reshape(b, nb, block, hkv, hq // hkv, d)
    lb = padded(lse.astype(jnp.float32)).reshape(b, nb, block, hkv, hq // hkv)
    kb = padded(k.astype(jnp.float32)).reshape(b, nb, block, hkv, d)
    idx = jnp.arange(nb * block).reshape(nb, block)

    def key_block(i):
        kt, t = kb[:, i], idx[i]  # [B, bk, Hkv, D], [bk]

        def query_block(j, carry):
            mx, sm = carry
            logits = jnp.einsum("bkhx,bqhgx->bhgkq", kt, qb[:, j]) * d**-0.5
            logits = logits - jnp.transpose(lb[:, j], (0, 2, 3, 1))[:, :, :, None, :]
            dd = idx[j]
            ok = (dd[None, :] >= t[:, None] + window) & (dd[None, :] < s)  # [bk, bq]
            logits = jnp.where(ok, logits, _NEG)
            new_mx = jnp.maximum(mx, jnp.max(logits, axis=-1))
            e = jnp.where(ok, jnp.exp(logits - new_mx[..., None]), 0.0)
            sm = sm * jnp.exp(mx - new_mx) + jnp.sum(e, axis=-1)
            return new_mx, sm

        init = (jnp.full((b, hkv, hq // hkv, block), _NEG), jnp.zeros((b, hkv, hq // hkv, block)))
        # Query blocks that end before this key block's first t + w hold no future query.
        first = jnp.minimum((i * block + window) // block, nb)
        mx, sm = jax.lax.fori_loop(first, nb, query_block, init)
        return jnp.where(sm > 0, mx + jnp.log(jnp.maximum(sm, 1e-38)), -jnp.inf)

    log_sum = jax.lax.map(key_block, jnp.arange(nb))  # [nb, B, Hkv, G, bk]
    log_sum = jnp.moveaxis(log_sum, 0, 3).reshape(b, hkv, hq // hkv, nb * block)[..., :s]
    return _finish(log_sum, s, window, aggregate)
