"""QEvict's routing event: rank every window by cumulative attention and move it between the
full-precision tier, the write-once low-bit ledger and eviction, under a byte budget.

Layout of one layer (per batch row and KV head):
* full-precision slots [0, sinks) hold the sinks, [sinks, sinks + R) the ring of recent tokens
  (the local band plus the window being filled), then F window slots of ω tokens each;
* low-bit pages (one window each) are *active* (attended: `pos` set), *dormant* (held, `pos`
  EMPTY: the ledger entry of a window promoted back to full precision) or free;
* `QEvictAux.fp_ledger[f]` links a full-precision window slot to its dormant ledger page.

The ranking runs under `lax.cond` on routing events only (every ω decode steps) and touches only
small per-slot arrays; the K/V and code movement it plans runs outside the cond
(`_qevict_move.apply_moves`), as loops that take zero rounds on steps without an event.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.policies._qevict_move import move_sizes, put

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


class RouteState(NamedTuple):
    """The small per-slot arrays a routing event reads and rewrites (never K/V or codes: a
    `lax.cond` that carried those would make XLA copy them every decode step).

    Attributes:
        pos: [B, H, C] int32 full-precision slot positions.
        score: [B, H, C] float32 full-precision slot scores.
        page_pos: [B, H, P, ω] int32 low-bit page positions.
        page_score: [B, H, P] float32 page scores.
        held: [B, H, P] bool pages holding a ledger entry.
        fp_ledger: [B, H, F] int32 (QEvictAux.fp_ledger).
    """

    pos: Array
    score: Array
    page_pos: Array
    page_score: Array
    held: Array
    fp_ledger: Array


class MovePlan(NamedTuple):
    """The data a routing event moves, as index lists processed `moves` windows per round.

    Attributes:
        order_q: [B, H, Lq] candidates (full-precision windows ‖ new windows) to quantize,
            the needed ones first, padded with the sentinel index n_q.
        page_dst: [B, H, n_q + 1] their destination pages (pages = dropped; the last entry is
            the sentinel's).
        order_fp: [B, H, Lf] candidates (pages ‖ new windows) entering full precision.
        fp_dst: [B, H, n_fp + 1] their destination window slots (fp_windows = dropped).
        rounds_q, rounds_fp: [] int32 rounds of each kind (0 when nothing moves).
    """

    order_q: Array
    page_dst: Array
    order_fp: Array
    fp_dst: Array
    rounds_q: Array
    rounds_fp: Array


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def empty_plan(b: int, h: int, lay: Layout, kk: int, moves: int | None) -> MovePlan:
    """The plan of a step without a routing event: nothing moves."""
    n_q, n_fp, mq, mf = move_sizes(lay, kk, moves)
    full = lambda n, v: jnp.full((b, h, n), v, jnp.int32)
    zero = jnp.zeros((), jnp.int32)
    return MovePlan(
        order_q=full(_round_up(n_q, mq), n_q),
        page_dst=full(n_q + 1, lay.pages),
        order_fp=full(_round_up(n_fp, mf), n_fp),
        fp_dst=full(n_fp + 1, lay.fp_windows),
        rounds_q=zero,
        rounds_fp=zero,
    )


def route(
    st: RouteState,
    lay: Layout,
    new_score: Array,
    new_win: Array,
    event: Array,
    *,
    moves: int | None = None,
) -> tuple[RouteState, MovePlan]:
    """One routing event: rank the resident windows and the K windows leaving the ring, and
    plan the data movement (`apply_moves` does it, outside any cond).

    Args:
        st: the layer's small arrays (scores already include this call's attention).
        lay: its layout.
        new_score: [B, H, K, ω] float32 the leaving windows' tokens' cumulative scores.
        new_win: [B, K] int32 their window ids (-1 = none).
        event: [B] bool, this batch row routes now (other rows keep their tiers).
        moves: windows quantized, and windows entering full precision, per round and KV head
            (None: one round over every candidate). An event runs as many rounds as its
            busiest head needs.

    Returns:
        The new small arrays (full-precision positions of windows leaving full precision
        cleared; those entering it are written by `apply_moves`) and the move plan.
    """
    b, h = st.pos.shape[:2]
    w, f, npg, base = lay.window, lay.fp_windows, lay.pages, lay.fp_base
    kk = new_win.shape[-1]
    led = st.fp_ledger
    fp_pos = st.pos[:, :, base:].reshape(b, h, f, w)
    fp_win = jnp.where(fp_pos[..., 0] >= 0, (fp_pos[..., 0] - lay.sinks) // w, -1)
    fp_score = jnp.sum(st.score[:, :, base:].reshape(b, h, f, w), axis=-1)
    active = st.page_pos[..., 0] >= 0
    pg_win = jnp.where(active, (st.page_pos[..., 0] - lay.sinks) // w, -1)
    nwin = jnp.broadcast_to(new_win[:, None, :], (b, h, kk))
    win = jnp.concatenate([fp_win, pg_win, nwin], axis=-1)
    score = jnp.concatenate([fp_score, st.page_score, jnp.sum(new_score, axis=-1)], axis=-1)
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

    # Only windows that change storage are read, `moves` of each kind per round.
    n_q, n_fp, mq, mf = move_sizes(lay, kk, moves)

    def order(need, n, m):
        idx = jnp.argsort(~need, axis=-1, stable=True).astype(jnp.int32)  # needed first
        pad = jnp.full((b, h, _round_up(n, m) - n), n, jnp.int32)
        rounds = -(-jnp.max(jnp.sum(need, axis=-1, dtype=jnp.int32)) // m)
        return jnp.concatenate([idx, pad], axis=-1), rounds

    order_q, rounds_q = order(need_q, n_q, mq)
    order_fp, rounds_fp = order(need_fp, n_fp, mf)
    sentinel = lambda dst, size: jnp.concatenate([dst, jnp.full((b, h, 1), size, dst.dtype)], -1)
    plan = MovePlan(
        order_q=order_q,
        page_dst=sentinel(page_dst, npg).astype(jnp.int32),
        order_fp=order_fp,
        fp_dst=sentinel(fp_dst, f).astype(jnp.int32),
        rounds_q=rounds_q,
        rounds_fp=rounds_fp,
    )

    # Metadata of every page and slot (small arrays).
    keep_pos = jnp.where(stay_fp[..., None], fp_pos, -1).reshape(b, h, f * w)
    all_pos = jax.lax.dynamic_update_slice_in_dim(st.pos, keep_pos, base, axis=2)
    pos = jnp.where((held & ~promote)[..., None], st.page_pos, -1)
    pos = put(pos, jnp.where((t_fp == INT) & (led >= 0), led, npg), fp_pos)
    pg_score = put(st.page_score, jnp.where((t_fp == INT) & (led >= 0), led, npg), fp_score)
    tok = jnp.arange(w, dtype=jnp.int32).reshape(1, 1, 1, w)
    src_pos = jnp.concatenate([fp_pos, lay.sinks + nwin[..., None] * w + tok], axis=2)
    src_score = jnp.concatenate([fp_score, jnp.sum(new_score, axis=-1)], axis=-1)
    fp_led = jnp.where(stay_fp, led, -1)
    everything = jnp.broadcast_to(jnp.arange(npg, dtype=jnp.int32), (b, h, npg))
    src_led = jnp.concatenate([everything, jnp.full((b, h, kk), -1, jnp.int32)], -1)
    new = RouteState(
        pos=all_pos,
        score=st.score,
        page_pos=put(pos, page_dst, src_pos),
        page_score=put(pg_score, page_dst, src_score),
        held=put(held, page_dst, jnp.ones(page_dst.shape, bool)),
        fp_ledger=put(fp_led, fp_dst, src_led),
    )
    return new, plan
