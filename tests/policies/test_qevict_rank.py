"""QEvict's ranking with fewer sorts gives exactly what the stable argsorts it replaced gave:
the same tiers (ties in score broken by the newer window, then by index) and the same
partitions (needed entries first, in index order), on random inputs full of ties."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.policies import QEvictPolicy, _qevict_rank
from kvjax.policies._qevict_rank import (
    _MATMUL_COUNTS,
    EVICTED,
    FP,
    INT,
    assign_tiers,
    true_first,
)


def tiers_by_argsorts(win, score, has_ledger, lay):
    """The former ranking: two stable argsorts for the order, one for its inverse."""
    take = lambda x, i: jnp.take_along_axis(x, i, axis=-1)
    n = win.shape[-1]
    valid = win >= 0
    o1 = jnp.argsort(-win, axis=-1, stable=True)
    o2 = jnp.argsort(-take(jnp.where(valid, score, -jnp.inf), o1), axis=-1, stable=True)
    order = take(o1, o2)
    v_s = take(valid, order)
    led_s = take(has_ledger, order).astype(jnp.int32)
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
    return take(tier_s, jnp.argsort(order, axis=-1))


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu-form", "gpu-form"])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("share", [0.25, 0.75])
@pytest.mark.parametrize("budget", [60, 700])  # 700: > 256 candidates, the cumsum counts
def test_tiers_equal_the_argsort_ranking(seed, share, budget, gpu, monkeypatch):
    """Both forms of the ranking: its tiers back to candidate order by a sort (the CPU's) and by
    a scatter (the GPU's)."""
    monkeypatch.setattr(_qevict_rank, "_gpu_ranking", lambda: gpu)
    lay = QEvictPolicy(budget=budget, window=4, sinks=2, band=8, quant_share=share).layout(
        8, jnp.float32
    )
    rng = np.random.default_rng(seed)
    shape = (3, 2, lay.fp_windows + lay.pages + 2)
    assert (shape[-1] > _MATMUL_COUNTS) == (budget > 60)
    win = rng.integers(-1, 12, shape).astype(np.int32)  # repeated ids and holes
    score = rng.integers(0, 4, shape).astype(np.float32)  # ties everywhere
    score[rng.random(shape) < 0.1] = -0.0
    has_ledger = rng.random(shape) < 0.4
    # (a function of this test's own: traced here, under this test's way back)
    got = jax.jit(lambda *a: assign_tiers(*a, lay))(win, score, has_ledger)
    want = jax.jit(tiers_by_argsorts, static_argnums=3)(win, score, has_ledger, lay)
    np.testing.assert_array_equal(got, want)
    assert {FP, INT} <= set(np.unique(got))  # both tiers (and eviction) really occur


@pytest.mark.parametrize("seed", range(3))
def test_partitions_and_counts_equal_stable_argsorts_and_sums(seed):
    rng = np.random.default_rng(seed)
    flags = [rng.random((2, 3, n)) < p for n, p in [(5, 0.5), (17, 0.2), (1, 0.5), (9, 0.9)]]
    got, counts = true_first([jnp.asarray(f) for f in flags], counted=3)
    for g, f in zip(got, flags, strict=True):
        np.testing.assert_array_equal(g, np.argsort(~f, axis=-1, stable=True))
    want = np.stack([f.sum(-1) for f in flags[:3]], axis=-1)
    np.testing.assert_array_equal(counts, want)
    # A flag array given as pieces is them end to end: the same partitions and counts.
    pieces = [jnp.asarray(flags[1][..., :7]), jnp.asarray(flags[1][..., 7:])]
    got_pieces, counts_pieces = true_first(
        [jnp.asarray(flags[0]), pieces, *map(jnp.asarray, flags[2:])], counted=3
    )
    for g, p in zip(got_pieces, got, strict=True):
        np.testing.assert_array_equal(g, p)
    np.testing.assert_array_equal(counts_pieces, counts)
