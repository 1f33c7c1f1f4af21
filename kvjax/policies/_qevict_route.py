"""QEvict's routing event: rank every window by cumulative attention and move it between the
full-precision tier, the write-once low-bit ledger and eviction, under a byte budget.

Layout of one layer (per batch row and KV head):
* full-precision slots [0, sinks) hold the sinks, [sinks, sinks + R) the ring of recent tokens
  (the local band plus the window being filled), then F window slots of ω tokens each;
* low-bit pages (one window each) are *active* (attended: `pos` set), *dormant* (held, `pos`
  EMPTY: the ledger entry of a window promoted back to full precision) or free;
* `QEvictAux.fp_ledger[f]` links a full-precision window slot to its dormant ledger page.

Everything here runs under `lax.cond` on routing events only (every ω decode steps).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.cache import LayerCache
from kvjax.policies._qevict_move import move_windows, put

Array = jax.Array

FP, INT, EVICTED = 1, 2, 0  # tiers of a routed window (0 also marks "no window")


@struct.dataclass
class QEvictAux:
    """Per-layer QEvict state.

    Attributes:
        fp_ledger: [B, Hkv, F] int32 ledger page of each full-precision window slot's window
            (its dormant entry), or -1 if the window was never quantized.
    """

    fp_ledger: Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    """Static sizes of one layer's QEvict cache (all byte counts per KV head).

    Attributes:
        sinks: first tokens kept in full precision forever.
        ring: R = band + ω, recent full-precision tokens (never ranked).
        window: ω, tokens per window.
        fp_windows: F, full-precision window slots.
        pages: low-bit pages (active + dormant ledger entries).
        budget_bytes: M_r, bytes for routed windows (the budget minus sinks and ring).
        quant_bytes: ⌊q·M_r⌋, the share the low-bit tier may take under pressure.
        fp_window_bytes: K/V bytes of one full-precision window.
        page_bytes: K/V bytes of one low-bit window (codes, scales, zeros).
    """

    sinks: int
    ring: int
    window: int
    fp_windows: int
    pages: int
    budget_bytes: int
    quant_bytes: int
    fp_window_bytes: int
    page_bytes: int

    @property
    def fp_base(self) -> int:
        """First full-precision window slot."""
        return self.sinks + self.ring

    @property
    def capacity(self) -> int:
        return self.sinks + self.ring + self.fp_windows * self.window


def _take(x: Array, idx: Array) -> Array:
    return jnp.take_along_axis(x, idx, axis=-1)


def assign_tiers(win: Array, score: Array, has_ledger: Array, lay: Layout) -> Array:
    """Tier of every candidate window, by rank (score, then newer window first).

    The k best windows are full precision for the largest k with
    cost_fp(k) + min(q·M_r, b_q·(n − k)) <= M_r, where a window's full-precision cost is
    b_fp plus b_q if it keeps a dormant ledger entry; the next windows go to the low-bit tier
    while their pages fit in the bytes left; the rest are evicted. Under pressure this is the
    paper's split (⌊(1−q)M/b_fp⌋ full-precision windows); with room to spare every window stays
    full precision.

    Args:
        win: [B, H, N] int32 window ids (-1 = no candidate).
        score: [B, H, N] float32 cumulative attention mass.
        has_ledger: [B, H, N] bool, the window already has low-bit codes.
        lay: the layer's layout.

    Returns:
        [B, H, N] int32 in {EVICTED, FP, INT}.
    """
    n = win.shape[-1]
    valid = win >= 0
    o1 = jnp.argsort(-win, axis=-1, stable=True)
    o2 = jnp.argsort(-_take(jnp.where(valid, score, -jnp.inf), o1), axis=-1, stable=True)
    order = _take(o1, o2)
    v_s = _take(valid, order)
    led_s = _take(has_ledger, order).astype(jnp.int32)
    cost = jnp.where(v_s, lay.fp_window_bytes + led_s * lay.page_bytes, 0)
    cum = jnp.cumsum(cost, axis=-1)
    k = jnp.arange(1, n + 1, dtype=jnp.int32).reshape((1,) * (win.ndim - 1) + (n,))
    rest = jnp.sum(v_s, axis=-1, keepdims=True, dtype=jnp.int32) - k
    reserve = jnp.minimum(lay.quant_bytes, lay.page_bytes * rest)
    fp_s = v_s & (cum + reserve <= lay.budget_bytes) & (k <= lay.fp_windows)
    left = lay.budget_bytes - jnp.sum(jnp.where(fp_s, cost, 0), axis=-1, keepdims=True)
    j = jnp.cumsum(v_s & ~fp_s, axis=-1, dtype=jnp.int32)
    q_s = v_s & ~fp_s & (j * lay.page_bytes <= left) & (j <= lay.pages)
    tier_s = jnp.where(fp_s, FP, jnp.where(q_s, INT, EVICTED)).astype(jnp.int32)
    return _take(tier_s, jnp.argsort(order, axis=-1))


def _allocate(need: Array, free: Array, size: int) -> Array:
    """Destination of each needing entry [B, H, N]: the free slots [B, H, size] in index order
    (size = drop). The caller guarantees enough free slots."""
    free_idx = jnp.argsort(~free, axis=-1, stable=True)
    r = jnp.clip(jnp.cumsum(need, axis=-1) - 1, 0, size - 1)
    return jnp.where(need, _take(free_idx, r), size) if size else jnp.full_like(r, size)


def route(
    layer: LayerCache,
    lay: Layout,
    new_k: Array,
    new_v: Array,
    new_score: Array,
    new_win: Array,
    event: Array,
    *,
    moves: int | None = None,
) -> LayerCache:
    """One routing event: rank the resident windows and the K windows leaving the ring.

    Args:
        layer: the layer's cache (scores already include this call's attention).
        lay: its layout.
        new_k, new_v: [B, H, K, ω, D] full-precision data of the windows leaving the ring.
        new_score: [B, H, K, ω] float32 their tokens' cumulative scores.
        new_win: [B, K] int32 their window ids (-1 = none).
        event: [B] bool, this batch row routes now (other rows keep their tiers).
        moves: fast-path bound on windows quantized and on windows entering full precision
            per event and KV head (None: always take the path over every candidate).

    Returns:
        The updated layer.
    """
    b, h = layer.pos.shape[:2]
    w, f, npg, base = lay.window, lay.fp_windows, lay.pages, lay.fp_base
    kk = new_win.shape[-1]
    lb, led = layer.lowbit, layer.aux.fp_ledger
    fp_pos = layer.pos[:, :, base:].reshape(b, h, f, w)
    fp_win = jnp.where(fp_pos[..., 0] >= 0, (fp_pos[..., 0] - lay.sinks) // w, -1)
    fp_score = jnp.sum(layer.score[:, :, base:].reshape(b, h, f, w), axis=-1)
    active = lb.pos[..., 0] >= 0
    pg_win = jnp.where(active, (lb.pos[..., 0] - lay.sinks) // w, -1)
    nwin = jnp.broadcast_to(new_win[:, None, :], (b, h, kk))
    win = jnp.concatenate([fp_win, pg_win, nwin], axis=-1)
    score = jnp.concatenate([fp_score, lb.score, jnp.sum(new_score, axis=-1)], axis=-1)
    ledger = jnp.concatenate([led >= 0, active, jnp.zeros((b, h, kk), bool)], axis=-1)
    current = jnp.where(
        win >= 0,
        jnp.concatenate(
            [jnp.full_like(fp_win, FP), jnp.full_like(pg_win, INT), jnp.full_like(nwin, EVICTED)],
            -1,
        ),
        EVICTED,
    )
    tier = jnp.where(event[:, None, None], assign_tiers(win, score, ledger, lay), current)
    t_fp, t_pg, t_new = tier[..., :f], tier[..., f : f + npg], tier[..., f + npg :]

    # Page bookkeeping: a dormant page follows the window of the full-precision slot linking it.
    stay_fp = (fp_win >= 0) & (t_fp == FP)
    promote = active & (t_pg == FP)
    link = jnp.full((b, h, npg), EVICTED, jnp.int32)
    link = put(link, jnp.where(led >= 0, led, npg), jnp.where(fp_win >= 0, t_fp, EVICTED))
    held = (active & (t_pg != EVICTED)) | (link != EVICTED)
    # Windows quantized now (first demotion): full-precision slots without a ledger, new windows.
    need_q = jnp.concatenate([(fp_win >= 0) & (t_fp == INT) & (led < 0), t_new == INT], -1)
    page_dst = _allocate(need_q, ~held, npg)  # [B, H, F + K]
    # Windows entering full precision: promoted pages (from their ledger), new windows.
    need_fp = jnp.concatenate([promote, t_new == FP], -1)
    fp_dst = _allocate(need_fp, ~stay_fp, f)  # [B, H, P + K]

    # Only windows that change storage are read: the first `moves` of each kind on the fast
    # path; an event that moves more takes the exact path over every candidate.
    n_q, n_fp = need_q.shape[-1], need_fp.shape[-1]
    keep_pos = jnp.where(stay_fp[..., None], fp_pos, -1).reshape(b, h, f * w)
    all_pos = jax.lax.dynamic_update_slice_in_dim(layer.pos, keep_pos, base, axis=2)
    everything = lambda n: jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, h, n))
    first = lambda need, n: jnp.argsort(~need, axis=-1, stable=True)[..., :n].astype(jnp.int32)
    move = lambda sq, sf: move_windows(
        layer, lay, new_k, new_v, new_score, nwin, page_dst, fp_dst, sq, sf, all_pos
    )
    if moves is None or moves >= max(n_q, n_fp):
        moved = move(everything(n_q), everything(n_fp))
    else:
        many = jnp.any(jnp.sum(need_q, -1) > moves) | jnp.any(jnp.sum(need_fp, -1) > moves)
        moved = jax.lax.cond(
            many,
            lambda: move(everything(n_q), everything(n_fp)),
            lambda: move(first(need_q, moves), first(need_fp, moves)),
        )
    lb_new, k_new, v_new, pos_new, score_new = moved

    # Metadata of every page and slot (small arrays).
    lb = layer.lowbit
    pos = jnp.where((held & ~promote)[..., None], lb.pos, -1)
    pos = put(pos, jnp.where((t_fp == INT) & (led >= 0), led, npg), fp_pos)
    pg_score = put(lb.score, jnp.where((t_fp == INT) & (led >= 0), led, npg), fp_score)
    tok = jnp.arange(w, dtype=jnp.int32).reshape(1, 1, 1, w)
    src_pos = jnp.concatenate([fp_pos, lay.sinks + nwin[..., None] * w + tok], axis=2)
    src_score = jnp.concatenate([fp_score, jnp.sum(new_score, axis=-1)], axis=-1)
    lb = lb_new.replace(
        pos=put(pos, page_dst, src_pos),
        score=put(pg_score, page_dst, src_score),
        held=put(held, page_dst, jnp.ones(page_dst.shape, bool)),
    )
    fp_led = jnp.where(stay_fp, led, -1)
    src_led = jnp.concatenate([everything(npg), jnp.full((b, h, kk), -1, jnp.int32)], -1)
    return layer.replace(
        k=k_new,
        v=v_new,
        pos=pos_new,
        score=score_new,
        lowbit=lb,
        aux=QEvictAux(fp_ledger=put(fp_led, fp_dst, src_led)),
    )
