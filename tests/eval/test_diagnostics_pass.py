"""The shadow pass on the tiny Llama: the full model's attention rows, the policy's held sets, and
the streamed FMM checked against direct computations."""

import numpy as np
import pytest

from kvjax.eval import (
    complete_windows,
    future_missed_mass,
    selection_churn,
    shadow_pass,
    summarize,
    window_of_positions,
)
from kvjax.generate import GenerateConfig, generate
from kvjax.policies import POLICIES, make_policy
from tests.policy_cases import build

S, P, W, H = 48, 13, 4, 6  # P not a multiple of ω: events at 12 + 4k


def _tokens(seed=0):
    return np.random.default_rng(seed).integers(0, 128, S).astype(np.int32)


def _run(tiny_llama, policy, **kw):
    config, params = tiny_llama
    return shadow_pass(
        config,
        params,
        _tokens(),
        policy=policy,
        prompt_tokens=P,
        window=W,
        horizon=H,
        prefill_chunk=5,
        record=True,
        **kw,
    )


def test_full_policy_misses_nothing_and_never_churns(tiny_llama):
    rec = _run(tiny_llama, build("full", 0))
    np.testing.assert_array_equal(rec.event_pos, np.arange(P - 1 + W, S, W))
    # Rows are the full model's attention, normalised over the G query heads: each sums to 1
    # over positions <= the query, and nothing lies beyond it.
    rows = rec.attention[P:]  # [S-P, L, Hkv, S]
    np.testing.assert_allclose(rows.sum(-1), 1.0, rtol=1e-5)
    future = np.arange(S)[None, :] > np.arange(P, S)[:, None]
    assert np.all(rows[future[:, None, None, :].repeat(2, 1).repeat(2, 2)] == 0)
    res = summarize(rec, name="full", window=W, top_k=2, m=2, h=2, seconds=0.0)
    assert res.fmm == 0 and res.churn == 0 and res.fp_churn == 0 and res.lost == 0
    assert np.isnan(rec.fmm[..., -1]).all()  # the last event has no full horizon


def test_window_fmm_equals_direct_computation(tiny_llama):
    budget = 10
    rec = _run(tiny_llama, build("window", budget))
    # A sliding window of `budget` attended tokens caches exactly t - budget + 2 .. t at event t
    # (the next step attends those and its own token).
    pos = np.arange(S)
    expect = (pos[None] > rec.event_pos[:, None] - (budget - 1)) & (
        pos[None] <= rec.event_pos[:, None]
    )
    np.testing.assert_array_equal(rec.cached, np.broadcast_to(expect, rec.cached.shape))
    attn = np.moveaxis(rec.attention, 0, 2)  # [L, Hkv, S, S]
    direct = future_missed_mass(
        attn, np.broadcast_to(expect, rec.cached.shape), rec.event_pos, horizon=H
    )
    np.testing.assert_allclose(rec.fmm, direct, rtol=1e-6, equal_nan=True)
    assert np.nanmin(rec.fmm) > 0  # random attention always reaches past a 10-token window
    # Churn: at t=16 the window holds 8..16, complete windows {2, 3} (16 starts window 4);
    # at t=20 it holds 12..20 -> {3, 4}, of which {3} was held at t=16: 1 - 1/2.
    # Every later pair slides the same way.
    churn = selection_churn(rec.held, complete_windows(rec.event_pos, W))
    np.testing.assert_allclose(churn, np.full((2, 2, len(rec.event_pos) - 1), 1 / 2))


@pytest.mark.parametrize("case", ["confkv-int8", "kivi", "h2o"])
def test_held_sets_cover_every_tier(tiny_llama, case):
    rec = _run(tiny_llama, build(case, 12))
    np.testing.assert_array_equal(rec.held, window_of_positions(rec.cached, W))
    assert np.all(rec.held_fp <= rec.held)
    if case != "h2o":  # tiered: some windows live only in the INT8 / low-bit tier
        assert np.any(rec.held & ~rec.held_fp)
    else:
        np.testing.assert_array_equal(rec.held, rec.held_fp)
    attn = np.moveaxis(rec.attention, 0, 2)
    direct = future_missed_mass(attn, rec.cached, rec.event_pos, horizon=H)
    np.testing.assert_allclose(rec.fmm, direct, rtol=1e-6, equal_nan=True)


def test_decode_compiles_once_and_generate_feeds_greedy_tokens(tiny_llama):
    from kvjax.eval._diagnostics_pass import _interval

    policy = build("tova", 12)
    _run(tiny_llama, policy)
    before = _interval._cache_size()
    rec = _run(tiny_llama, policy)  # the same run again: no new compilation
    assert _interval._cache_size() == before
    gen = _run(tiny_llama, build("full", 0), generate=True)
    assert _interval._cache_size() == before + 1  # one more for (full, greedy), not per step
    np.testing.assert_array_equal(rec.tokens, _tokens())
    np.testing.assert_array_equal(gen.tokens[:P], _tokens()[:P])
    config, params = tiny_llama
    ref = generate(
        config,
        params,
        [_tokens()[:P].tolist()],
        policy=build("full", 0),
        gen=GenerateConfig(max_new_tokens=S - P, chunk_size=5),
    )
    np.testing.assert_array_equal(gen.tokens[P:], np.asarray(ref.tokens)[0])


@pytest.mark.skipif("qevict" not in POLICIES, reason="qevict is not registered")
def test_qevict_int2_windows_count_as_held(tiny_llama):
    rec = _run(tiny_llama, make_policy("qevict", 24, window=W, band=8))
    assert np.all(rec.held_fp <= rec.held)
    assert np.any(rec.held & ~rec.held_fp)  # windows only in the INT2 tier are still held
    attn = np.moveaxis(rec.attention, 0, 2)
    direct = future_missed_mass(attn, rec.cached, rec.event_pos, horizon=H)
    np.testing.assert_allclose(rec.fmm, direct, rtol=1e-6, equal_nan=True)
