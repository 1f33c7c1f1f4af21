"""QEvict's data movement at a routing event: quantize windows at their first demotion, bring
promoted windows back from their ledger, copy windows leaving the ring. Only the planned
candidates are read, so an event costs the bytes it moves (see `route`), and the tiers are
updated in place (no cond carries them).

Both kinds of move run in one loop whose round body can do either: it reads `moves` source
windows (full-precision window slots, ledger pages dequantized, or windows leaving the ring),
quantizes them into their pages in a quantize round and writes them into their full-precision
slots in a promote round, the other kind's writes dropped. One body is one set of kernels to
compile instead of two (compile time follows the number of kernels).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def put(a: Array, idx: Array, x: Array) -> Array:
    """a[b, h, idx[b, h, n]] = x[b, h, n] (out-of-range idx dropped)."""
    b, h = idx.shape[:2]
    bi = jnp.arange(b)[:, None, None]
    hi = jnp.arange(h)[None, :, None]
    return a.at[bi, hi, idx].set(x.astype(a.dtype), mode="drop")


def move_sizes(lay, kk: int, moves: int | None) -> tuple[int, int, int]:
    """(n_q, n_fp, windows per round) of a layout with kk windows leaving the ring per call:
    n_q candidates to quantize (full-precision windows ‖ new windows), n_fp to bring into full
    precision (pages ‖ new windows)."""
    n_q, n_fp = lay.fp_windows + kk, lay.pages + kk
    return n_q, n_fp, min(moves or max(n_q, n_fp), max(n_q, n_fp))


class MoveJob(NamedTuple):
    """One layer's share of a routing event's data movement (the inputs of `apply_moves`).

    Attributes:
        layer: the layer with the event's metadata already applied (positions, scores and
            ledger of every slot and page).
        lay: its Layout (static).
        plan: the MovePlan.
        new_k, new_v: [B, H, K, ω, D] the windows leaving the ring.
    """

    layer: Any
    lay: Any
    plan: Any
    new_k: Array
    new_v: Array


def apply_moves(jobs: Sequence[MoveJob], *, moves: int | None) -> tuple[Any, ...]:
    """Do a routing event's data movement (`MovePlan`) in every layer of `jobs`: quantize the
    windows demoted for the first time into their pages, then write the windows entering full
    precision (promoted pages dequantized from their ledger, or windows leaving the ring) into
    their slots.

    One loop shared by all layers: the quantize rounds, then the promote rounds, each of
    `moves` windows per layer; a layer with fewer windows to move than the busiest drops its
    writes in the extra rounds. A loop whose trip count is known only on the device costs a
    device-to-host sync per iteration on GPU (~22 µs on the H200,
    `scripts/policy_step_probe.py`), so one loop per step, not per layer. Without an event it
    takes zero rounds. Every quantize round runs before any promote round (a demoted window's
    slot may receive a promoted one).

    Args:
        jobs: one MoveJob per layer.
        moves: windows per round (the plans'; None: all candidates in one round).

    Returns:
        The layers with codes and K/V moved.
    """
    m = move_sizes(jobs[0].lay, jobs[0].new_k.shape[2], moves)[2]
    rounds = _busiest_rounds(jnp.stack([j.plan.counts for j in jobs]), m)
    slim = [j._replace(layer=j.layer.replace(k=None, v=None, lowbit=None)) for j in jobs]

    def body(r, rounds_q, carry):
        return tuple(
            _move_round(j, c, r, rounds_q, moves) for j, c in zip(slim, carry, strict=True)
        )

    init = tuple((j.layer.k, j.layer.v, j.layer.lowbit) for j in jobs)
    out = _rounds_loop(rounds, body, init)
    return tuple(
        j.layer.replace(k=k, v=v, lowbit=lb) for j, (k, v, lb) in zip(jobs, out, strict=True)
    )


def apply_moves_stacked(job: MoveJob, lay, counts: Array, *, moves: int | None):
    """`apply_moves` over a stacked cache: `job` holds every layer's MoveJob with a leading
    [L] axis on each array (`lay`, static, given apart; its plan's counts None), `counts`
    [L, B, H, 2] each head's windows to quantize and to bring into full precision (zeros
    without an event).

    From `_FLAT_MIN_HEADS` heads (layers x batch x KV heads) on, the moves of every head of
    every layer form one list per kind (all quantize moves, then all promote moves: within a
    kind the moves are independent, and a demoted window's slot may receive a promoted one),
    taken `_flat_round(...)` entries a round over the stack seen as one long axis of heads,
    so the scatters write the stacked buffers in place and an event costs its total moves,
    not the busiest head's moves times every head. With fewer heads, per-head rounds
    (`_apply_moves_vmapped`).

    Returns:
        The stacked layers with codes and K/V moved.
    """
    layer = job.layer
    n_layers, b, h, cap = layer.k.shape[:4]
    heads = n_layers * b * h
    if heads < _FLAT_MIN_HEADS:
        return _apply_moves_vmapped(job, lay, counts, moves=moves)
    flat = lambda a: a.reshape(1, 1, heads * a.shape[3], *a.shape[4:])
    init = (flat(layer.k), flat(layer.v), jax.tree.map(flat, layer.lowbit))
    per_head = lambda a: a.reshape(heads, *a.shape[3:])
    plan = job.plan
    src, dst = per_head(plan.src), per_head(plan.dst)
    new_k, new_v = per_head(job.new_k), per_head(job.new_v)
    n_q, _, m = move_sizes(lay, job.new_k.shape[3], moves)
    big = _flat_round(m, b * h, n_layers)
    counts = per_head(counts)  # [heads, 2]
    ends = jnp.cumsum(counts, axis=0, dtype=jnp.int32)  # each head's entries end here
    starts = ends - counts
    rounds = (ends[-1] + (big - 1)) // big  # [2]: rounds of each kind
    entry = np.arange(big, dtype=np.int32)
    lq = _round_up(n_q, m)

    def run(kind: int, carry):
        """Every round of one kind (0: quantize, 1: bring into full precision)."""

        def body(r, carry):
            g = r * big + entry  # [big] entries of this kind
            head = jnp.sum(ends[None, :, kind] <= g[:, None], axis=1, dtype=jnp.int32)
            ok = head < heads
            head = jnp.minimum(head, heads - 1)
            at = lay.fp_windows + kind * lq + g - starts[head, kind]
            nowhere = (lay.pages, lay.fp_windows)[kind]
            t = jnp.where(ok, dst[head, at], nowhere)
            return _move_flat(lay, carry, head, src[head, at], t, kind == 0, new_k, new_v, cap)

        return jax.lax.fori_loop(0, rounds[kind], body, carry)

    # Two loops, each body doing its kind's work only (one body for both would read and
    # write both kinds every round, the other kind's writes dropped).
    k, v, lb = run(1, run(0, init))
    back = lambda a, like: a.reshape(like.shape)
    return layer.replace(
        k=back(k, layer.k), v=back(v, layer.v),
        lowbit=jax.tree.map(back, lb, layer.lowbit),
    )  # fmt: skip


def _apply_moves_vmapped(job: MoveJob, lay, counts: Array, *, moves: int | None):
    """`apply_moves_stacked` by per-head rounds: each round one `jax.vmap` over the layers of
    `_move_round` (`moves` windows of every head), as many rounds as the busiest head needs.
    Its loop body is smaller (fewer kernels to compile) and with few heads the rounds cost
    little more than the flat list's."""
    layer = job.layer
    rounds = _busiest_rounds(counts, move_sizes(lay, job.new_k.shape[3], moves)[2])
    slim = job._replace(layer=layer.replace(k=None, v=None, lowbit=None))
    one = lambda j, c, r, rounds_q: _move_round(j._replace(lay=lay), c, r, rounds_q, moves)
    body = lambda r, rounds_q, c: jax.vmap(one, in_axes=(0, 0, None, None))(slim, c, r, rounds_q)
    k, v, lb = _rounds_loop(rounds, body, (layer.k, layer.v, layer.lowbit))
    return layer.replace(k=k, v=v, lowbit=lb)


def _busiest_rounds(counts: Array, m: int) -> Array:
    """[2] int32 rounds of `m` windows the busiest head needs of each kind, counts [L, B, H, 2]
    (>= 0) each head's windows to quantize and to bring into full precision."""
    return jnp.max((counts + (m - 1)) // m, axis=(0, 1, 2))


# Heads (layers x batch x KV heads) from which the stacked move loop takes every head's moves
# as one list: per-head rounds cost the busiest head's rounds times every head, the flat list
# its total moves, at more kernels to compile (CPU: QEvict's scanned decode loop 160 kernels
# against 135 at SmolLM2's 90 heads). From as many heads the routing event also reads its
# moved windows' metadata from each kind's arrays (`_qevict_route._source_rows`: 3 kernels
# more than one table of every candidate at SmolLM2's shapes).
_FLAT_MIN_HEADS = 256


def _flat_round(m: int, heads_per_layer: int, n_layers: int) -> int:
    """Entries a round of the stacked move loop takes: `m` windows for each head of up to
    `_FLAT_LAYERS` layers (the per-layer loop moved m for every head of every layer)."""
    return m * heads_per_layer * min(n_layers, _FLAT_LAYERS)


_FLAT_LAYERS = 32


def _move_flat(lay, carry, head, src, dst, quantize: bool, new_k, new_v, cap: int):
    """One round of `apply_moves_stacked`: entry j moves candidate src[j] of head head[j] to
    dst[j], the stack's K/V [1, 1, heads·C, D] and low-bit tier seen with every head end to
    end on the slot and page axes (`_move_round` on per-head axes). `quantize` (static): the
    sources are window slots or windows leaving the ring, quantized into pages dst; else
    pages (dequantized from their ledger) or windows leaving the ring, written into window
    slots dst. A dst out of range moves nothing."""
    k, v, lb = carry
    w, f, npg, base = lay.window, lay.fp_windows, lay.pages, lay.fp_base
    heads = new_k.shape[0]
    kk = new_k.shape[1]
    new = jnp.clip(src - f - npg, 0, kk - 1)
    if quantize:  # from window slots or the ring, into pages
        at = head * cap + base + jnp.clip(src, 0, max(f - 1, 0)) * w
        slot = (src < f)[:, None, None]
        pick = lambda a, n: (
            n[head, new] if f == 0 else jnp.where(slot, _rows(a, at, w), n[head, new])
        )
        x_k, x_v = jax.lax.optimization_barrier((pick(k, new_k), pick(v, new_v)))
        to_page = jnp.where(dst < npg, head * npg + dst, heads * npg)
        return k, v, lb.write(to_page[None, None], x_k[None, None], x_v[None, None])
    # from pages (their ledger) or the ring, into window slots
    deq_k, deq_v = lb.read((head * npg + jnp.clip(src - f, 0, npg - 1))[None, None], k.dtype)
    page = (src < f + npg)[:, None, None]
    x_k = jnp.where(page, deq_k[0, 0].astype(k.dtype), new_k[head, new])
    x_v = jnp.where(page, deq_v[0, 0].astype(v.dtype), new_v[head, new])
    # Window starts ascending and distinct: by head, then by slot within a head (the i-th
    # window goes to the i-th free slot); the dropped ones past the end, distinct as well.
    gone = heads * cap + jnp.arange(dst.shape[0], dtype=jnp.int32) * w
    start = jnp.where(dst < f, head * cap + base + dst * w, gone)
    return _put_rows(k, start, x_k), _put_rows(v, start, x_v), lb


def _rows(a: Array, start: Array, w: int) -> Array:
    """a [1, 1, R, D] rows [start[j], start[j] + w) for each j: [n, w, D] (a gather of whole
    windows, one index each; starts in range)."""
    dn = jax.lax.GatherDimensionNumbers(
        offset_dims=(1, 2), collapsed_slice_dims=(), start_index_map=(0,)
    )
    return jax.lax.gather(a[0, 0], start[:, None], dn, (w, a.shape[-1]), mode="clip")


def _put_rows(a: Array, start: Array, x: Array) -> Array:
    """a [1, 1, R, D] with rows [start[j], start[j] + w) = x[j] [w, D] (a scatter of whole
    windows, one index each; a window past R is dropped). The starts must be ascending and
    distinct: XLA's GPU scatter then writes whole rows at a time (4.7x faster than without
    the promise at 32K windows on an H100, `scripts/window_scatter_probe.py`)."""
    dn = jax.lax.ScatterDimensionNumbers(
        update_window_dims=(1, 2), inserted_window_dims=(), scatter_dims_to_operand_dims=(0,)
    )
    out = jax.lax.scatter(
        a[0, 0], start[:, None], x.astype(a.dtype), dn, mode="drop",
        indices_are_sorted=True, unique_indices=True,
    )  # fmt: skip
    return out[None, None]


def _rounds_loop(rounds: Array, body, init):
    """`body(r, rounds_q, carry) -> carry` for r in [0, rounds_q + rounds_fp), rounds [2]
    int32 = (rounds_q, rounds_fp). The rounds ride in the loop's carry, their sum taken in its
    condition and rounds_q read in its body: sliced out before the loop, each scalar was a
    kernel of its own."""

    def step(c):
        r, n, x = c
        return r + 1, n, body(r, n[0], x)

    cond = lambda c: c[0] < c[1][0] + c[1][1]
    return jax.lax.while_loop(cond, step, (jnp.zeros((), jnp.int32), rounds, init))[2]


def _move_round(job: MoveJob, carry, r: Array, rounds_q: Array, moves: int | None):
    """Round r of one layer's moves, (k, v, lowbit) -> same: rounds below `rounds_q` quantize
    their windows into pages, the later ones write theirs to full-precision slots.

    The plan's entry i of this round reads candidate `src` (a full-precision window slot f,
    page F + p or new window F + P + k) and writes it to `dst` (a page, or a window slot);
    entries with nothing to move have an out-of-range `dst`, so their writes are dropped.
    """
    k, v, lb = carry
    layer, lay, plan = job.layer, job.lay, job.plan
    b, h = layer.pos.shape[:2]
    w, f, npg, base = lay.window, lay.fp_windows, lay.pages, lay.fp_base
    n_q, _, m = move_sizes(lay, job.new_k.shape[2], moves)
    quantize = r < rounds_q
    # (after the plan's F metadata-only entries)
    start = f + jnp.where(quantize, r * m, _round_up(n_q, m) + (r - rounds_q) * m)
    src = jax.lax.dynamic_slice_in_dim(plan.src, start, m, axis=2)  # [B, H, m]
    dst = jax.lax.dynamic_slice_in_dim(plan.dst, start, m, axis=2)
    tok = jnp.arange(w, dtype=jnp.int32).reshape(1, 1, 1, w)

    def window(a, new, deq):
        """The source windows [B, H, m, ω, D] of one of K or V (`deq`: its pages at src)."""
        x = _take_new(new, src - f - npg)
        x = jnp.where((src < f + npg)[..., None, None], deq.astype(x.dtype), x)
        if f == 0:
            return x
        t = (base + jnp.clip(src, 0, f - 1)[..., None] * w + tok).reshape(b, h, m * w)
        fp = jnp.take_along_axis(a, t[..., None], axis=2, mode="clip").reshape(x.shape)
        return jnp.where((src < f)[..., None, None], fp, x)

    deq_k, deq_v = lb.read(jnp.clip(src - f, 0, npg - 1), k.dtype)
    x_k, x_v = window(k, job.new_k, deq_k), window(v, job.new_v, deq_v)
    # Materialized once: else XLA's CPU compiler fuses the reads and dequantization into each
    # of their consumers (quantization, code packing, the scatters' updates), several copies
    # of the same code to compile.
    x_k, x_v = jax.lax.optimization_barrier((x_k, x_v))
    # Quantize rounds: into the allocated pages (a promoted page is held, never written here).
    lb = lb.write(jnp.where(quantize, dst, npg), x_k, x_v)
    # Promote rounds: into the window slots (their positions and scores are the event's).
    live = ~quantize & (dst < f)
    slot = jnp.where(live[..., None], base + dst[..., None] * w + tok, layer.capacity)
    slot = slot.reshape(b, h, m * w)
    flat = lambda x: x.reshape(b, h, m * w, x.shape[-1])
    return put(k, slot, flat(x_k)), put(v, slot, flat(x_v)), lb


def _take_new(new: Array, i: Array) -> Array:
    """Windows i [B, H, m] (clipped) of the K leaving the ring, new [B, H, K, ω, D]."""
    if new.shape[2] == 1:  # a decode step: one window, no gather (one kernel less to compile)
        return jnp.broadcast_to(new, (*i.shape, *new.shape[3:]))
    i = jnp.clip(i, 0, new.shape[2] - 1)
    return jnp.take_along_axis(new, i[..., None, None], axis=2, mode="clip")


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m
