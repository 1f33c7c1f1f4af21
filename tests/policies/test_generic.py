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
    budget = 20  # confkv-l's smallest budget is 19 (its deepest layer's tight budget)
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
    policy = build(case, 20)
    gen = GenerateConfig(max_new_tokens=30, chunk_size=8)
    before = _generate._cache_size()
    for n in (2, 5, 8):
        generate(config, params, [list(range(1, n + 1))], policy=policy, gen=gen)
    assert _generate._cache_size() == before + 1


@pytest.mark.parametrize("case", NAMES)
def test_uses_attention_mass_is_truthful(tiny_llama, case):
    # A policy that declares it reads no attention mass writes the same cache whatever the mass
    # says (the Pallas path then hands it zeros and skips the logits); one that declares it
    # reads it keeps a different set under spiky masses than under zeros.
    import jax
    import jax.numpy as jnp

    from kvjax.attention import AttnStats
    from kvjax.generate import new_cache

    config, _ = tiny_llama
    policy = build(case, 24)
    cache = new_cache(config, policy, batch=2, max_len=96, dtype=jnp.float32)
    layer0, state = cache.layers[0], cache.policy_state
    h, d = layer0.k.shape[1], layer0.k.shape[3]

    @jax.jit
    def step(layer, kv, pos, masses):
        tier = lambda t, m: None if t is None else m[: t.pos.size].reshape(t.pos.shape)
        st = AttnStats(
            slot_mass=masses[: layer.pos.size].reshape(layer.pos.shape),
            new_mass=masses[:2 * h].reshape(2, h, 1), lse=jnp.zeros((2, 1, config.num_heads)),
            int8_mass=tier(layer.int8, masses[::-1]), lowbit_mass=tier(layer.lowbit, masses[1:]),
        )  # fmt: skip
        valid = jnp.ones((2, 1), bool)
        return policy.write(layer, kv[0], kv[1], pos, valid, st, state, layer_index=0)

    def run(spiky: bool):
        rng = np.random.default_rng(1)  # the same keys and values in both runs
        layer = layer0
        for t in range(80):  # one token a step, well past the budget
            kv = jnp.asarray(rng.standard_normal((2, 2, 1, h, d)), jnp.float32)
            masses = rng.exponential(size=4096) ** 3 * spiky
            layer = step(layer, kv, jnp.full((2, 1), t, jnp.int32), jnp.asarray(masses))
        return [np.asarray(x) for x in jax.tree.leaves(layer) if x.dtype == jnp.int32]

    same = all(np.array_equal(a, b) for a, b in zip(run(False), run(True), strict=True))
    assert same == (not policy.uses_attention_mass)
