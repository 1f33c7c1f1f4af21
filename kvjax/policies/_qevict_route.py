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
from kvjax.quant import (
    dequantize_per_channel,
    dequantize_per_token,
    pack,
    quantize_per_channel,
    quantize_per_token,
    unpack,
)

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


def _put(a: Array, idx: Array, x: Array) -> Array:
    """a[b, h, idx[b, h, n]] = x[b, h, n] (out-of-range idx dropped)."""
    b, h = idx.shape[:2]
    bi = jnp.arange(b)[:, None, None]
    hi = jnp.arange(h)[None, :, None]
    return a.at[bi, hi, idx].set(x.astype(a.dtype), mode="drop")


def route(
    layer: LayerCache,
    lay: Layout,
    new_k: Array,
    new_v: Array,
    new_score: Array,
    new_win: Array,
    event: Array,
) -> LayerCache:
    """One routing event: rank the resident windows and the K windows leaving the ring.

    Args:
        layer: the layer's cache (scores already include this call's attention).
        lay: its layout.
        new_k, new_v: [B, H, K, ω, D] full-precision data of the windows leaving the ring.
        new_score: [B, H, K, ω] float32 their tokens' cumulative scores.
        new_win: [B, K] int32 their window ids (-1 = none).
        event: [B] bool, this batch row routes now (other rows keep their tiers).

    Returns:
        The updated layer.
    """
    b, h = layer.pos.shape[:2]
    w, f, npg, base = lay.window, lay.fp_windows, lay.pages, lay.fp_base
    d = layer.k.shape[-1]
    kk = new_win.shape[-1]
    lb, led = layer.lowbit, layer.aux.fp_ledger
    fp_k = layer.k[:, :, base:].reshape(b, h, f, w, d)
    fp_v = layer.v[:, :, base:].reshape(b, h, f, w, d)
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
    link = _put(link, jnp.where(led >= 0, led, npg), jnp.where(fp_win >= 0, t_fp, EVICTED))
    held = (active & (t_pg != EVICTED)) | (link != EVICTED)
    # Windows quantized now (first demotion): full-precision slots without a ledger, new windows.
    need_q = jnp.concatenate([(fp_win >= 0) & (t_fp == INT) & (led < 0), t_new == INT], -1)
    page_dst = _allocate(need_q, ~held, npg)  # [B, H, F + K]
    # Windows entering full precision: promoted pages (from their ledger), new windows.
    need_fp = jnp.concatenate([promote, t_new == FP], -1)
    fp_dst = _allocate(need_fp, ~stay_fp, f)  # [B, H, P + K]

    # Low-bit tier: free, dormant, reactivated, then freshly quantized pages.
    tok = jnp.arange(w, dtype=jnp.int32).reshape(1, 1, 1, w)
    new_pos = lay.sinks + nwin[..., None] * w + tok  # [B, H, K, ω]
    pos = jnp.where((held & ~promote)[..., None], lb.pos, -1)
    pos = _put(pos, jnp.where((t_fp == INT) & (led >= 0), led, npg), fp_pos)
    pg_score = _put(lb.score, jnp.where((t_fp == INT) & (led >= 0), led, npg), fp_score)
    src_k = jnp.concatenate([fp_k, new_k.astype(fp_k.dtype)], axis=2)  # [B, H, F + K, ω, D]
    src_v = jnp.concatenate([fp_v, new_v.astype(fp_v.dtype)], axis=2)
    kc, ks, kz = quantize_per_channel(src_k, lb.bits)
    vc, vs, vz = quantize_per_token(src_v, lb.bits, d // lb.v_scale.shape[-1])
    src_pos = jnp.concatenate([fp_pos, new_pos], axis=2)
    src_score = jnp.concatenate([fp_score, jnp.sum(new_score, axis=-1)], axis=-1)
    lb = lb.replace(
        k=_put(lb.k, page_dst, pack(kc, lb.bits)),
        v=_put(lb.v, page_dst, pack(vc, lb.bits)),
        k_scale=_put(lb.k_scale, page_dst, ks),
        k_zero=_put(lb.k_zero, page_dst, kz),
        v_scale=_put(lb.v_scale, page_dst, vs),
        v_zero=_put(lb.v_zero, page_dst, vz),
        pos=_put(pos, page_dst, src_pos),
        score=_put(pg_score, page_dst, src_score),
        held=_put(held, page_dst, jnp.ones(page_dst.shape, bool)),
    )

    # Full-precision windows: promoted pages come back dequantized from their ledger.
    deq_k = dequantize_per_channel(
        unpack(layer.lowbit.k, lb.bits), layer.lowbit.k_scale, layer.lowbit.k_zero, layer.k.dtype
    )
    deq_v = dequantize_per_token(
        unpack(layer.lowbit.v, lb.bits), layer.lowbit.v_scale, layer.lowbit.v_zero, layer.v.dtype
    )
    in_k = jnp.concatenate([deq_k, new_k.astype(layer.k.dtype)], axis=2)  # [B, H, P + K, ω, D]
    in_v = jnp.concatenate([deq_v, new_v.astype(layer.v.dtype)], axis=2)
    first = (tok == 0).astype(jnp.float32)
    in_score = jnp.concatenate([layer.lowbit.score[..., None] * first, new_score], axis=2)
    in_pos = jnp.concatenate([layer.lowbit.pos, new_pos], axis=2)
    slot = jnp.where(fp_dst[..., None] < f, base + fp_dst[..., None] * w + tok, layer.capacity)
    slot = slot.reshape(b, h, -1)  # [B, H, (P + K)·ω] token slots
    flat = lambda x: x.reshape(b, h, slot.shape[-1], *x.shape[4:])
    keep_pos = jnp.where(stay_fp[..., None], fp_pos, -1).reshape(b, h, f * w)
    all_pos = jax.lax.dynamic_update_slice_in_dim(layer.pos, keep_pos, base, axis=2)
    fp_led = jnp.where(stay_fp, led, -1)
    page_idx = jnp.arange(npg, dtype=jnp.int32)
    src_led = jnp.concatenate(
        [jnp.broadcast_to(page_idx, (b, h, npg)), jnp.full((b, h, kk), -1, jnp.int32)], -1
    )
    return layer.replace(
        k=_put(layer.k, slot, flat(in_k)),
        v=_put(layer.v, slot, flat(in_v)),
        pos=_put(all_pos, slot, flat(in_pos)),
        score=_put(layer.score, slot, flat(in_score)),
        lowbit=lb,
        aux=QEvictAux(fp_ledger=_put(fp_led, fp_dst, src_led)),
    )
