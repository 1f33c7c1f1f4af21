"""adakv: the allocation against a brute-force NumPy AdaKV on random streams, the pool's
physical bytes, XLA attention over the pool against per-head attention, and the generic policy
properties (`kvjax.testing.check_policy`, here rather than in tests/policy_cases.py: every case
there runs in several test files, and adakv's wrapped presses are covered there already)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.attention import AttnStats, attend
from kvjax.cache import LayerCache
from kvjax.models import TINY_LLAMA
from kvjax.policies import AdaKVPolicy, H2OPolicy, KeyDiffPolicy, make_policy
from kvjax.testing import check_policy

H, D = 3, 4


def reference_step(held, new, mass, budget, ring, n_safe):
    """Brute-force AdaKV over H2O scores: held {(head, pos): score} after adding each held
    token's mass and the new tokens (their score = their mass); the layer keeps its
    H·(budget − 1) best: the ring (newest `ring` positions) per head, then each head's top
    n_safe, then the best scores over all heads."""
    scores = {key: s + mass[key] for key, s in held.items()}
    scores.update({key: mass[key] for key in new})
    last = max(p for _, p in scores)
    size = H * (budget - 1)
    prio = {key: np.inf if key[1] > last - ring else s for key, s in scores.items()}
    safe = set()
    for h in range(H):
        mine = sorted((k for k in prio if k[0] == h), key=lambda k: -prio[k])
        safe |= {k for i, k in enumerate(mine) if i < n_safe or prio[k] == np.inf}
    rest = sorted((k for k in prio if k not in safe), key=lambda k: -prio[k])
    kept = safe | set(rest[: size - len(safe)])
    return {k: scores[k] for k in kept}


@pytest.mark.parametrize("alpha", [0.0, 0.75])  # 0.75: 6 safeguarded > the ring of 4
def test_allocation_equals_bruteforce_and_bytes_equal_budget(alpha):
    budget = 9  # 8 cached tokens per head on average: a ring of 4, 4 ranked
    policy = AdaKVPolicy(press=H2OPolicy(budget=budget), alpha_safeguard=alpha)
    ring, n_safe = policy.press.ring, policy.safeguard(0)
    spec = policy.cache_spec(
        batch=1, num_layers=1, num_kv_heads=H, head_dim=D, max_len=64, dtype=jnp.float32
    )
    layer = policy.empty_cache(spec).layers[0]
    slot_bytes = 2 * D * 4
    # Physical K/V bytes of the layer = its budget (H heads x 8 slots), not H x a head's share.
    assert layer.k.nbytes + layer.v.nbytes == H * (budget - 1) * slot_bytes

    write = jax.jit(
        lambda ly, k, v, pos, st: policy.write(
            ly, k, v, pos, jnp.ones(pos.shape, bool), st, None, layer_index=0
        )
    )
    rng = np.random.default_rng(0)
    held, kv, shares = {}, {}, []
    chunks = [6] + [1] * 40  # one prefill chunk, then decode steps
    start = 0
    for t in chunks:
        pos = np.arange(start, start + t)
        mass = {(h, int(p)): float(rng.exponential() ** 2) for h in range(H) for p in pos}
        mass.update({key: float(rng.exponential() ** 2) for key in held})
        k = rng.standard_normal((1, t, H, D)).astype(np.float32)
        v = rng.standard_normal((1, t, H, D)).astype(np.float32)
        kv.update(
            {(h, int(p)): (k[0, i, h], v[0, i, h]) for i, p in enumerate(pos) for h in range(H)}
        )
        lpos, lhead = np.asarray(layer.pos[0, 0]), np.asarray(layer.head[0, 0])
        slot_mass = np.array(
            [mass[(int(h), int(p))] if p >= 0 else 0.0 for h, p in zip(lhead, lpos, strict=True)]
        )
        new_mass = np.array([[mass[(h, int(p))] for p in pos] for h in range(H)])
        stats = AttnStats(
            slot_mass=jnp.asarray(slot_mass[None, None], jnp.float32),
            new_mass=jnp.asarray(new_mass[None], jnp.float32),
            lse=jnp.zeros((1, t, H), jnp.float32),
        )
        layer = write(
            layer, jnp.asarray(k), jnp.asarray(v), jnp.asarray(pos[None], jnp.int32), stats
        )
        new = [(h, int(p)) for h in range(H) for p in pos]
        held = reference_step(held, new, mass, budget, ring, n_safe)
        start += t

        lpos, lhead = np.asarray(layer.pos[0, 0]), np.asarray(layer.head[0, 0])
        got = {
            (int(h), int(p)): i for i, (h, p) in enumerate(zip(lhead, lpos, strict=True)) if p >= 0
        }
        assert set(got) == set(held), f"step ending at {start - 1}"
        for key, i in got.items():  # each slot holds its token's K/V and score
            np.testing.assert_array_equal(np.asarray(layer.k[0, 0, i]), kv[key][0])
            np.testing.assert_array_equal(np.asarray(layer.v[0, 0, i]), kv[key][1])
            np.testing.assert_allclose(float(layer.score[0, 0, i]), held[key], rtol=1e-5)
        shares.append([sum(h == j for h, _ in held) for j in range(H)])
        assert layer.k.nbytes + layer.v.nbytes == H * (budget - 1) * slot_bytes
    shares = np.asarray(shares)
    assert shares.max() > budget - 1  # some head held more than a uniform share ...
    assert shares.min() < budget - 1  # ... at the cost of another, in the same bytes
    assert write._cache_size() == 2  # one compile for the chunk, one for every decode step


def _masses(layer, mass, pos, pooled):
    """AttnStats of a stream step: each cached slot's and new token's mass from `mass`."""
    lpos = np.asarray(layer.pos[0])  # [H or 1, C]
    lhead = np.asarray(layer.head[0]) if pooled else np.arange(H)[:, None] + 0 * lpos
    slot = np.vectorize(lambda h, p: mass[(int(h), int(p))] if p >= 0 else 0.0)(lhead, lpos)
    new = np.array([[mass[(h, int(p))] for p in pos] for h in range(H)])
    f32 = lambda x: jnp.asarray(x[None], jnp.float32)
    return AttnStats(slot_mass=f32(slot), new_mass=f32(new), lse=jnp.zeros((1, len(pos), H)))


def test_full_safeguard_keeps_what_the_per_head_engine_keeps():
    """alpha_safeguard = 1 gives every head its own N - 1: the kept (head, position) sets equal
    the ranked engine's (KeyDiff on per-head slots: the key-scored path, its scores rebuilt from
    each head's keys in the pool) at every step of a random stream."""
    base = KeyDiffPolicy(budget=9, window=2)
    ada = AdaKVPolicy(press=base, alpha_safeguard=1.0)
    kw = dict(batch=1, num_layers=1, num_kv_heads=H, head_dim=D, max_len=64, dtype=jnp.float32)
    pool = ada.empty_cache(ada.cache_spec(**kw)).layers[0]
    per_head = base.empty_cache(base.cache_spec(**kw)).layers[0]
    writer = lambda pol: jax.jit(
        lambda ly, k, v, pos, st: pol.write(
            ly, k, v, pos, jnp.ones(pos.shape, bool), st, None, layer_index=0
        )
    )
    w_pool, w_head = writer(ada), writer(base)
    rng = np.random.default_rng(1)
    start, seen = 0, set()
    for t in [7] + [1] * 30:
        pos = np.arange(start, start + t)
        seen |= {(h, int(p)) for h in range(H) for p in pos}
        mass = {key: float(rng.exponential() ** 2) for key in seen}
        k, v = (jnp.asarray(rng.standard_normal((1, t, H, D)), jnp.float32) for _ in range(2))
        p = jnp.asarray(pos[None], jnp.int32)
        pool = w_pool(pool, k, v, p, _masses(pool, mass, pos, True))
        per_head = w_head(per_head, k, v, p, _masses(per_head, mass, pos, False))
        start += t
        lp, lh = np.asarray(pool.pos[0, 0]), np.asarray(pool.head[0, 0])
        got = {(int(h), int(q)) for h, q in zip(lh, lp, strict=True) if q >= 0}
        hp = np.asarray(per_head.pos[0])
        want = {(h, int(q)) for h in range(H) for q in hp[h] if q >= 0}
        assert got == want, f"step ending at {start - 1}"


def test_pool_attention_equals_per_head_attention():
    """XLA attention over a pool equals attention over the same tokens in per-head slots."""
    rng = np.random.default_rng(3)
    b, c, t, g = 2, 5, 2, 2
    k = rng.standard_normal((b, H, c, D)).astype(np.float32)
    v = rng.standard_normal((b, H, c, D)).astype(np.float32)
    pos = np.stack([[rng.permutation(10)[:c] for _ in range(H)] for _ in range(b)])
    pos[:, 1, 3:] = -1  # a head with fewer tokens
    per_head = LayerCache(
        k=jnp.asarray(k), v=jnp.asarray(v), pos=jnp.asarray(pos, jnp.int32),
        score=jnp.zeros((b, H, c), jnp.float32),
    )  # fmt: skip
    perm = rng.permutation(H * c)  # the pool in a shuffled slot order
    flat = lambda x: x.reshape(b, H * c, *x.shape[3:])[:, perm][:, None]
    head = np.broadcast_to(np.arange(H)[:, None], (H, c)).reshape(-1)[perm]
    pool = LayerCache(
        k=jnp.asarray(flat(k)), v=jnp.asarray(flat(v)), pos=jnp.asarray(flat(pos), jnp.int32),
        score=jnp.zeros((b, 1, H * c), jnp.float32),
        head=jnp.asarray(np.broadcast_to(head, (b, 1, H * c)), jnp.int32), pool_heads=H,
    )  # fmt: skip
    q = jnp.asarray(rng.standard_normal((b, t, H * g, D)), jnp.float32)
    kn = jnp.asarray(rng.standard_normal((b, t, H, D)), jnp.float32)
    vn = jnp.asarray(rng.standard_normal((b, t, H, D)), jnp.float32)
    qpos = jnp.asarray([[10, 11]] * b, jnp.int32)
    valid = jnp.ones((b, t), bool)
    want, wst = attend(q, per_head, kn, vn, qpos, valid, implementation="xla")
    one = (q[:, :1], kn[:, :1], vn[:, :1], qpos[:, :1], valid[:, :1])
    w1, _ = attend(one[0], per_head, *one[1:], implementation="xla")
    for impl in ("xla", "pallas"):  # a decode step; pallas: the pooled kernel (interpreted)
        got, _ = attend(one[0], pool, *one[1:], implementation=impl)
        np.testing.assert_allclose(np.asarray(got), np.asarray(w1), rtol=1e-5, atol=1e-6)
    got, st = attend(q, pool, kn, vn, qpos, valid, implementation="xla")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    mass = np.asarray(wst.slot_mass).reshape(b, H * c)[:, perm]
    np.testing.assert_allclose(np.asarray(st.slot_mass[:, 0]), mass, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(st.new_mass), np.asarray(wst.new_mass), rtol=1e-5)


def test_generic_properties():
    """The shared properties over snapkv (candidate scores, frozen decode); the key-scored path
    is held to the per-head engine above."""
    kw = {"window": 3, "observation": 4, "pool": 3}
    check_policy(lambda b: make_policy("adakv", b, press="snapkv", **kw), budget=16)


def test_bytes_of_a_model_cache_equal_the_budget():
    from kvjax.generate import new_cache

    policy = make_policy(
        "adakv", 12, press="pyramidkv", window=2, observation=2, beta=2,
        num_layers=TINY_LLAMA.num_layers,
    )  # fmt: skip
    cache = new_cache(TINY_LLAMA, policy, batch=1, max_len=64, dtype=jnp.float32)
    caps = policy.capacities(TINY_LLAMA.num_layers, 64)
    assert len(set(caps)) > 1  # pyramidal: layers differ
    for layer, c in zip(cache.layers, caps, strict=True):
        want = TINY_LLAMA.num_kv_heads * c * 2 * TINY_LLAMA.head_dim * 4
        assert layer.k.nbytes + layer.v.nbytes == want


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"press": "confkv", "int8": False}, "fixed budget"),
        ({"press": "snapkv", "window": 4, "observation": 4, "nope": 1}, "nope"),
        ({"press": "nope"}, "unknown press 'nope'"),
        ({"press": "snapkv", "alpha_safeguard": 1.5}, r"alpha_safeguard must be in \[0, 1\]"),
    ],
)
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_policy("adakv", 300, **kwargs)


def test_a_per_head_cache_is_refused():
    policy = AdaKVPolicy(press=H2OPolicy(budget=8))
    layer = (
        H2OPolicy(budget=8)
        .empty_cache(
            dataclasses.replace(
                policy.cache_spec(
                    batch=1, num_layers=1, num_kv_heads=H, head_dim=D, max_len=8, dtype=jnp.float32
                ),
                pooled=False,
            )
        )
        .layers[0]
    )
    with pytest.raises(ValueError, match="pooled caches"):
        policy.write(layer, None, None, None, None, None, None, layer_index=0)


@pytest.mark.parametrize("press", ["kvzip", "keydiff", "h2o"])
def test_adakv_dash_press_is_adakv_over_that_press(press):
    named = make_policy(f"adakv-{press}", 300, num_layers=2)
    assert named == make_policy("adakv", 300, press=press, num_layers=2)
    assert named.press.name == press


@pytest.mark.parametrize(
    "name,kwargs,match",
    [
        ("adakv-nope", {}, "unknown press 'nope'"),
        ("adakv-", {}, "unknown press ''"),
        ("adakv-kvzip", {"press": "h2o"}, "wraps 'kvzip'; it was also given press='h2o'"),
        ("adakv-confkv", {}, "fixed budget"),
    ],
)
def test_bad_adakv_dash_names_are_refused(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_policy(name, 300, **kwargs)
