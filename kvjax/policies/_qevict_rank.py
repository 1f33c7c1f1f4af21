"""QEvict's ranking at a routing event, on small per-candidate arrays: the tier of every
candidate window by rank under the byte budget, and the stable partitions that turn tiers into
move lists (`_qevict_route.route`).

Compile time on the CPU follows the number of distinct kernels, and every sort, cumsum and
scatter is one or more: the rank is one two-key sort, the tiers go back to candidate order by a
second, and all the partitions an event needs come from a third (docs/decisions.md); at small
shapes the budget's running counts are matmuls (`running_counts`), not cumsums, and no count
is a sum (XLA:CPU compiles a sum as a conversion and two reductions): totals are the running
counts' last entries, the move lists' lengths one more matmul (`true_first`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

FP, INT, EVICTED = 1, 2, 0  # tiers of a routed window (0 also marks "no window")


def assign_tiers(win: Array, score: Array, has_ledger: Array, lay) -> Array:
    """Tier of every candidate window, by rank (score, then newer window first).

    The k best windows are full precision for the largest k with
    cost_fp(k) + min(q·M_r, b_q·(n − k)) <= M_r, where a window's full-precision cost is
    b_fp plus b_q if it keeps a dormant ledger entry; the next windows go to the low-bit tier
    while their pages fit in the bytes left; the rest are evicted. Under pressure this is the
    paper's split (⌊(1−q)M/b_fp⌋ full-precision windows); with room to spare every window stays
    full precision.

    Two sorts: one two-key sort (score descending, then window id descending, then index: what
    two stable argsorts gave) that carries the index and the flags the budget reads as one
    operand, and one by that operand that puts the tiers back in candidate order.

    Args:
        win: [B, H, N] int32 window ids (-1 = no candidate).
        score: [B, H, N] float32 cumulative attention mass.
        has_ledger: [B, H, N] bool, the window already has low-bit codes.
        lay: the layer's layout (`_qevict_route.Layout`).

    Returns:
        [B, H, N] int32 in {EVICTED, FP, INT}.
    """
    if 4 * win.shape[-1] >= 2**31:
        raise ValueError(f"assign_tiers: too many candidates ({win.shape[-1]})")
    valid = win >= 0
    idx = jax.lax.broadcasted_iota(jnp.int32, win.shape, win.ndim - 1)
    key = -jnp.where(valid, score, -jnp.inf)
    # The index and the flags the budget reads ride along as one operand, 4·index + kind
    # (kind 0: no window, 1: a window, 2: a window with a ledger entry): one array to build
    # and sort where three were.
    kind = valid.astype(jnp.int32) + (valid & has_ledger).astype(jnp.int32)
    *_, packed = jax.lax.sort((key, -win, 4 * idx + kind), num_keys=2, is_stable=True)
    v_s, led_s = (packed & 3) > 0, (packed & 3) > 1
    n_v, n_led = running_counts([v_s, led_s])
    # A window costs b_fp, plus b_q with a ledger entry: cum = cumsum(cost), mod 2^32 too.
    cum = lay.fp_window_bytes * n_v + lay.page_bytes * n_led
    k = idx + 1
    rest = n_v[..., -1:] - k  # totals: the running counts' last entries
    reserve = jnp.minimum(lay.quant_bytes, lay.page_bytes * rest)
    fp_s = v_s & (cum + reserve <= lay.budget_bytes) & (k <= lay.fp_windows)
    j, n_fp, n_fp_led = running_counts([v_s & ~fp_s, fp_s, fp_s & led_s])
    # The bytes the full-precision windows leave: budget − Σ cost over them.
    left = lay.budget_bytes - (
        lay.fp_window_bytes * n_fp[..., -1:] + lay.page_bytes * n_fp_led[..., -1:]
    )
    q_s = v_s & ~fp_s & (j * lay.page_bytes <= left) & (j <= lay.pages)
    tier_s = jnp.where(fp_s, FP, jnp.where(q_s, INT, EVICTED)).astype(jnp.int32)
    if _gpu_ranking():  # each rank's tier written at its candidate's index
        return _scatter_last(packed >> 2, tier_s)
    # Back to candidate order: by the packed operand, whose order is the index's.
    return jax.lax.sort((packed, tier_s), num_keys=1)[1]


def _gpu_ranking() -> bool:
    """The ranking's GPU form: the tiers back to candidate order by a scatter, one pass over
    them (on an H100 XLA's sort kernels took about 1.7 ms of a routing event at Llama-3-8B
    shapes, B = 8, 32K, 32 layers, the sort back among them:
    docs/lab/2026-12-08-qevict-event-gpu.md). Elsewhere by a second sort: on the CPU a
    scatter compiles to three kernels and a sort to one (the first call, docs/decisions.md)."""
    return jax.default_backend() == "gpu"


def _scatter_last(idx: Array, x: Array) -> Array:
    """out[..., idx[..., i]] = x[..., i] for idx a permutation of the last axis."""
    n = x.shape[-1]
    rows = int(np.prod(x.shape[:-1]))
    at = jnp.arange(rows, dtype=jnp.int32)[:, None]
    out = jnp.zeros((rows, n), x.dtype).at[at, idx.reshape(rows, n)]
    return out.set(x.reshape(rows, n), unique_indices=True, mode="promise_in_bounds").reshape(
        x.shape
    )


def running_counts(flags: list[Array]) -> list[Array]:
    """Inclusive running counts (`cumsum` as int32) of [..., N] bool arrays of one shape.

    Where N is small, one matmul of the stacked flags with a triangular 0/1 matrix: exact
    (0/1 products, float32 sums of at most N < 2^24), and one kernel to compile where XLA's
    CPU compiler splits a cumsum into about five; above `_MATMUL_COUNTS` the N² matmul would
    cost more than it saves, so cumsum.
    """
    n = flags[0].shape[-1]
    if n > _MATMUL_COUNTS:
        return [jnp.cumsum(f, axis=-1, dtype=jnp.int32) for f in flags]
    upper = np.triu(np.ones((n, n), np.float32))  # upper[j, i] = j <= i
    x = jnp.stack(flags, axis=-2).astype(jnp.float32)  # [..., len(flags), N]
    got = jnp.einsum(
        "...cj,ji->...ci", x, upper, precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    ).astype(jnp.int32)  # fmt: skip
    return [got[..., i, :] for i in range(len(flags))]


_MATMUL_COUNTS = 256  # candidates per head up to which running counts are one matmul


def true_first(flags: list[Array | list[Array]], *, counted: int = 0):
    """Stable partitions of several flag arrays at once: for each [B, H, n_i] bool array, its
    indices [B, H, n_i] int32 with the True entries first, each part in index order (what
    `argsort(~flag, stable=True)` gives), from one sort of all of them end to end; and the
    True entries of the first `counted` arrays, [B, H, counted] int32. A list of arrays in
    `flags` is one flag array, them end to end (all joined at once: one kernel to compile).

    The sort is of one int32 key, (segment, ~flag, index) packed into bits, which are
    distinct, so its order is the stable one and the index is the key's low bits (one operand
    to build and sort, not two). The counts are one matmul of the same flags with a 0/1
    segment matrix (exact: float32 sums of 0/1 below 2^24), one kernel where XLA's CPU
    compiler turns each sum into a conversion and two reductions."""
    flags = [list(f) if isinstance(f, (list, tuple)) else [f] for f in flags]
    sizes = [sum(p.shape[-1] for p in f) for f in flags]
    lead = flags[0][0].shape[:-1]
    shift = max(max(sizes) - 1, 1).bit_length()  # bits of an index within its array
    if (2 * len(flags)) << shift > 2**31 or sum(sizes) >= 2**24:
        raise ValueError(f"true_first: arrays too large to pack into one key ({sizes})")
    seg = np.concatenate([np.full(n, 2 * i, np.int32) for i, n in enumerate(sizes)])
    local = np.concatenate([np.arange(n, dtype=np.int32) for n in sizes])
    bcast = lambda x: jnp.asarray(x).reshape((1,) * len(lead) + x.shape)
    missing = jax.lax.optimization_barrier(join([~p for f in flags for p in f]))  # [B, H, Σ n_i]
    key = ((bcast(seg) + missing.astype(jnp.int32)) << shift) | bcast(local)
    idx = jax.lax.sort(key, dimension=-1) & ((1 << shift) - 1)
    parts = jnp.split(idx, np.cumsum(sizes)[:-1].tolist(), axis=-1)
    if not counted:
        return parts, jnp.zeros((*lead, 0), jnp.int32)
    first = np.repeat(np.eye(len(flags), counted, dtype=np.float32), sizes, axis=0)  # [N, c]
    absent = jnp.einsum(
        "...n,nc->...c", missing.astype(jnp.float32), first,
        precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32,
    ).astype(jnp.int32)  # fmt: skip
    return parts, bcast(np.asarray(sizes[:counted], np.int32)) - absent


def join(pieces: list[Array]) -> Array:
    """[..., n_i] arrays end to end along the last axis, as selects of pads. Behind an
    optimization barrier this is one kernel, where XLA:CPU compiles a concatenation with
    each operand computed by a kernel of its own (it fuses none into the concatenation)."""
    sizes = [p.shape[-1] for p in pieces]
    ends = np.cumsum(sizes)
    lead = ((0, 0),) * (pieces[0].ndim - 1)
    at = np.arange(ends[-1]).reshape((1,) * len(lead) + (-1,))
    pad = lambda i: jnp.pad(pieces[i], (*lead, (ends[i] - sizes[i], ends[-1] - ends[i])))
    out = pad(len(pieces) - 1)
    for i in range(len(pieces) - 2, -1, -1):
        out = jnp.where(at < ends[i], pad(i), out)
    return out
