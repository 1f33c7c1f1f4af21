"""Properties every policy in the shared list must have, through the real generate loop."""

import numpy as np
import pytest
from policy_cases import NAMES, build

from kvjax.generate import GenerateConfig, generate, score_tokens
from kvjax.generate._loop import _generate

EXACT = [n for n in NAMES if "int8" not in n and n not in ("confkv-l", "kivi")]


@pytest.mark.parametrize("case", NAMES)
def test_budget_at_least_length_matches_full(tiny_llama, case):
    """Budget >= length: the same NLL as full up to float32 summation order (slots sit in other
    places, so softmax sums run in another order); INT8 tiers: within quantization error."""
    config, params = tiny_llama
    ids = np.random.default_rng(7).integers(0, 128, size=(2, 30))
    for chunk in (1, 4):
        full = np.asarray(
            score_tokens(config, params, ids, policy=build("full", 0), chunk=chunk, segment=8).nll
        )
        got = score_tokens(config, params, ids, policy=build(case, 64), chunk=chunk, segment=8)
        if case in EXACT:
            np.testing.assert_allclose(np.asarray(got.nll), full, rtol=1e-6, atol=1e-6)
        else:
            np.testing.assert_allclose(np.asarray(got.nll), full, atol=0.05)


@pytest.mark.parametrize("case", [n for n in NAMES if n not in ("full", "kivi", "qevict")])
def test_live_slots_never_exceed_budget_and_bytes_match_formula(tiny_llama, case):
    config, params = tiny_llama
    budget = 16
    policy = build(case, budget)
    out = generate(
        config,
        params,
        [list(range(1, 25)), list(range(3, 9))],
        policy=policy,
        gen=GenerateConfig(max_new_tokens=20, chunk_size=8),
    )
    slots = np.asarray(out.telemetry.live_slots)[..., :2]  # [N, B, L, tiers] (slots only)
    caps = [
        policy.max_budget(i) if hasattr(policy, "max_budget") else budget
        for i in range(config.num_layers)
    ]
    per_head = slots.sum(-1) / config.num_kv_heads  # [N, B, L]
    assert np.all(np.asarray(out.telemetry.live_slots)[..., 2] == 0)  # no low-bit tier here
    assert np.all(per_head <= np.asarray(caps)[None, None, :])
    assert per_head.max() > 0
    # live bytes = fp slots x 2·D·4 + int8 slots x (2·D + 2·4)
    want = slots[..., 0].sum(-1) * 2 * 16 * 4 + slots[..., 1].sum(-1) * (2 * 16 + 8)
    np.testing.assert_array_equal(out.telemetry.live_bytes(), want)


@pytest.mark.parametrize("case", NAMES)
def test_decode_compiles_once(tiny_llama, case):
    config, params = tiny_llama
    policy = build(case, 16)
    gen = GenerateConfig(max_new_tokens=30, chunk_size=8)
    before = _generate._cache_size()
    for n in (2, 5, 8):
        generate(config, params, [list(range(1, n + 1))], policy=policy, gen=gen)
    assert _generate._cache_size() == before + 1
