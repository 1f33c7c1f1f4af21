"""The boundary pairwise logistic loss (METHODS.md, "KVpop" 4) and keep/evict decisions.

Budget B = s + w + k per KV head: s sinks, a protected window of w tokens, k long-range slots.
At query q the token t_new = q − w leaves the window and competes for the k slots with the
eligible tokens before it, E'_q = {s, …, q − w − 1}. The teacher keeps the top k of E'_q by
priority r_t + λ·t (the target plus a temporal decay: −λ·(q − t) ranks like +λ·t at a fixed q);
t_bnd is the last kept one (the k-th best) and t_new is kept iff it beats t_bnd (y = +1, else −1):

    L = Σ_q ω_q · softplus(−y_q · (r̂(t_new) − r̂(t_bnd)) / τ) / Σ_q ω_q.

With static priorities, keeping the running top k of a stream keeps exactly the top k of every
prefix, so the same scan gives the teacher's labels and any scorer's own decisions.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
from flax import struct

Array = jax.Array


class Weighting(enum.StrEnum):
    UNIFORM = "uniform"  # ω = 1 at every decision
    MARGIN = "margin"  # ω = min(1, |r(t_new) − r(t_bnd)|): near-ties (label noise) count less


@struct.dataclass
class BoundaryLabels:
    """The teacher's decision at every query q, shaped [..., S] over q.

    Attributes:
        t_new: int32 token leaving the window (q − w).
        t_bnd: int32 the teacher's boundary token (0 where there is no decision).
        y: float32 +1 keep t_new, −1 evict it.
        weight: float32 ω (0 where no decision: t_new is a sink or k slots are not full yet).
    """

    t_new: Array
    t_bnd: Array
    y: Array
    weight: Array


def _check(s: int, sinks: int, window: int, k: int) -> None:
    if sinks < 0 or window < 1 or k < 1:
        raise ValueError(f"need sinks >= 0, window >= 1, k >= 1; got {sinks}, {window}, {k}")
    if sinks + window + k >= s:
        raise ValueError(
            f"budget sinks + window + k = {sinks + window + k} must be < the {s} tokens of a "
            "sequence, else nothing is ever evicted"
        )


def running_boundaries(priority: Array, *, sinks: int, window: int, k: int):
    """Scan a running top k over a static priority stream.

    Args:
        priority: [N, S] float32 priority of every token.

    Returns:
        t_bnd [N, S] int32 (k-th best of E'_q), full [N, S] bool (E'_q has >= k tokens).
    """
    n, s = priority.shape
    rows = jnp.arange(n)

    def step(carry, q):
        vals, idx, count = carry  # [N, k] top-k values / token ids, [N] how many inserted
        t_new = q - window
        lowest = jnp.argmin(vals, axis=-1).astype(jnp.int32)
        full = count >= k
        t_bnd = jnp.where(full, idx[rows, lowest], 0)
        eligible = t_new >= sinks
        new_val = priority[:, jnp.maximum(t_new, 0)]
        slot = jnp.where(count < k, count, lowest)
        put = eligible & ((count < k) | (new_val > vals[rows, lowest]))
        vals = vals.at[rows, slot].set(jnp.where(put, new_val, vals[rows, slot]))
        idx = idx.at[rows, slot].set(jnp.where(put, t_new, idx[rows, slot]))
        count = count + eligible.astype(jnp.int32)
        return (vals, idx, count), (t_bnd, full & eligible)

    init = (
        jnp.full((n, k), jnp.inf, jnp.float32),
        jnp.zeros((n, k), jnp.int32),
        jnp.zeros((n,), jnp.int32),
    )
    _, (t_bnd, full) = jax.lax.scan(step, init, jnp.arange(s, dtype=jnp.int32))
    return t_bnd.T, full.T


def boundary_labels(
    log_mass: Array,
    *,
    sinks: int,
    window: int,
    k: int,
    decay: float = 0.0,
    weighting: Weighting = Weighting.UNIFORM,
) -> BoundaryLabels:
    """The teacher's keep/evict decisions from targets `log_mass` [..., S] float32."""
    *lead, s = log_mass.shape
    _check(s, sinks, window, k)
    flat = log_mass.reshape(-1, s).astype(jnp.float32)
    prio = flat + decay * jnp.arange(s, dtype=jnp.float32)[None, :]
    t_bnd, full = running_boundaries(prio, sinks=sinks, window=window, k=k)
    t_new = jnp.broadcast_to(jnp.maximum(jnp.arange(s, dtype=jnp.int32) - window, 0), t_bnd.shape)
    p_new = jnp.take_along_axis(prio, t_new, axis=1)
    p_bnd = jnp.take_along_axis(prio, t_bnd, axis=1)
    y = jnp.where(p_new > p_bnd, 1.0, -1.0)
    if Weighting(weighting) == Weighting.MARGIN:
        w = jnp.minimum(1.0, jnp.abs(p_new - p_bnd))
    else:
        w = jnp.ones_like(y)
    weight = jnp.where(full & jnp.isfinite(p_new) & jnp.isfinite(p_bnd), w, 0.0)
    shape = lambda x: x.reshape(*lead, s)
    return BoundaryLabels(
        t_new=shape(t_new.astype(jnp.int32)),
        t_bnd=shape(t_bnd),
        y=shape(y),
        weight=shape(weight),
    )


def boundary_loss(scores: Array, labels: BoundaryLabels, *, tau: float = 1.0) -> Array:
    """Weighted mean boundary logistic loss of scorer outputs `scores` [..., S] float32."""
    if tau <= 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    r_new = jnp.take_along_axis(scores, labels.t_new, axis=-1)
    r_bnd = jnp.take_along_axis(scores, labels.t_bnd, axis=-1)
    y, w = labels.y.astype(scores.dtype), labels.weight.astype(scores.dtype)
    per = jax.nn.softplus(-y * (r_new - r_bnd) / tau)
    return jnp.sum(w * per) / jnp.maximum(jnp.sum(w), 1e-9)


def own_decisions(priority: Array, *, sinks: int, window: int, k: int) -> Array:
    """[..., S] bool: does a policy ranking by static `priority` [..., S] keep t_new at q?
    (True where there is no decision: t_new is a sink or free slots remain.)"""
    *lead, s = priority.shape
    flat = priority.reshape(-1, s).astype(jnp.float32)
    t_bnd, full = running_boundaries(flat, sinks=sinks, window=window, k=k)
    t_new = jnp.broadcast_to(jnp.maximum(jnp.arange(s, dtype=jnp.int32) - window, 0), t_bnd.shape)
    beats = jnp.take_along_axis(flat, t_new, axis=1) > jnp.take_along_axis(flat, t_bnd, axis=1)
    keep = beats | ~full  # while slots are free every leaving token is kept
    return keep.reshape(*lead, s)


def dynamic_decisions(score: Array, *, sinks: int, window: int, k: int) -> Array:
    """[..., S] bool decisions of a ranking by a score that changes with q (H2O's accumulated
    mass): t_new is kept iff fewer than k tokens of E'_q score higher at q.

    Args:
        score: [..., S(q), S(t)] float32 score of token t as seen at query q.
    """
    s = score.shape[-1]
    q = jnp.arange(s)[:, None]
    t = jnp.arange(s)[None, :]
    t_new = jnp.maximum(q[:, 0] - window, 0)
    new = jnp.take_along_axis(score, jnp.broadcast_to(t_new[:, None], score.shape[:-1] + (1,)), -1)
    elig = jnp.broadcast_to((t >= sinks) & (t < q - window), score.shape)
    above = jnp.sum(elig & (score > new), axis=-1)
    return above < k


def agreement(keep: Array, labels: BoundaryLabels) -> Array:
    """Fraction of the teacher's decisions (weight > 0) that `keep` [..., S] bool agrees with."""
    decided = labels.weight > 0
    same = keep == (labels.y > 0)
    return jnp.sum(decided & same) / jnp.maximum(jnp.sum(decided), 1)
