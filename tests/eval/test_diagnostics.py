"""The diagnostics metrics (FMM, churn, Global LIR) on hand-made attention streams, whose values
are worked out in the comments, plus invariants on random streams."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvjax.eval import (
    FmmStream,
    complete_windows,
    future_missed_mass,
    global_lir,
    kept_windows,
    selection_churn,
    window_activity,
)


def test_fmm_by_hand():
    # S = 6 positions, H = 2. Rows are queries (each sums to 1, causal).
    attn = np.array(
        [
            [1.0, 0, 0, 0, 0, 0],
            [0.5, 0.5, 0, 0, 0, 0],
            [0.2, 0.3, 0.5, 0, 0, 0],
            [0.5, 0.1, 0.2, 0.2, 0, 0],
            [0.3, 0.3, 0.1, 0.1, 0.2, 0],
            [0.0, 0.1, 0.1, 0.1, 0.2, 0.5],
        ]
    )
    cached = np.zeros((3, 6), bool)
    cached[0, [1, 2]] = True  # event t=2 holds 1, 2: position 0 is missed
    cached[1, [2, 3]] = True  # event t=3 holds 2, 3: positions 0, 1 are missed
    cached[2, [3, 4]] = True  # event t=4: its horizon (5, 6) runs past S-1 = 5
    fmm = future_missed_mass(attn, cached, np.array([2, 3, 4]), horizon=2)
    # t=2: rows 3, 4 on position 0: (0.5 + 0.3) / 2 = 0.4
    # t=3: rows 4, 5 on positions 0, 1: ((0.3 + 0.3) + (0.0 + 0.1)) / 2 = 0.35
    np.testing.assert_allclose(fmm[:2], [0.4, 0.35])
    assert np.isnan(fmm[2])


def test_churn_by_hand():
    # S = 8, ω = 2: windows {0,1} {2,3} {4,5} {6,7}; events at t = 3, 5, 7.
    event_pos = np.array([3, 5, 7])
    cached = np.zeros((3, 8), bool)
    cached[0, [0, 1, 3]] = True  # K_0 = {0, 1}
    cached[1, [1, 4, 5]] = True  # K_1 = {0, 2}
    cached[2, [2, 6, 7]] = True  # K_2 = {1, 3}
    kept = kept_windows(cached, event_pos, window=2)
    np.testing.assert_array_equal(complete_windows(event_pos, 2), [2, 3, 4])
    churn = selection_churn(kept, complete_windows(event_pos, 2))
    # e=0: K_1 within windows complete at e=0 ({0, 1}) is {0}: 1 - |{0}| / |{0, 1}| = 0.5
    # e=1: K_2 within {0, 1, 2} is {1}; K_1 = {0, 2}: no overlap, churn 1
    np.testing.assert_allclose(churn, [0.5, 1.0])


def test_churn_ignores_windows_still_filling():
    # Event at t=4 with ω = 2: window 2 = {4, 5} is not complete, so it is not in K.
    cached = np.ones((1, 6), bool)
    kept = kept_windows(cached, np.array([4]), window=2)
    np.testing.assert_array_equal(kept, [[True, True, False]])


def test_window_activity_by_hand():
    mass = np.array([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6], [0.0, 0.1, 0.0]])
    # top-2: row 0 -> {0, 1}; row 1 -> {2, then 0 (a tie goes to the lower index)};
    # row 2 -> {1} only, zero-mass windows are never active.
    np.testing.assert_array_equal(
        window_activity(mass, top_k=2),
        [[True, True, False], [True, False, True], [False, True, False]],
    )


def test_global_lir_by_hand():
    # 10 events, 3 windows, m = 2, h = 3.
    active = np.zeros((10, 3), bool)
    active[[0, 4], 0] = True  # w0: active 0, idle 1-2 -> candidate at e=2, active again at 4
    #                           (in 3..5): a reactivation. Idle 5-6 -> candidate at e=6, idle
    #                           7..9: no reactivation.
    active[5, 2] = True  # w2: active 5, idle 6-7 -> candidate at e=7, look-ahead 8..10 runs
    #                      past the last event 9: left out. w1 is never active: no candidate.
    kept = np.ones((10, 3), bool)
    kept[4, 0] = False  # the policy no longer holds w0 when it comes back
    res = global_lir(active, m=2, h=3, kept=kept)
    assert (res.candidates, res.reactivations, res.lost) == (2, 1, 1)
    assert global_lir(active, m=2, h=3).lost == 0


def test_fmm_stream_rejects_an_event_before_its_row():
    s = FmmStream(4)
    s.add_rows(0, np.zeros((3, 5)))
    with pytest.raises(ValueError, match="before its row"):
        s.add_event(3, np.zeros(5, bool))
    with pytest.raises(ValueError, match="horizon must be >= 1"):
        FmmStream(0)


def _attention(rng, heads, s):
    """[heads, S, S] causal rows summing to 1."""
    logits = rng.normal(size=(heads, s, s)) * 2
    logits = np.where(np.tril(np.ones((s, s), bool)), logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


@given(
    seed=st.integers(0, 2**16),
    s=st.integers(6, 40),
    horizon=st.integers(1, 12),
    window=st.integers(1, 5),
    p=st.integers(1, 5),
)
def test_fmm_stream_matches_reference_and_lies_in_unit_interval(seed, s, horizon, window, p):
    rng = np.random.default_rng(seed)
    attn = _attention(rng, 2, s)
    event_pos = np.arange(p - 1 + window, s, window)
    cached = rng.random((2, len(event_pos), s)) < 0.5
    ref = future_missed_mass(attn, cached, event_pos, horizon=horizon)
    stream = FmmStream(horizon)
    for e, t in enumerate(event_pos):  # rows arrive in chunks ending at each event
        lo = p if e == 0 else event_pos[e - 1] + 1
        stream.add_rows(lo, np.moveaxis(attn[:, lo : t + 1], 1, 0))
        stream.add_event(int(t), cached[:, e])
    tail = event_pos[-1] + 1 if len(event_pos) else p
    stream.add_rows(tail, np.moveaxis(attn[:, tail:], 1, 0))
    if len(event_pos):
        np.testing.assert_allclose(stream.result(), ref, rtol=1e-12, atol=1e-12)
    ok = np.isfinite(ref)
    assert np.all((ref[ok] >= 0) & (ref[ok] <= 1 + 1e-12))
    everything = future_missed_mass(attn, np.ones_like(cached), event_pos, horizon=horizon)
    assert np.all(everything[np.isfinite(everything)] == 0)


@given(seed=st.integers(0, 2**16), n_events=st.integers(2, 8), windows=st.integers(1, 6))
def test_constant_kept_set_has_zero_churn(seed, n_events, windows):
    rng = np.random.default_rng(seed)
    kept = np.broadcast_to(rng.random((1, windows)) < 0.5, (n_events, windows))
    n = np.full(n_events, windows)
    np.testing.assert_array_equal(selection_churn(kept, n), 0.0)
    random_kept = rng.random((n_events, windows)) < 0.5
    churn = selection_churn(random_kept, n)
    assert np.all((churn >= 0) & (churn <= 1))


def _lir_brute_force(active, kept, m, h):
    n_events, n_windows = active.shape
    cand = react = lost = 0
    for w in range(n_windows):
        for e in range(m, n_events - h):
            if active[e - m, w] and not active[e - m + 1 : e + 1, w].any():
                cand += 1
                later = [r for r in range(e + 1, e + h + 1) if active[r, w]]
                if later:
                    react += 1
                    lost += not kept[later[0], w]
    return cand, react, lost


@given(
    seed=st.integers(0, 2**16),
    n_events=st.integers(1, 30),
    windows=st.integers(1, 6),
    m=st.integers(1, 4),
    h=st.integers(1, 6),
    density=st.floats(0.05, 0.7),
)
def test_global_lir_matches_brute_force(seed, n_events, windows, m, h, density):
    rng = np.random.default_rng(seed)
    active = rng.random((2, n_events, windows)) < density
    kept = rng.random((2, n_events, windows)) < 0.5
    res = global_lir(active, m=m, h=h, kept=kept)
    for i in range(2):
        expect = _lir_brute_force(active[i], kept[i], m, h)
        assert (res.candidates[i], res.reactivations[i], res.lost[i]) == expect
