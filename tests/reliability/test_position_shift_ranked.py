"""Positions within the cache for the score-ranked policies and QEvict (`position_shift=True`):
the NLL through the cache against an independent float64 forward in which every query attends
exactly the set the policy kept at its step, each kept key at its rank among them and the query
one past them (StreamingLLM §3.2 over an arbitrary kept set); the shift per tier against a plain
sort; one compilation; bad input."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from policy_cases import build
from reliability.masked_forward import (
    cache_positions,
    per_head_nll,
    rank_positions,
    streaming_mask,
)

from kvjax.attention import attend, attend_xla
from kvjax.cache import CacheSpec, init_cache
from kvjax.cli import main
from kvjax.generate import GenerateConfig, generate, model_step, new_cache, score_tokens
from kvjax.generate._loop import _generate
from kvjax.generate._score import _score_segment
from kvjax.models import rope_rotation
from kvjax.policies import H2OPolicy, QEvictPolicy, make_policy
from kvjax.policies._cache_positions import cache_position_shift

S = 40
BUDGET = 9  # every case evicts from step 9 or so on, well inside the 40 tokens
# Full-precision cases of tests/policy_cases.py (the quantized tiers' keys are not the float64
# reference's: `test_attention_turns_every_tier` checks those tiers at the attention).
CASES = ["h2o", "tova", "confkv", "knorm", "kvpop", "random"]
# CONF-KV's tight budget (half) must still leave ranked slots after its protected window.
BUDGETS = {"confkv": 12, "confkv-int8": 16, "qevict": 16}


def shifted(case: str, shift: bool):
    budget = BUDGETS.get(case, BUDGET)
    return dataclasses.replace(build(case, budget), position_shift=shift)


@pytest.fixture(scope="module")
def tokens():
    return np.asarray(jax.random.randint(jax.random.key(7), (S,), 0, 128), np.int32)


def _tier_positions(layer):
    """[B, Hkv, N] positions of every slot of every tier (-1 = empty)."""
    tiers = [layer.pos]
    if layer.int8 is not None:
        tiers.append(layer.int8.pos)
    if layer.lowbit is not None:
        tiers.append(layer.lowbit.pos.reshape(*layer.lowbit.pos.shape[:2], -1))
    return jnp.concatenate(tiers, axis=-1)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _trace(config, policy, params, cache, toks):
    """One token per step through `model_step`; the logits and, per step, every layer's slot
    positions *before* the step (the set that step's query attends, besides itself)."""

    def body(cache, tok):
        before = tuple(_tier_positions(layer) for layer in cache.layers)
        logits, cache = model_step(config, policy, params, cache, tok[:, None], tok[:, None] >= 0)
        return cache, (logits[:, 0], before)

    return jax.lax.scan(body, cache, toks.T)[1]


def kept_sets(config, policy, params, toks):
    """[L, Hkv, S, S] bool: query i attends key j (the policy's own cache before step i, plus
    token i) and the [S-1] NLL of that same run."""
    cache = new_cache(config, policy, batch=1, max_len=S, dtype=jnp.float32)
    logits, before = _trace(config, policy, params, cache, jnp.asarray(toks)[None])
    logp = jax.nn.log_softmax(logits[:-1, 0], axis=-1)
    nll = -np.asarray(jnp.take_along_axis(logp, jnp.asarray(toks)[1:, None], axis=-1))[:, 0]
    kept = np.zeros((config.num_layers, config.num_kv_heads, S, S), bool)
    for layer, pos in enumerate(before):
        pos = np.asarray(pos)[:, 0]  # [S, Hkv, N]
        for i in range(S):
            for h in range(config.num_kv_heads):
                cached = pos[i, h][pos[i, h] >= 0]
                assert np.all(cached < i) and len(set(cached)) == len(cached)
                kept[layer, h, i, cached] = True
                kept[layer, h, i, i] = True
    return kept, nll


@pytest.fixture(scope="module", params=CASES)
def case(request, tiny_llama, tokens):
    """The case's score_tokens NLL with the shift on and off, and the kept sets of each run."""
    config, params = tiny_llama
    out = {}
    for shift in (True, False):
        policy = shifted(request.param, shift)
        nll = np.asarray(score_tokens(config, params, tokens, policy=policy, segment=8).nll[0])
        kept, traced = kept_sets(config, policy, params, tokens)
        # The traced run is the scored one: the same NLL, so its kept sets are the scored ones.
        np.testing.assert_allclose(traced, nll, rtol=1e-6, atol=1e-6)
        out[shift] = (nll, kept)
    return request.param, out


def test_rank_positions_of_streaming_are_the_papers_cache_positions():
    """The rank rule, read off a StreamingLLM mask, is the paper's cache positions (the two
    references agree where they overlap)."""
    mask = streaming_mask(S, 9, 2)
    want_q, want_k = cache_positions(S, 9, 2)
    got_q, got_k = rank_positions(mask)
    np.testing.assert_array_equal(got_q, want_q)
    np.testing.assert_array_equal(np.where(mask, got_k, 0), np.where(mask, want_k, 0))


def test_position_shift_equals_the_rank_position_reference(tiny_llama, tokens, case):
    config, params = tiny_llama
    name, runs = case
    (on, kept_on), (off, kept_off) = runs[True], runs[False]
    assert np.any(kept_on.sum(-1) < np.arange(1, S + 1)), "the case never evicts"
    want = per_head_nll(config, params, tokens, kept_on, rank_positions(kept_on))
    np.testing.assert_allclose(on, want, rtol=2e-5, atol=2e-5)
    # The same harness with absolute positions is the default policy (its own kept sets).
    np.testing.assert_allclose(off, per_head_nll(config, params, tokens, kept_off), atol=2e-5)
    # The reference tells the two schemes apart on the same kept sets.
    absolute = per_head_nll(config, params, tokens, kept_on)
    assert np.max(np.abs(want - absolute)) > 1e-3, name


def test_position_shift_changes_only_what_follows_the_first_eviction(case):
    name, runs = case
    (on, kept), (off, _) = runs[True], runs[False]
    # The first query whose kept set misses a token of some layer and head.
    first = int(np.argmax(np.any(kept.sum(-1) < np.arange(1, S + 1), axis=(0, 1))))
    assert first > 0
    np.testing.assert_array_equal(on[:first], off[:first])  # nothing moves before: bit for bit
    assert np.max(np.abs(on[first:] - off[first:])) > 1e-3, name


def _random_layer(seed, *, int8: bool, lowbit: bool):
    """A cache layer with every tier, random slot positions (some empty), random codes."""
    rng = np.random.default_rng(seed)
    spec = CacheSpec(
        batch=2, num_kv_heads=2, head_dim=16, capacities=(6,),
        int8_capacities=(5,) if int8 else None, lowbit_pages=(2,) if lowbit else None,
        lowbit_page_size=4, lowbit_bits=2, lowbit_value_group=16,
    )  # fmt: skip
    layer = init_cache(spec).layers[0]
    n = 6 + (5 if int8 else 0) + (8 if lowbit else 0)
    pos = np.full((2, 2, n), -1, np.int32)
    for b in range(2):
        for h in range(2):
            chosen = rng.choice(60, size=n, replace=False)
            pos[b, h] = np.where(rng.random(n) < 0.75, chosen, -1)

    def fill(x):
        if jnp.issubdtype(x.dtype, jnp.integer):
            info = jnp.iinfo(x.dtype)
            return jnp.asarray(rng.integers(info.min, info.max, x.shape), x.dtype)
        return jnp.asarray(rng.uniform(0.01, 1.0, x.shape), x.dtype)

    layer = layer.replace(k=fill(layer.k), v=fill(layer.v), pos=jnp.asarray(pos[..., :6]))
    rest = pos[..., 6:]
    if int8:
        t8 = jax.tree.map(fill, layer.int8)
        layer = layer.replace(int8=t8.replace(pos=jnp.asarray(rest[..., :5])))
        rest = rest[..., 5:]
    if lowbit:
        lb = jax.tree.map(fill, layer.lowbit)
        layer = layer.replace(lowbit=lb.replace(pos=jnp.asarray(rest.reshape(2, 2, 2, 4))))
    return layer, pos


@pytest.mark.parametrize("int8,lowbit", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_shift_per_tier_is_the_rank_among_all_tiers(int8, lowbit):
    layer, pos = _random_layer(0, int8=int8, lowbit=lowbit)
    first = np.array([70, 64], np.int32)
    got = cache_position_shift(layer, jnp.asarray(first))
    flat = [np.asarray(got.full)]
    flat += [np.asarray(got.int8)] if int8 else []
    flat += [np.asarray(got.lowbit).reshape(2, 2, -1)] if lowbit else []
    got = np.concatenate(flat, axis=-1)
    for b in range(2):
        for h in range(2):
            live = sorted(p for p in pos[b, h] if p >= 0)
            for slot, p in enumerate(pos[b, h]):
                # rank r among n cached, attended at r + (first - n): the query at first is n
                want = 0 if p < 0 else live.index(p) + first[b] - len(live) - p
                assert got[b, h, slot] == want, (b, h, slot)


def _np_rope(x, by, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.asarray(by, np.float64)[..., None] * inv
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate(
        [x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], axis=-1
    )


@pytest.mark.parametrize("int8,lowbit", [(False, False), (True, True)])
def test_attention_turns_every_tier(tiny_llama, int8, lowbit):
    """attend_xla with a KeyShift equals attend_xla over the same layer whose keys were turned
    in float64 NumPy beforehand (full tier) and, for the quantized tiers, the same attention
    computed in NumPy from their dequantized keys turned by the shift."""
    config = tiny_llama[0]
    layer, _ = _random_layer(1, int8=int8, lowbit=lowbit)
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.normal(size=(2, 1, 4, 16)), jnp.float32)
    k_new = jnp.asarray(rng.normal(size=(2, 1, 2, 16)), jnp.float32)
    v_new = jnp.asarray(rng.normal(size=(2, 1, 2, 16)), jnp.float32)
    q_pos = jnp.array([[70], [64]], jnp.int32)
    valid = jnp.ones((2, 1), bool)
    shift = cache_position_shift(layer, q_pos[:, 0])
    rotate = rope_rotation(config)
    args = (q, layer, k_new, v_new, q_pos, valid, valid.astype(jnp.float32))
    got, st = attend_xla(*args, scale=0.25, key_shift=shift, rotate=rotate)
    # The reference turns each tier's dequantized keys by the shift in float64 NumPy.
    from kvjax.quant import dequantize_int8, dequantize_per_channel, dequantize_per_token, unpack

    ks = [np.asarray(layer.k, np.float64)]
    by = [np.asarray(shift.full)]
    vs = [np.asarray(layer.v, np.float64)]
    ps = [np.asarray(layer.pos)]
    if int8:
        t8 = layer.int8
        ks.append(np.asarray(dequantize_int8(t8.k, t8.k_scale, jnp.float32), np.float64))
        vs.append(np.asarray(dequantize_int8(t8.v, t8.v_scale, jnp.float32), np.float64))
        by.append(np.asarray(shift.int8))
        ps.append(np.asarray(t8.pos))
    if lowbit:
        lb = layer.lowbit
        k8 = dequantize_per_channel(unpack(lb.k, lb.bits), lb.k_scale, lb.k_zero, jnp.float32)
        v8 = dequantize_per_token(unpack(lb.v, lb.bits), lb.v_scale, lb.v_zero, jnp.float32)
        ks.append(np.asarray(k8, np.float64).reshape(2, 2, 8, 16))
        vs.append(np.asarray(v8, np.float64).reshape(2, 2, 8, 16))
        by.append(np.asarray(shift.lowbit).reshape(2, 2, 8))
        ps.append(np.asarray(lb.pos).reshape(2, 2, 8))
    turned = [_np_rope(k, b, config.rope_theta) for k, b in zip(ks, by, strict=True)]
    k = np.concatenate(turned, axis=2)
    k = np.concatenate([k, np.asarray(k_new, np.float64).transpose(0, 2, 1, 3)], axis=2)
    v = np.concatenate(vs + [np.asarray(v_new, np.float64).transpose(0, 2, 1, 3)], axis=2)
    p = np.concatenate(ps + [np.asarray(q_pos)[:, None, :].repeat(2, 1)], axis=2)
    qg = np.asarray(q, np.float64)[:, 0].reshape(2, 2, 2, 16)  # [B, Hkv, G, D]
    logits = np.einsum("bhgd,bhnd->bhgn", qg, k) * 0.25
    logits = np.where((p >= 0)[:, :, None, :], logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    want = np.einsum("bhgn,bhnd->bhgd", w, v).reshape(2, 1, 4, 16)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
    mass = w.sum(2)  # [B, Hkv, N]
    np.testing.assert_allclose(st.slot_mass, mass[..., :6], rtol=2e-5, atol=2e-6)
    # The dispatch: a full-precision layer through the Pallas kernels (the interpreter on
    # CPU) reads the turned keys; a tiered one takes the XLA path. Both equal the XLA result.
    pallas, _ = attend(*args[:6], scale=0.25, implementation="pallas", key_shift=shift,
                       rotate=rotate)  # fmt: skip
    np.testing.assert_allclose(np.asarray(pallas), np.asarray(got), rtol=1e-5, atol=1e-5)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _decode(config, policy, params, cache, toks):
    def body(cache, tok):
        logits, cache = model_step(config, policy, params, cache, tok[:, None], tok[:, None] >= 0)
        return cache, logits[:, 0]

    return jax.lax.scan(body, cache, toks.T)


@pytest.mark.parametrize("case", ["h2o", "confkv-int8", "qevict"])
def test_tiered_and_layer_scan(tiny_llama, case):
    """With INT8 (confkv) and low-bit (qevict) tiers too: the shift moves the logits once the
    policy has evicted, never before, and the layer scan (one stacked cache) equals the
    per-layer cache. The cache itself is the default policy's until the kept sets part."""
    config, params = tiny_llama
    toks = jax.random.randint(jax.random.key(4), (2, 48), 0, config.vocab_size)
    out = {}
    for shift, stacked in ((True, False), (True, True), (False, False)):
        policy = shifted(case, shift)
        cache = new_cache(config, policy, batch=2, max_len=48, dtype=jnp.float32, stacked=stacked)
        out[shift, stacked] = _decode(config, policy, params, cache, toks)
    np.testing.assert_allclose(out[True, True][1], out[True, False][1], rtol=1e-5, atol=1e-5)
    on, off = np.asarray(out[True, False][1]), np.asarray(out[False, False][1])
    moved = np.max(np.abs(on - off), axis=(1, 2))  # per step (logits [S, B, V])
    first = int(np.argmax(moved > 0))
    assert first >= BUDGETS.get(case, BUDGET) - 1 and np.all(moved[:first] == 0), moved
    assert np.max(moved) > 1e-3


def test_one_compilation_for_a_long_generation(tiny_llama):
    config, params = tiny_llama
    policy = H2OPolicy(budget=16, position_shift=True)
    gen = GenerateConfig(max_new_tokens=300, chunk_size=16)
    rng = np.random.default_rng(0)
    before = _generate._cache_size()
    for n in (3, 9, 16, 1):  # all pad to one 16-token chunk
        generate(config, params, [rng.integers(0, 128, size=n).tolist()], policy=policy, gen=gen)
    assert _generate._cache_size() == before + 1
    before = _score_segment._cache_size()
    score_tokens(config, params, rng.integers(0, 128, size=(1, 100)), policy=policy, segment=16)
    assert _score_segment._cache_size() == before + 1


@pytest.mark.parametrize(
    "build_it,match",
    [
        (lambda: H2OPolicy(budget=9, position_shift="true"), "must be True or False"),
        (lambda: make_policy("tova", 9, position_shift=1), "position_shift must be True or False"),
        (lambda: QEvictPolicy(budget=40, position_shift=None), "must be True or False"),
        (lambda: make_policy("window", 9, position_shift=True), "'window' has no position_shift"),
        (lambda: make_policy("kivi", position_shift=True), "'kivi' has no position_shift"),
        (lambda: make_policy("adakv", 9, press="h2o", position_shift=True), "AdaKVPolicy"),
    ],
)
def test_bad_arguments(build_it, match):
    with pytest.raises(ValueError, match=match):
        build_it()


@pytest.mark.parametrize(
    "policy,value,match",
    [
        ("h2o", "maybe", "position_shift must be True or False"),
        ("window", "true", "'window' has no position_shift"),
        ("adakv", "true", "AdaKVPolicy does not support position_shift"),
    ],
)
def test_cli_bad_position_shift_exits_2(policy, value, match, capsys):
    argv = ["stream", "--policy", policy, "--budget", "64", "--set", f"position_shift={value}"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0], err
