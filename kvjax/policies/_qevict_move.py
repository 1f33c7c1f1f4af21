"""QEvict's data movement at a routing event: quantize windows at their first demotion, bring
promoted windows back from their ledger, copy windows leaving the ring. Only the planned
candidates are read, so an event costs the bytes it moves (see `route`), and the tiers are
updated in place (no cond carries them)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from kvjax.quant import (
    dequantize_per_channel,
    dequantize_per_token,
    pack,
    quantize_per_channel,
    quantize_per_token,
    unpack,
)

Array = jax.Array


def put(a: Array, idx: Array, x: Array) -> Array:
    """a[b, h, idx[b, h, n]] = x[b, h, n] (out-of-range idx dropped)."""
    b, h = idx.shape[:2]
    bi = jnp.arange(b)[:, None, None]
    hi = jnp.arange(h)[None, :, None]
    return a.at[bi, hi, idx].set(x.astype(a.dtype), mode="drop")


def move_sizes(lay, kk: int, moves: int | None) -> tuple[int, int, int, int]:
    """(n_q, n_fp, windows per quantize round, windows per promote round) of a layout with kk
    windows leaving the ring per call."""
    n_q, n_fp = lay.fp_windows + kk, lay.pages + kk
    return n_q, n_fp, min(moves or n_q, n_q), min(moves or n_fp, n_fp)


class MoveJob(NamedTuple):
    """One layer's share of a routing event's data movement (the inputs of `apply_moves`).

    Attributes:
        layer: the layer with the event's metadata already applied (pos of windows leaving full
            precision cleared; pages' pos/score/held set).
        lay: its Layout (static).
        plan: the MovePlan.
        old_page_pos, old_page_score: pages' pos [B, H, P, ω] and score [B, H, P] before the
            event (a promoted page's positions and score move with it).
        new_k, new_v: [B, H, K, ω, D] the windows leaving the ring; new_score [B, H, K, ω].
        nwin: [B, H, K] their window ids.
    """

    layer: Any
    lay: Any
    plan: Any
    old_page_pos: Array
    old_page_score: Array
    new_k: Array
    new_v: Array
    new_score: Array
    nwin: Array


def apply_moves(jobs: Sequence[MoveJob], *, moves: int | None) -> tuple[Any, ...]:
    """Do a routing event's data movement (`MovePlan`) in every layer of `jobs`: quantize the
    windows demoted for the first time into their pages, then write the windows entering full
    precision (promoted pages dequantized from their ledger, or windows leaving the ring) into
    their slots.

    Runs outside any cond, as two loops shared by all layers: the quantize rounds, then the
    promote rounds, each of `moves` windows per layer; a layer whose plan has fewer rounds than
    the most of any layer drops its writes in the extra rounds. A loop whose trip count is known
    only on the device costs a device-to-host sync per iteration on GPU (~22 µs on the H200,
    `scripts/policy_step_probe.py`), so one pair of loops per step, not per layer. Without an
    event both loops take zero rounds. Quantizing finishes before anything is written to full
    precision (a demoted window's slot may receive a promoted one).

    Args:
        jobs: one MoveJob per layer.
        moves: windows per round (the plans'; None: all candidates in one round).

    Returns:
        The layers with codes, K/V, positions and scores moved.
    """
    rounds_q = functools.reduce(jnp.maximum, [j.plan.rounds_q for j in jobs])
    rounds_fp = functools.reduce(jnp.maximum, [j.plan.rounds_fp for j in jobs])
    lbs = jax.lax.fori_loop(
        0,
        rounds_q,
        lambda r, lbs: tuple(
            _quantize_round(j, r, lb, moves) for j, lb in zip(jobs, lbs, strict=True)
        ),
        tuple(j.layer.lowbit for j in jobs),
    )
    # Every quantizing read of full precision is done before the writes below.
    lbs, kvs = jax.lax.optimization_barrier((lbs, tuple((j.layer.k, j.layer.v) for j in jobs)))
    promote = [_promoter(j, lb, moves) for j, lb in zip(jobs, lbs, strict=True)]
    outs = jax.lax.fori_loop(
        0,
        rounds_fp,
        lambda r, cs: tuple(f(r, c) for f, c in zip(promote, cs, strict=True)),
        tuple((k, v, j.layer.pos, j.layer.score) for j, (k, v) in zip(jobs, kvs, strict=True)),
    )
    return tuple(
        j.layer.replace(k=k, v=v, pos=pos, score=score, lowbit=lb)
        for j, lb, (k, v, pos, score) in zip(jobs, lbs, outs, strict=True)
    )


def apply_moves_stacked(job: MoveJob, lay, *, moves: int | None):
    """`apply_moves` over a stacked cache: `job` holds every layer's MoveJob with a leading
    [L] axis on each array (`lay`, static, given apart). The same two loops, each round one
    `jax.vmap` over the layers, so the scatters write the stacked buffers in place and the
    trip counts are the most rounds of any layer (a layer past its rounds drops its writes).

    Returns:
        The stacked layers with codes, K/V, positions and scores moved.
    """
    layer = job.layer
    # Each loop sees only what it reads: the quantize rounds the full-precision K/V (not
    # written there), the promote rounds only the shapes of the arrays they carry.
    fixed = job._replace(layer=layer.replace(lowbit=None))
    with_lay = lambda j: j._replace(lay=lay)
    quantize = jax.vmap(
        lambda j, lb, r: _quantize_round(with_lay(j), r, lb, moves), in_axes=(0, 0, None)
    )
    lb = jax.lax.fori_loop(
        0, jnp.max(job.plan.rounds_q), lambda r, lb: quantize(fixed, lb, r), layer.lowbit
    )
    lb, (k, v) = jax.lax.optimization_barrier((lb, (layer.k, layer.v)))

    def promote_one(j, lb, carry, r):
        j = with_lay(j._replace(layer=j.layer.replace(k=carry[0], v=carry[1], pos=carry[2])))
        return _promoter(j, lb, moves)(r, carry)

    promote = jax.vmap(promote_one, in_axes=(0, 0, 0, None))
    slim = job._replace(layer=layer.replace(k=None, v=None, pos=None, score=None, lowbit=None))
    k, v, pos, score = jax.lax.fori_loop(
        0,
        jnp.max(job.plan.rounds_fp),
        lambda r, c: promote(slim, lb, c, r),
        (k, v, layer.pos, layer.score),
    )
    return layer.replace(k=k, v=v, pos=pos, score=score, lowbit=lb)


def _pick(resident, new, idx, n_res):
    """Entry idx [B, H, n] of (resident ‖ new): resident is a function of indices in
    [0, n_res), new is [B, H, K, ...]."""
    kk = new.shape[2]
    nw = jnp.take_along_axis(new, _expand(jnp.clip(idx - n_res, 0, kk - 1), new), axis=2)
    if n_res == 0:
        return nw
    r = resident(jnp.clip(idx, 0, n_res - 1))
    return jnp.where(_expand(idx < n_res, r), r, nw.astype(r.dtype))


def _quantize_round(job: MoveJob, r: Array, lb, moves: int | None):
    """Round r of the first demotions: quantize once, into the allocated page (a no-op once r
    reaches this layer's rounds)."""
    layer, lay, plan = job.layer, job.lay, job.plan
    b, h = layer.pos.shape[:2]
    w, base, d = lay.window, lay.fp_base, layer.k.shape[-1]
    _, _, mq, _ = move_sizes(lay, job.new_k.shape[2], moves)
    tok = jnp.arange(w, dtype=jnp.int32).reshape(1, 1, 1, w)

    def fp_window(a):
        def get(i):  # [B, H, n] window slots -> [B, H, n, ω, ...]
            t = (base + i[..., None] * w + tok).reshape(b, h, -1)
            out = jnp.take_along_axis(a, _expand(t, a), axis=2)
            return out.reshape(b, h, i.shape[-1], w, *a.shape[3:])

        return get

    sq = jax.lax.dynamic_slice_in_dim(plan.order_q, r * mq, mq, axis=2)
    src_k = _pick(fp_window(layer.k), job.new_k, sq, lay.fp_windows)
    src_v = _pick(fp_window(layer.v), job.new_v, sq, lay.fp_windows)
    dst = jnp.take_along_axis(plan.page_dst, sq, axis=-1)
    dst = jnp.where(r < plan.rounds_q, dst, lb.pos.shape[2])  # past its rounds: dropped
    kc, ks, kz = quantize_per_channel(src_k, lb.bits)
    vc, vs, vz = quantize_per_token(src_v, lb.bits, d // lb.v_scale.shape[-1])
    return lb.replace(
        k=put(lb.k, dst, pack(kc, lb.bits)),
        v=put(lb.v, dst, pack(vc, lb.bits)),
        k_scale=put(lb.k_scale, dst, ks),
        k_zero=put(lb.k_zero, dst, kz),
        v_scale=put(lb.v_scale, dst, vs),
        v_zero=put(lb.v_zero, dst, vz),
    )


def _promoter(job: MoveJob, lb, moves: int | None):
    """The promote round of one layer, (r, (k, v, pos, score)) -> same: promoted pages
    dequantized from their ledger (`lb`, after quantizing), or new windows, written to their
    full-precision slots (a no-op once r reaches this layer's rounds)."""
    layer, lay, plan = job.layer, job.lay, job.plan
    b, h = layer.pos.shape[:2]
    w, f, base = lay.window, lay.fp_windows, lay.fp_base
    _, _, _, mf = move_sizes(lay, job.new_k.shape[2], moves)
    tok = jnp.arange(w, dtype=jnp.int32).reshape(1, 1, 1, w)
    # (A promoted page is held, so the quantize rounds never wrote it.)
    npg = lb.pos.shape[2]
    page = lambda a: lambda i: jnp.take_along_axis(a, _expand(i, a), axis=2)
    deq_k = lambda i: dequantize_per_channel(
        unpack(page(lb.k)(i), lb.bits), page(lb.k_scale)(i), page(lb.k_zero)(i), layer.k.dtype
    )
    deq_v = lambda i: dequantize_per_token(
        unpack(page(lb.v)(i), lb.bits), page(lb.v_scale)(i), page(lb.v_zero)(i), layer.v.dtype
    )
    first = (tok == 0).astype(jnp.float32)
    new_pos = lay.sinks + job.nwin[..., None] * w + tok

    def promote_round(r, carry):
        k, v, pos, score = carry
        sf = jax.lax.dynamic_slice_in_dim(plan.order_fp, r * mf, mf, axis=2)
        in_k = _pick(deq_k, job.new_k, sf, npg)
        in_v = _pick(deq_v, job.new_v, sf, npg)
        in_score = _pick(
            lambda i: page(job.old_page_score)(i)[..., None] * first, job.new_score, sf, npg
        )
        in_pos = _pick(page(job.old_page_pos), new_pos, sf, npg)
        dst = jnp.take_along_axis(plan.fp_dst, sf, axis=-1)
        live = (dst < f) & (r < plan.rounds_fp)  # past its rounds: dropped
        slot = jnp.where(live[..., None], base + dst[..., None] * w + tok, layer.capacity)
        slot = slot.reshape(b, h, -1)  # [B, H, m·ω] token slots
        flat = lambda x: x.reshape(b, h, slot.shape[-1], *x.shape[4:])
        return (
            put(k, slot, flat(in_k)),
            put(v, slot, flat(in_v)),
            put(pos, slot, flat(in_pos)),
            put(score, slot, flat(in_score)),
        )

    return promote_round


def _expand(idx: Array, like: Array) -> Array:
    """idx [B, H, n] (or [B, H, n·ω]) reshaped to broadcast against `like` along axis 2."""
    extra = like.ndim - idx.ndim
    return idx.reshape(idx.shape + (1,) * extra) if extra > 0 else idx
