"""Compression once before the question (kvpress's protocol) and the presses scored outside
the loop (KVzip, ExpectedAttention), against brute-force NumPy versions of their rules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.eval import press_context
from kvjax.eval._press import press_scores, top_slots
from kvjax.generate import GenerateConfig, generate, generate_from_cache
from kvjax.policies import (
    cached_tokens,
    expected_attention_scores,
    kvzip_scores,
    make_policy,
    unrotate,
)


def np_softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def np_rope_matrix(p, d, theta):
    """R(p) of the half-split RoPE, written out entry by entry."""
    r = np.zeros((d, d))
    for i in range(d // 2):
        a = p / theta ** (2 * i / d)
        r[i, i], r[i, i + d // 2] = np.cos(a), -np.sin(a)
        r[i + d // 2, i], r[i + d // 2, i + d // 2] = np.sin(a), np.cos(a)
    return r


def test_kvzip_scores_equal_numpy():
    rng = np.random.default_rng(0)
    b, t, hq, hkv, d, n0, s = 1, 5, 4, 2, 8, 2, 6
    q = rng.standard_normal((b, t, hq, d)).astype(np.float32)
    ks, kc = (rng.standard_normal((b, hkv, n, d)).astype(np.float32) for n in (n0, s))
    kr = rng.standard_normal((b, t, hkv, d)).astype(np.float32)
    got = np.asarray(kvzip_scores(*map(jnp.asarray, (q, ks, kc, kr))))
    want = np.zeros((b, hkv, s))
    for h in range(hkv):
        for g in range(hq // hkv):
            for i in range(t):
                keys = np.concatenate([ks[0, h], kc[0, h], kr[0, : i + 1, h]])
                p = np_softmax(keys.astype(np.float64) @ q[0, i, h * (hq // hkv) + g] / np.sqrt(d))
                want[0, h] = np.maximum(want[0, h], p[n0 : n0 + s])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("cov,vnorm", [(True, True), (False, False)])
def test_expected_attention_scores_equal_numpy(cov, vnorm):
    rng = np.random.default_rng(1)
    b, s, hq, hkv, d, sink, fut, theta = 1, 12, 4, 2, 8, 2, 7, 50.0
    q = rng.standard_normal((b, s, hq, d)).astype(np.float32) + 0.3
    k, v = (rng.standard_normal((b, hkv, s, d)).astype(np.float32) for _ in range(2))
    got = np.asarray(expected_attention_scores(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), length=s, rope_theta=theta,
        n_future=fut, n_sink=sink, use_covariance=cov, use_vnorm=vnorm, epsilon=0.01,
    ))  # fmt: skip
    rbar = np.mean([np_rope_matrix(p, d, theta) for p in range(s, s + fut)], axis=0)
    g = hq // hkv
    want = np.zeros((b, hkv, s))
    for h in range(hkv):
        acc = 0
        for j in range(g):
            qs = q[0, sink:, h * g + j].astype(np.float64)
            mu, sigma = qs.mean(0), np.cov(qs.T, bias=True)
            keys = k[0, h, sink:].astype(np.float64)
            logit = keys @ (rbar @ mu) / np.sqrt(d)
            if cov:
                logit += np.array([x @ rbar @ sigma @ rbar.T @ x for x in keys]) / d / 2
            acc = acc + np_softmax(logit) / g
        if vnorm:
            acc = (acc + 0.01) * np.linalg.norm(v[0, h, sink:].astype(np.float64), axis=-1)
        want[0, h, sink:] = acc
    want[..., :sink] = want[..., sink:].max()
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-7)


def test_unrotate_inverts_rope():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 3, 2, 8))
    pos = np.array([[0, 5, 40]])
    rotated = np.einsum("tij,thj->thi", [np_rope_matrix(p, 8, 100.0) for p in pos[0]], x[0])
    back = unrotate(jnp.asarray(rotated[None], jnp.float32), jnp.asarray(pos), 100.0)
    np.testing.assert_allclose(np.asarray(back), x, atol=1e-5)


def test_top_slots_are_the_top_scores_in_slot_order():
    rng = np.random.default_rng(3)
    sc = rng.random((2, 3, 20)).astype(np.float32)
    got = np.asarray(top_slots(jnp.asarray(sc), 7))
    for b, h in np.ndindex(2, 3):
        assert got[b, h].tolist() == sorted(np.argsort(-sc[b, h])[:7].tolist())


def _answer_after(tiny_llama, pressed, question, n_new):
    config, params = tiny_llama
    gen = GenerateConfig(max_new_tokens=n_new, chunk_size=8)
    tokens = jnp.zeros((1, 8), jnp.int32).at[0, : len(question)].set(jnp.asarray(question))
    res, cache = generate_from_cache(config, pressed.policy, gen, params, pressed.cache, tokens,
                                     jnp.asarray([len(question)]), jax.random.key(0))  # fmt: skip
    return np.asarray(res.tokens)[0, : int(res.num_generated[0])].tolist(), cache


CONTEXT = np.random.default_rng(5).integers(1, 128, 40).tolist()
# No token twice: a repeated token's layer-0 keys have equal norms (RoPE is a rotation), an
# exact tie that float rounding breaks differently in programs of different shapes.
DISTINCT = np.random.default_rng(5).permutation(np.arange(1, 128))[:40].tolist()
QUESTION = [5, 9, 17, 33, 65]
KVZIP_IDS = dict(reconstruct=[3, 4, 5], reconstruct_next=[6, 7], suffix=[8])


@pytest.mark.parametrize(
    "name,kwargs",
    [("snapkv", {"window": 3, "observation": 4, "pool": 3}),
     ("kvzip", {"n_sink": 2, "chunk": 16}), ("expected", {"n_sink": 2})],
)  # fmt: skip
def test_keeping_the_whole_context_answers_like_the_full_cache(tiny_llama, name, kwargs):
    config, params = tiny_llama
    pressed = press_context(config, params, make_policy(name, 64, **kwargs), CONTEXT,
                            room=len(QUESTION) + 6, **KVZIP_IDS)  # fmt: skip
    assert pressed.kept == (len(CONTEXT),) * config.num_layers
    got, _ = _answer_after(tiny_llama, pressed, QUESTION, 6)
    full = generate(config, params, [CONTEXT + QUESTION], policy=make_policy("full"),
                    gen=GenerateConfig(max_new_tokens=6, chunk_size=8))  # fmt: skip
    assert got == np.asarray(full.tokens)[0, :6].tolist()


@pytest.mark.parametrize("name", ["kvzip", "expected", "keydiff"])
def test_compressed_once_then_question_and_answer_never_evict_context(tiny_llama, name):
    config, params = tiny_llama
    kw = {"snapkv": {"window": 3, "observation": 4, "pool": 3}}.get(name, {})
    kw = kw | (
        {"n_sink": 2, "chunk": 16}
        if name == "kvzip"
        else {"n_sink": 2}
        if name == "expected"
        else {}
    )
    pressed = press_context(config, params, make_policy(name, 16, **kw), CONTEXT, room=12,
                            **KVZIP_IDS)  # fmt: skip
    # Every policy keeps budget - 1 before the question, as in the generate loop (a budget
    # counts the attended current token, kvjax.policies.cached_tokens).
    want = cached_tokens(16)
    assert pressed.kept == (want,) * config.num_layers
    before = [np.asarray(ly.pos[0]) for ly in pressed.cache.layers]
    answer, cache = _answer_after(tiny_llama, pressed, QUESTION, 6)
    s = len(CONTEXT)
    for pos0, ly in zip(before, cache.layers, strict=True):
        for h in range(pos0.shape[0]):
            ctx = set(pos0[h][pos0[h] >= 0].tolist())
            assert len(ctx) == want and max(ctx) < s
            if name in ("kvzip", "expected"):
                assert {0, 1} <= ctx  # the sinks
            held = np.asarray(ly.pos[0, h])
            held = set(held[held >= 0].tolist())
            # every context token stays; the question and the answer tokens appended after it
            assert held == ctx | set(range(s, s + len(QUESTION) + len(answer)))


@pytest.mark.parametrize("name", ["h2o", "snapkv", "knorm", "adakv"])
def test_padded_shapes_keep_the_same_tokens_and_answer(tiny_llama, name):
    """min_slots (free slots up to a shared size) and chunk_multiple (a padded prefill) change
    the shapes only: the same kept tokens, the same answer, the cache min_slots wide (over a
    context without exact score ties: `DISTINCT`)."""
    config, params = tiny_llama
    kw = {"snapkv": {"window": 3, "observation": 4, "pool": 3}, "adakv": {"press": "h2o"}}
    policy = make_policy(name, 16, **kw.get(name, {}))
    plain = press_context(config, params, policy, DISTINCT, room=12)
    padded = press_context(config, params, policy, DISTINCT, room=12, min_slots=64,
                           chunk_multiple=32)  # fmt: skip
    assert padded.kept == plain.kept
    assert _held(padded.cache) == _held(plain.cache)
    assert padded.policy.slots == (64,) * config.num_layers
    assert max(plain.policy.slots) < 64
    assert (
        _answer_after(tiny_llama, padded, QUESTION, 6)[0]
        == _answer_after(tiny_llama, plain, QUESTION, 6)[0]
    )


def test_press_rejects_bad_input(tiny_llama):
    config, params = tiny_llama
    with pytest.raises(ValueError, match="tiered"):
        press_context(config, params, make_policy("confkv", 300), CONTEXT, room=4)
    with pytest.raises(ValueError, match="reconstruction prompt"):
        press_context(config, params, make_policy("adakv", 16, press="kvzip"), CONTEXT, room=4)
    with pytest.raises(ValueError, match="reconstruction prompt"):
        press_context(config, params, make_policy("kvzip", 16), CONTEXT, room=4)
    with pytest.raises(ValueError, match="room >= 1"):
        press_context(config, params, make_policy("h2o", 16), CONTEXT, room=0)
    with pytest.raises(ValueError, match="min_slots >= 0 and chunk_multiple >= 1"):
        press_context(config, params, make_policy("h2o", 16), CONTEXT, room=4, chunk_multiple=0)


def np_adakv(scores, n, n_safe):
    """AdaKV's allocation written out: each head's own top n_safe, then the top scores left over
    all heads (ties: the lower head, then the lower slot) until the layer holds H·n."""
    h, s = scores.shape
    kept = set()
    for hh in range(h):
        order = sorted(range(s), key=lambda i: (-scores[hh, i], i))
        kept |= {(hh, i) for i in order[:n_safe]}
    rest = sorted(
        ((hh, i) for hh in range(h) for i in range(s) if (hh, i) not in kept),
        key=lambda c: (-scores[c], c[0] * s + c[1]),
    )
    return kept | set(rest[: h * n - len(kept)])


def _held(cache):
    """Per layer the set of (KV head, position) a cache holds (per-head slots or a pool)."""
    out = []
    for ly in cache.layers:
        pos = np.asarray(ly.pos[0])
        if ly.head is not None:
            head = np.asarray(ly.head[0, 0])
            out.append({(int(h), int(p)) for h, p in zip(head, pos[0], strict=True) if p >= 0})
        else:
            out.append({(h, int(p)) for h in range(pos.shape[0]) for p in pos[h] if p >= 0})
    return out


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_adakv_over_a_press_scored_policy_equals_numpy(tiny_llama, alpha):
    config, params = tiny_llama
    budget = 9
    policy = make_policy("adakv", budget, press="expected", n_sink=2, alpha_safeguard=alpha)
    pressed = press_context(config, params, policy, CONTEXT, room=12)
    ids = jnp.asarray([CONTEXT], jnp.int32)
    _, scores = press_scores(config, params, policy.press, CONTEXT, ids, (), (), (), jnp.float32)
    n = cached_tokens(budget)
    h = config.num_kv_heads
    before = _held(pressed.cache)
    for got, sc in zip(before, scores, strict=True):
        assert got == np_adakv(np.asarray(sc[0]), n, int(n * alpha))
    assert pressed.kept == (n,) * config.num_layers  # H·n a layer, n per head on average
    shares = [sorted(sum(hh == x for hh, _ in got) for x in range(h)) for got in before]
    assert any(s[0] != s[-1] for s in shares)  # the heads' shares differ: the budget is pooled
    # the pool holds the kept tokens and the room: its bytes, whatever the shares
    for ly in pressed.cache.layers:
        assert ly.k.nbytes + ly.v.nbytes == h * (n + 12) * 2 * config.head_dim * 4
    # the question and the answer append after the pooled context, which stays
    answer, cache = _answer_after(tiny_llama, pressed, QUESTION, 4)
    s = len(CONTEXT)
    new = {(hh, p) for hh in range(h) for p in range(s, s + len(QUESTION) + len(answer))}
    assert _held(cache) == [ctx | new for ctx in before]


def test_adakv_streamed_once_keeps_the_pool(tiny_llama):
    """adakv over SnapKV, the context as one chunk through the pool: α = 1 keeps what SnapKV
    keeps per head; α = 0.2 keeps H·n a layer in unequal shares."""
    config, params = tiny_llama
    kw = {"window": 3, "observation": 4, "pool": 3}
    base = press_context(config, params, make_policy("snapkv", 9, **kw), CONTEXT, room=4)
    same = press_context(config, params, make_policy("adakv", 9, alpha_safeguard=1.0, **kw),
                         CONTEXT, room=4)  # fmt: skip
    assert _held(same.cache) == _held(base.cache)
    pooled = press_context(config, params, make_policy("adakv", 9, **kw), CONTEXT, room=4)
    n, h = cached_tokens(9), config.num_kv_heads
    assert pooled.kept == (n,) * config.num_layers
    assert pooled.policy.pooled and pooled.policy.slots == (n + 4,) * config.num_layers
    for ly, got in zip(pooled.cache.layers, _held(pooled.cache), strict=True):
        assert len(got) == h * n and all(p < len(CONTEXT) for _, p in got)
        assert ly.pos.shape == (1, 1, h * (n + 4))


def test_pooled_append_fills_the_pool_prefix_one_slot_per_head():
    """AppendPolicy(pooled=True): token t's head h goes to slot live + rank(t)·H + h; padding
    takes no slot, the token past the pool is not cached, the context prefix is untouched."""
    from kvjax.cache import CacheSpec, init_cache
    from kvjax.policies import AppendPolicy

    h, d, c = 2, 4, 3  # a pool of 6 slots, 3 held
    spec = CacheSpec(batch=1, num_kv_heads=h, head_dim=d, capacities=(c,), dtype=jnp.float32,
                     pooled=True)  # fmt: skip
    ly = init_cache(spec).layers[0]
    ly = ly.replace(pos=ly.pos.at[0, 0, :3].set(jnp.asarray([4, 1, 7])),
                    head=ly.head.at[0, 0, :3].set(jnp.asarray([1, 0, 1])))  # fmt: skip
    rng = np.random.default_rng(0)
    k_new = jnp.asarray(rng.standard_normal((1, 3, h, d)), jnp.float32)
    pos_new = jnp.asarray([[8, 9, 10]], jnp.int32)
    valid = jnp.asarray([[True, False, True]])
    out = AppendPolicy(slots=(c,), pooled=True).write(
        ly, k_new, 2 * k_new, pos_new, valid, None, None, layer_index=0
    )
    assert np.asarray(out.pos[0, 0]).tolist() == [4, 1, 7, 8, 8, 10]
    assert np.asarray(out.head[0, 0]).tolist() == [1, 0, 1, 0, 1, 0]
    want = np.zeros((6, d), np.float32)
    want[3], want[4], want[5] = k_new[0, 0, 0], k_new[0, 0, 1], k_new[0, 2, 0]
    np.testing.assert_array_equal(np.asarray(out.k[0, 0]), want)
    np.testing.assert_array_equal(np.asarray(out.v[0, 0]), 2 * want)
