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
(`_qevict_move.apply_moves`), as one loop that takes zero rounds on steps without an event.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.policies._qevict_move import move_sizes, put
from kvjax.policies._qevict_rank import EVICTED, FP, INT, assign_tiers, join, true_first

Array = jax.Array


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
    """The windows a routing event moves, as one list processed `moves` entries per round:
    first the windows to quantize, then the windows entering full precision. It opens with F
    entries that move no data, only metadata (`route` writes every entry's): the window of
    full-precision slot f demoted back onto its ledger page, whose codes are already there.

    Attributes:
        src: [B, H, F + Lq + Lf] int32 the candidate each entry reads: a full-precision
            window slot f in [0, F), a page F + p, or a window leaving the ring F + P + k.
            Entries [0, F) are slot f's demotion back onto its ledger, [F, F + Lq) quantize
            moves (the needed ones first), [F + Lq, F + Lq + Lf) promote moves.
        dst: [B, H, F + Lq + Lf] int32 where each entry goes: a page (the first two kinds;
            P = nowhere) or a full-precision window slot (promote; F = nowhere).
        counts: [B, H, 2] int32 windows of each kind this head moves, quantize then promote
            (0 when nothing moves; one array: two would each be sliced out by a kernel of its
            own).
    """

    src: Array
    dst: Array
    counts: Array


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def empty_plan(b: int, h: int, lay: Layout, kk: int, moves: int | None) -> MovePlan:
    """The plan of a step without a routing event: nothing moves (zero counts: the lists are
    never read)."""
    n_q, n_fp, m = move_sizes(lay, kk, moves)
    lists = jnp.zeros((b, h, lay.fp_windows + _round_up(n_q, m) + _round_up(n_fp, m)), jnp.int32)
    return MovePlan(src=lists, dst=lists, counts=jnp.zeros((b, h, 2), jnp.int32))


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
        The new small arrays (positions, scores and ledger of every window slot and page,
        those of windows entering full precision included) and the move plan (`apply_moves`
        moves their K/V and codes).
    """
    b, h = st.pos.shape[:2]
    w, f, npg, base = lay.window, lay.fp_windows, lay.pages, lay.fp_base
    kk = new_win.shape[-1]
    st = st._replace(pos=_empty_left_ring(st.pos, lay, new_win, event))
    led = st.fp_ledger
    fp_pos = st.pos[:, :, base:].reshape(b, h, f, w)
    fp_score = jnp.sum(st.score[:, :, base:].reshape(b, h, f, w), axis=-1)
    nwin = jnp.broadcast_to(new_win[:, None, :], (b, h, kk))
    # Per candidate (N = F + P + K), one kernel where a concatenation of per-kind pieces was
    # five: its window (from its first position; -1: none), then its ledger page or first
    # position (a slot's ledger page, a page's own first position, -1 for a new window:
    # >= 0 where the window has low-bit codes).
    n = f + npg + kk
    first_pg = _column(st.page_pos, 0)
    new_first = jnp.where(nwin >= 0, lay.sinks + nwin * w, -1)
    x = join([_column(fp_pos, 0), first_pg, new_first, led, first_pg, jnp.full_like(nwin, -1)])
    x = jnp.where(np.arange(2 * n) < n, jnp.where(x >= 0, (x - lay.sinks) // w, -1), x)
    x = jax.lax.optimization_barrier(x)
    win, ledger = x[..., :n], x[..., n:] >= 0
    fp_win, active = win[..., :f], win[..., f : f + npg] >= 0
    score = jax.lax.optimization_barrier(
        join([fp_score, st.page_score, jnp.sum(new_score, axis=-1)])
    )
    # Per candidate from `win` and its kind (an iota: 0 slot, 1 page, 2 new window), fused
    # into the readers, where a concatenation of per-kind pieces was a kernel of its own.
    kind = jax.lax.broadcasted_iota(jnp.int32, win.shape, 2)
    kind = (kind >= f).astype(jnp.int32) + (kind >= f + npg).astype(jnp.int32)
    current = jnp.where((win >= 0) & (kind < 2), jnp.where(kind == 0, FP, INT), EVICTED)
    tier = jnp.where(event[:, None, None], assign_tiers(win, score, ledger, lay), current)
    t_fp, t_pg = tier[..., :f], tier[..., f : f + npg]

    # Page bookkeeping: a dormant page follows the window of the full-precision slot linking it.
    stay_fp = (fp_win >= 0) & (t_fp == FP)
    promote = active & (t_pg == FP)
    linked = (led >= 0) & (fp_win >= 0) & (t_fp != EVICTED)
    link = _linked_pages(jnp.where(linked, led, npg), npg)
    held = (active & (t_pg != EVICTED)) | link
    # Over every candidate (one elementwise kernel each, where pieces per kind were several
    # kernels and a concatenation; a tier other than EVICTED implies a window; a page's
    # tier is never FP unless promoted, a slot's never INT unless demoted): windows
    # quantized now (first demotion: full-precision slots without a ledger, new windows),
    # and windows entering full precision (promoted pages, from their ledger; new windows).
    need_q = (tier == INT) & (kind != 1) & ~ledger
    need_fp = (tier == FP) & (kind != 0)
    # Each list needed-first, and the free pages and slots in index order: the i-th needed
    # window goes to the i-th free page (slot). Only windows that change storage are read,
    # `moves` of each kind per round.
    (order_q, order_fp, free_pg, free_fp), counts = true_first(
        [need_q, need_fp, ~held, ~stay_fp], counted=2
    )
    n_q, _, m = move_sizes(lay, kk, moves)
    lists = jnp.concatenate([order_q, order_fp, free_pg, free_fp], -1)
    back = jnp.where((t_fp == INT) & (led >= 0), led, npg)  # demoted back onto its ledger
    plan = _plan(lists, counts, back, lay, n_q, m)

    # Metadata of every page and every window slot (small arrays) as rows of one table, pages
    # then slots, rewritten by one gather and one scatter (one of each to compile, where a
    # table per kind was two of each and their index kernels). A row is the window's first
    # position (a window's ω positions follow it: every window in a slot or a page is whole),
    # token scores [ω] (a slot's), ledger page (a slot's), held and page score (a page's);
    # every candidate has a row of each kind's fields, so the writes read one candidate
    # table: windows demoted back onto their dormant ledger page and windows quantized now onto
    # their new page (disjoint: one is held, the other free); windows entering full precision.
    bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.int32)
    tok = jnp.arange(w, dtype=jnp.int32).reshape(1, 1, 1, w)
    fp_tok_score = st.score[:, :, base:].reshape(b, h, f, w)
    one = lambda x: x[..., None]
    first = jnp.where(win >= 0, lay.sinks + win * w, -1)  # [B, H, N] each candidate's
    # The plan's source rows [B, H, E, ω + 4]; a promoted page stays its (dormant) ledger entry.
    scores = (fp_tok_score, st.page_score, new_score)
    cand_rows = _source_rows(first, scores, score, plan.src, w)
    zeros = lambda r, c: jnp.zeros((b, h, r, c), jnp.int32)
    rows = jnp.concatenate(  # [B, H, P + F, ω + 4]
        [
            jnp.concatenate(
                [
                    one(jnp.where(held & ~promote, first_pg, -1)),
                    zeros(npg, w + 1),
                    one(held.astype(jnp.int32)),
                    one(bits(st.page_score)),
                ],
                -1,
            ),
            jnp.concatenate(
                [
                    one(jnp.where(stay_fp, _column(fp_pos, 0), -1)),
                    bits(fp_tok_score),
                    one(jnp.where(stay_fp, led, -1)),
                    zeros(f, 2),
                ],
                -1,
            ),
        ],
        2,
    )
    # The writes are the plan's entries, their pages and slots numbered as the rows are.
    to_page = np.arange(plan.dst.shape[-1]).reshape(1, 1, -1) < f + _round_up(n_q, m)
    dst = jnp.where(to_page, jnp.where(plan.dst < npg, plan.dst, npg + f), npg + plan.dst)
    rows = put(rows, dst, cand_rows)
    pg_rows, fp_rows = rows[:, :, :npg], rows[:, :, npg:]
    whole = lambda first: jnp.where(first[..., None] >= 0, first[..., None] + tok, -1)
    region = lambda a, x: jax.lax.dynamic_update_slice_in_dim(a, x.reshape(b, h, f * w), base, 2)
    new = RouteState(
        pos=region(st.pos, whole(_column(fp_rows, 0))),
        score=region(st.score, jax.lax.bitcast_convert_type(fp_rows[..., 1 : w + 1], jnp.float32)),
        page_pos=whole(_column(pg_rows, 0)),
        page_score=jax.lax.bitcast_convert_type(_column(pg_rows, w + 3), jnp.float32),
        held=_column(pg_rows, w + 2) != 0,
        fp_ledger=_column(fp_rows, w + 1),
    )
    return new, plan


def _empty_left_ring(pos: Array, lay: Layout, new_win: Array, event: Array) -> Array:
    """pos [B, H, C] with the ring slots of the windows leaving now (new_win [B, K], the
    highest the last) emptied in the batch rows that route (event [B]); their tokens are
    candidates of this event."""
    s, r, w = lay.sinks, lay.ring, lay.window
    base_after = s + (jnp.max(new_win, axis=-1) + 1) * w  # [B] first position still in the ring
    ring = pos[:, :, s : s + r]
    gone = event[:, None, None] & (ring >= 0) & (ring < base_after[:, None, None])
    return jax.lax.dynamic_update_slice_in_dim(pos, jnp.where(gone, -1, ring), s, axis=2)


def _plan(lists: Array, counts: Array, back: Array, lay: Layout, n_q: int, m: int) -> MovePlan:
    """The MovePlan from `true_first`'s four lists end to end, lists [B, H, N + N + P + F]
    (candidates to quantize, candidates entering full precision, each needed first; free
    pages, free slots, free first; N = F + P + K candidates), the counts [B, H, 2] of
    the needed ones (at most n_q, F + K, to quantize; P + K to bring in) and back [B, H, F]
    int32, the ledger page each slot's window is demoted back onto (P: none).

    Each of src and dst is one gather at constant indices and one select (one kernel each,
    where padding and concatenating the four pieces were six): a list entry i of a kind
    reads its i-th needed window and goes to the kind's i-th free page or slot, or nowhere
    (P, F) past the kind's count. Past the needed ones src is any candidate (never moved).
    The F entries that open the plan, slot f demoted back onto page back[f], are one more
    select in each (a concatenation would be a kernel of its own)."""
    f, npg = lay.fp_windows, lay.pages
    n = (lists.shape[-1] - npg - f) // 2
    n_fp = n - f
    lq, lf = _round_up(n_q, m), _round_up(n_fp, m)
    # entry within its kind (slot f's own entry: f)
    i = np.concatenate([np.arange(f), np.arange(lq), np.arange(lf)]).astype(np.int32)
    back_entry = np.arange(f + lq + lf) < f
    quantize = np.arange(f + lq + lf) < f + lq
    # Where each entry's window and free place sit in `lists` (clipped into its piece, or
    # anywhere for an empty piece: past the count, never used).
    last = max(lists.shape[-1] - 1, 0)
    clip = lambda at, size: np.clip(at + np.minimum(i, max(size - 1, 0)), 0, last)
    at_src = np.where(quantize, clip(0, n), clip(n, n))
    at_dst = np.where(quantize, clip(2 * n, npg), clip(2 * n + npg, f))
    take = lambda at: jnp.take(lists, at.astype(np.int32), axis=-1, mode="clip")
    src, free = take(at_src), take(at_dst)
    i, quantize = i.reshape(1, 1, -1), quantize.reshape(1, 1, -1)  # [1, 1, F + Lq + Lf]
    back_entry = back_entry.reshape(1, 1, -1)
    count = jnp.where(quantize, counts[..., :1], counts[..., 1:])
    nowhere = np.where(quantize, npg, f).astype(np.int32)
    return MovePlan(
        # Candidates numbered as the move loop does: window slots, pages, new windows (0 past
        # the count, as the lists' padding was: a select, where a bare gather's output took
        # a layout XLA then copied in the cond's other branch).
        src=jnp.where(back_entry, i, jnp.where(i < count, src, 0)),
        dst=jnp.where(
            back_entry,
            jnp.pad(back, ((0, 0), (0, 0), (0, lq + lf))),
            jnp.where(i < count, free, nowhere),
        ),
        counts=counts,
    )


def _source_rows(first: Array, scores, score: Array, src: Array, w: int) -> Array:
    """The metadata rows [B, H, E, ω + 4] of the candidates src [B, H, E] names: first
    position, token scores [ω] (a page's score on its first token), page index (a page's,
    else -1), 1 (held), window score. first [B, H, N]: each candidate's first position (-1:
    none); scores: (slot token scores [B, H, F, ω], page scores [B, H, P], new token scores
    [B, H, K, ω]); candidates are numbered slots, pages, new windows; score [B, H, N].

    One table of every candidate's row, read at src: one kernel fewer to compile per field
    than gathering each field from its kind's arrays (XLA:CPU), and no more bytes on a GPU,
    where the plan has about as many entries E as there are candidates (at Llama-3-8B
    shapes, B = 8, 32K: 4,737 of each a head; docs/lab/2026-12-06-h100-layer-index.md)."""
    fp_tok, pg_score, new_tok = scores
    f, npg = fp_tok.shape[2], pg_score.shape[2]
    one = lambda x: x[..., None]
    bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.int32)
    tok = jnp.arange(w, dtype=jnp.int32).reshape(1, 1, 1, w)
    b, h, n = first.shape
    at_n = jax.lax.broadcasted_iota(jnp.int32, (b, h, n), 2)
    pg_first = jnp.where(tok == 0, pg_score[..., None], 0.0)
    cand = jnp.concatenate(  # [B, H, N, ω + 4]
        [
            one(first),
            bits(jnp.concatenate([fp_tok, pg_first, new_tok], axis=2)),
            one(jnp.where((at_n >= f) & (at_n < f + npg), at_n - f, -1)),
            jnp.ones((b, h, n, 1), jnp.int32),
            one(bits(score)),
        ],
        -1,
    )
    return _take(cand, src)


def _linked_pages(led: Array, npg: int) -> Array:
    """[B, H, P] bool: the pages named by led [B, H, F] (an index >= P names none). Where F·P
    is small, one compare-and-any over the pairs (a single kernel to compile, where a scatter
    is three); else a scatter."""
    b, h, f = led.shape
    if f * npg > _DENSE_PAIRS:
        return put(jnp.zeros((b, h, npg), bool), led, led < npg)
    pages = jnp.arange(npg, dtype=jnp.int32).reshape(1, 1, 1, npg)
    return jnp.any(led[..., :, None] == pages, axis=-2)


_DENSE_PAIRS = 1 << 16  # window slots x pages up to which the links are found without a scatter


def _column(rows: Array, j: int) -> Array:
    """rows [B, H, N, X] -> [B, H, N], column j, as a strided slice of the rows end to end.
    (`rows[..., j]` is a slice and a reshape that drops a size-1 axis, and at batch 1 XLA's
    layout assignment gives that reshape a layout with the batch axis major, so the decode
    loop copied the event's outputs in and out of that layout.)"""
    b, h, n, x = rows.shape
    return rows.reshape(b, h, n * x)[..., j::x]


def _take(rows: Array, idx: Array) -> Array:
    """rows [B, H, N, X] at idx [B, H, n] -> [B, H, n, X]."""
    return jnp.take_along_axis(rows, idx[..., None], axis=2, mode="clip")
