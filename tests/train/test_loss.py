"""Boundary labels, the boundary logistic loss and keep/evict decisions against brute force."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.train import (
    agreement,
    boundary_labels,
    boundary_loss,
    dynamic_decisions,
    own_decisions,
)


def _brute_labels(prio, sinks, window, k):
    """Per query q: the k-th best of E'_q = {sinks..q−w−1} and whether t_new = q − w beats it."""
    s = len(prio)
    out = []
    for q in range(s):
        t_new = q - window
        others = list(range(sinks, t_new))
        if t_new < sinks or len(others) < k:
            out.append(None)
            continue
        t_bnd = sorted(others, key=lambda t: (-prio[t], t))[k - 1]
        out.append((t_new, t_bnd, prio[t_new] > prio[t_bnd]))
    return out


@pytest.mark.parametrize(
    ("sinks", "window", "k", "decay"), [(0, 1, 1, 0.0), (2, 3, 5, 0.0), (4, 2, 7, 0.05)]
)
def test_labels_equal_brute_force(sinks, window, k, decay):
    rng = np.random.default_rng(k)
    s = 40
    mass = rng.normal(size=(3, s)).astype(np.float32)
    mass[:, -window:] = -np.inf  # no future query: never a t_new or t_bnd anyway
    lab = boundary_labels(jnp.asarray(mass), sinks=sinks, window=window, k=k, decay=decay)
    for n in range(3):
        prio = mass[n] + np.float32(decay) * np.arange(s, dtype=np.float32)
        for q, want in enumerate(_brute_labels(prio, sinks, window, k)):
            if want is None:
                assert lab.weight[n, q] == 0
                continue
            t_new, t_bnd, keep = want
            assert lab.weight[n, q] == 1
            assert (int(lab.t_new[n, q]), int(lab.t_bnd[n, q])) == (t_new, t_bnd)
            assert (float(lab.y[n, q]) > 0) == keep
    # The teacher agrees with itself; a ranking by the targets is the teacher's ranking.
    assert float(agreement(lab.y > 0, lab)) == 1.0
    if decay == 0:
        keep = own_decisions(jnp.asarray(mass), sinks=sinks, window=window, k=k)
        assert float(agreement(keep, lab)) == 1.0


def test_dynamic_decisions_with_a_static_score_equal_own_decisions():
    rng = np.random.default_rng(3)
    prio = rng.normal(size=(2, 30)).astype(np.float32)
    score = jnp.broadcast_to(jnp.asarray(prio)[:, None, :], (2, 30, 30))
    kw = dict(sinks=1, window=2, k=4)
    np.testing.assert_array_equal(
        dynamic_decisions(score, **kw), own_decisions(jnp.asarray(prio), **kw)
    )


def test_loss_gradient_matches_finite_differences():
    """d loss / d scores by central differences in float64 on a tiny case (|error| ~ eps²)."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        mass = jnp.asarray(rng.normal(size=(2, 16)))
        lab = boundary_labels(mass, sinks=1, window=2, k=3, weighting="margin")
        assert float(jnp.sum(lab.weight > 0)) > 10
        scores = jnp.asarray(rng.normal(size=(2, 16)))
        f = lambda x: boundary_loss(x, lab, tau=0.7)
        grad = np.asarray(jax.grad(f)(scores))
        eps = 1e-6
        fd = np.zeros_like(grad)
        for idx in np.ndindex(*scores.shape):
            e = np.zeros(scores.shape)
            e[idx] = eps
            fd[idx] = (float(f(scores + e)) - float(f(scores - e))) / (2 * eps)
        np.testing.assert_allclose(grad, fd, atol=1e-8)
        assert np.abs(grad).max() > 1e-3  # the check is not vacuous


def test_loss_is_the_weighted_softplus():
    """One decision by hand: y = +1, r̂(t_new) − r̂(t_bnd) = 0.5, τ = 0.5 → softplus(−1)."""
    mass = jnp.asarray([[0.0, 3.0, 1.0, 2.0, 0.0]])  # w = 1, k = 1: at q = 3, t_new = 2
    lab = boundary_labels(mass, sinks=0, window=1, k=1)
    # q = 2: t_new = 1, E' = {0}: t_bnd = 0, keep (3 > 0); q = 3: t_new = 2 vs t_bnd = 1: evict;
    # q = 4: t_new = 3 vs t_bnd = 1 (best of {0, 1, 2}): evict.
    np.testing.assert_array_equal(lab.weight[0], [0, 0, 1, 1, 1])
    np.testing.assert_array_equal(lab.y[0, 2:], [1, -1, -1])
    scores = jnp.asarray([[0.0, 0.5, 0.0, 0.0, 0.0]])
    want = (np.log1p(np.exp(-1.0)) + 2 * np.log1p(np.exp(-1.0))) / 3  # each margin is ±0.5/0.5
    np.testing.assert_allclose(float(boundary_loss(scores, lab, tau=0.5)), want, rtol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sinks": -1}, "sinks"),
        ({"window": 0}, "window"),
        ({"k": 0}, "k >= 1"),
        ({"k": 30}, "budget"),
    ],
)
def test_bad_budget(kwargs, match):
    with pytest.raises(ValueError, match=match):
        boundary_labels(jnp.zeros((1, 32)), **({"sinks": 1, "window": 2, "k": 4} | kwargs))


def test_bad_tau():
    lab = boundary_labels(jnp.zeros((1, 16)), sinks=0, window=1, k=2)
    with pytest.raises(ValueError, match="tau"):
        boundary_loss(jnp.zeros((1, 16)), lab, tau=0.0)
