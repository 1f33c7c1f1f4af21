"""QEvict's data movement at a routing event: quantize windows at their first demotion, bring
promoted windows back from their ledger, copy windows leaving the ring. Only the planned
candidates are read, so an event costs the bytes it moves (see `route`), and the tiers are
updated in place (no cond carries them)."""

from __future__ import annotations

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


def apply_moves(
    layer, lay, plan, old_page_pos, old_page_score, new_k, new_v, new_score, nwin, *, moves
):
    """Do a routing event's data movement (`MovePlan`): quantize the windows demoted for the
    first time into their pages, then write the windows entering full precision (promoted pages
    dequantized from their ledger, or windows leaving the ring) into their slots.

    Runs outside any cond: each kind is a loop of plan.rounds_* rounds (0 without an event) of
    `moves` windows, updating the tiers in place. Quantizing finishes before anything is written
    to full precision (a demoted window's slot may receive a promoted one).

    Args:
        layer: the layer with the event's metadata already applied (pos of windows leaving full
            precision cleared; pages' pos/score/held set).
        lay: its Layout.
        plan: the MovePlan.
        old_page_pos, old_page_score: pages' pos [B, H, P, ω] and score [B, H, P] before the
            event (a promoted page's positions and score move with it).
        new_k, new_v: [B, H, K, ω, D] the windows leaving the ring; new_score [B, H, K, ω];
            nwin [B, H, K] their window ids.
        moves: windows per round (the plan's; None: all candidates in one round).

    Returns:
        The layer with codes, K/V, positions and scores moved.
    """
    b, h = layer.pos.shape[:2]
    w, f, base, d = lay.window, lay.fp_windows, lay.fp_base, layer.k.shape[-1]
    kk = new_k.shape[2]
    tok = jnp.arange(w, dtype=jnp.int32).reshape(1, 1, 1, w)
    _, _, mq, mf = move_sizes(lay, kk, moves)

    def pick(resident, new, idx, n_res):
        """Entry idx [B, H, n] of (resident ‖ new): resident is a function of indices in
        [0, n_res), new is [B, H, K, ...]."""
        nw = jnp.take_along_axis(new, _expand(jnp.clip(idx - n_res, 0, kk - 1), new), axis=2)
        if n_res == 0:
            return nw
        r = resident(jnp.clip(idx, 0, n_res - 1))
        return jnp.where(_expand(idx < n_res, r), r, nw.astype(r.dtype))

    def fp_window(a):
        def get(i):  # [B, H, n] window slots -> [B, H, n, ω, ...]
            t = (base + i[..., None] * w + tok).reshape(b, h, -1)
            out = jnp.take_along_axis(a, _expand(t, a), axis=2)
            return out.reshape(b, h, i.shape[-1], w, *a.shape[3:])

        return get

    # First demotions: quantize once, into the allocated page.
    def quantize_round(r, lb):
        sq = jax.lax.dynamic_slice_in_dim(plan.order_q, r * mq, mq, axis=2)
        src_k = pick(fp_window(layer.k), new_k, sq, f)
        src_v = pick(fp_window(layer.v), new_v, sq, f)
        dst = jnp.take_along_axis(plan.page_dst, sq, axis=-1)
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

    lb = jax.lax.fori_loop(0, plan.rounds_q, quantize_round, layer.lowbit)
    # Every quantizing read of full precision is done before the writes below.
    lb, k0, v0 = jax.lax.optimization_barrier((lb, layer.k, layer.v))

    # Entering full precision: promoted pages dequantized from their ledger, or new windows.
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
    new_pos = lay.sinks + nwin[..., None] * w + tok

    def promote_round(r, carry):
        k, v, pos, score = carry
        sf = jax.lax.dynamic_slice_in_dim(plan.order_fp, r * mf, mf, axis=2)
        in_k = pick(deq_k, new_k, sf, npg)
        in_v = pick(deq_v, new_v, sf, npg)
        in_score = pick(lambda i: page(old_page_score)(i)[..., None] * first, new_score, sf, npg)
        in_pos = pick(page(old_page_pos), new_pos, sf, npg)
        dst = jnp.take_along_axis(plan.fp_dst, sf, axis=-1)
        slot = jnp.where(dst[..., None] < f, base + dst[..., None] * w + tok, layer.capacity)
        slot = slot.reshape(b, h, -1)  # [B, H, m·ω] token slots
        flat = lambda x: x.reshape(b, h, slot.shape[-1], *x.shape[4:])
        return (
            put(k, slot, flat(in_k)),
            put(v, slot, flat(in_v)),
            put(pos, slot, flat(in_pos)),
            put(score, slot, flat(in_score)),
        )

    k, v, pos, score = jax.lax.fori_loop(
        0, plan.rounds_fp, promote_round, (k0, v0, layer.pos, layer.score)
    )
    return layer.replace(k=k, v=v, pos=pos, score=score, lowbit=lb)


def _expand(idx: Array, like: Array) -> Array:
    """idx [B, H, n] (or [B, H, n·ω]) reshaped to broadcast against `like` along axis 2."""
    extra = like.ndim - idx.ndim
    return idx.reshape(idx.shape + (1,) * extra) if extra > 0 else idx
