"""Ranked policies (H2O, TOVA, random, CONF-KV) against a slow, obvious NumPy simulation on
random attention streams: the same kept set after every step, through both the decode fast path
and the general merge path."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.attention import AttnStats
from kvjax.cache import CacheSpec, init_cache
from kvjax.policies import ConfKVPolicy, RankedPolicy, make_policy

H, D = 2, 4


def np_update(policy, score, mass):
    if policy.name == "tova":
        return mass
    if policy.name == "random":
        return score
    if policy.name == "confkv":
        return policy.ema_decay * score + (1 - policy.ema_decay) * mass
    return score + mass  # h2o


def np_init(policy, mass, pos, layer, head):
    if policy.name == "random":
        from kvjax.policies._random import hash_uniform

        return float(
            hash_uniform(policy.seed, layer, jnp.full((1, H, 1), pos, jnp.int32), (1, H, 1))[
                0, head, 0
            ]
        )
    if policy.name == "confkv":
        return (1 - policy.ema_decay) * mass
    return mass


def np_priority(policy, score, pos, cur):
    if pos < policy.sinks:
        return np.inf
    if policy.name == "confkv":
        return score + policy.recency_weight * (pos + 1) / (cur + 1)
    return score


def simulate(policy, masses, budgets, layer=0):
    """Obvious version: per head, a dict pos -> score; ring = newest `ring` positions; `budgets`
    are the ranked slots per step (a budget of N attended tokens: N - 1 cached, the next
    step's own token on top; N - 1 - ring of them ranked)."""
    kept_per_step = []
    tokens = [dict() for _ in range(H)]
    for t, (m, n_ranked) in enumerate(zip(masses, budgets, strict=True)):
        step = []
        for h in range(H):
            toks = tokens[h]
            for p in toks:
                toks[p] = np_update(policy, toks[p], m[h, p])
            toks[t] = np_init(policy, m[h, t], t, layer, h)
            ring = sorted(toks)[-policy.ring :]
            ranked = [p for p in toks if p not in ring]
            ranked.sort(key=lambda p: -np_priority(policy, toks[p], p, t))
            for p in ranked[n_ranked:]:
                del toks[p]
            step.append(set(toks))
        kept_per_step.append(step)
    return kept_per_step


def run_jit(policy, masses, states, *, merge: bool, layer=0):
    spec = CacheSpec(
        batch=1,
        num_kv_heads=H,
        head_dim=D,
        capacities=(policy.capacities(1, 0)[0],),
        int8_capacities=None
        if policy.int8_capacities(1, 0) is None
        else (policy.int8_capacities(1, 0)[0],),
    )
    lc = init_cache(spec).layers[0]
    # One compiled write per test case (not op-by-op dispatch of every op, every step).
    if merge:
        write = jax.jit(lambda *a: policy.merge(*a, layer))
    else:
        write = jax.jit(lambda *a: policy.write(*a, layer_index=layer))
    kept = []
    codes_seen = {}  # (head, position) -> (k codes, k scale) when first quantized
    for t, (m, state) in enumerate(zip(masses, states, strict=True)):

        def mass_of(pos, m=m):  # [1, H, C] slot positions -> their random mass this step
            p = pos[0]
            return jnp.where(
                p >= 0, jnp.asarray(m)[jnp.arange(H)[:, None], jnp.maximum(p, 0)], 0.0
            )[None]

        stats = AttnStats(
            slot_mass=mass_of(lc.pos),
            new_mass=jnp.asarray(m[:, t])[None, :, None],
            lse=jnp.zeros((1, 1, H)),
            int8_mass=None if lc.int8 is None else mass_of(lc.int8.pos),
        )
        k = jnp.full((1, 1, H, D), float(t))
        pos = jnp.full((1, 1), t, jnp.int32)
        args = (lc, k, -k, pos, jnp.ones((1, 1), bool), stats, state)
        lc = write(*args)
        step = []
        for h in range(H):
            p = np.asarray(lc.pos[0, h])
            allp = list(p[p >= 0])
            if lc.int8 is not None:
                q = np.asarray(lc.int8.pos[0, h])
                allp += list(q[q >= 0])
                # INT8 data is the quantized token: k = pos (exactly representable here).
                for slot in np.nonzero(q >= 0)[0]:
                    val = float(lc.int8.k[0, h, slot, 0]) * float(lc.int8.k_scale[0, h, slot])
                    assert abs(val - q[slot]) <= abs(q[slot]) / 254 + 1e-6
                    # Write-once: a token's codes and scale never change after quantization.
                    now = (
                        np.asarray(lc.int8.k[0, h, slot]).tobytes(),
                        float(lc.int8.k_scale[0, h, slot]),
                    )
                    assert codes_seen.setdefault((h, int(q[slot])), now) == now
            assert len(allp) == len(set(allp)), "a position is stored twice"
            for slot in np.nonzero(p >= 0)[0]:
                assert float(lc.k[0, h, slot, 0]) == p[slot]
            step.append(set(int(x) for x in allp))
        kept.append(step)
    return kept, lc


def policies():
    return [
        make_policy("h2o", 8),
        make_policy("h2o", 7, recent_ratio=0.3),
        make_policy("tova", 6),
        make_policy("tova", 6, recent=2),
        make_policy("random", 9, recent=3, seed=3),
        ConfKVPolicy(budget=10, protected=3, fp_window=3, int8=False, recency_weight=0.3),
        ConfKVPolicy(budget=12, protected=2, fp_window=4, int8=True),
        ConfKVPolicy(budget=14, protected=2, fp_window=3, int8=False, pyramid=0.5, num_layers=3),
    ]


@pytest.mark.parametrize("merge", [False, True], ids=["decode", "merge"])
@pytest.mark.parametrize("idx", range(len(policies())))
@settings(max_examples=1)
@given(seed=st.integers(0, 10_000))
def test_jit_policy_equals_numpy_simulation(seed, idx, merge):
    policy: RankedPolicy = policies()[idx]
    rng = np.random.default_rng(seed)
    steps = 24
    masses = rng.random((steps, H, steps)).astype(np.float32)
    layer = 2 if getattr(policy, "pyramid", 0) else 0
    if isinstance(policy, ConfKVPolicy):
        confident = rng.random(steps) < 0.5
        states = [jnp.asarray([c]) for c in confident]
        scale = 1 + policy.pyramid * (1 - 2 * layer / (policy.num_layers - 1)) if layer else 1
        tight = max(1, round(policy.budget * policy.tight_ratio * scale))
        attended = [tight if c else max(1, round(policy.budget * scale)) for c in confident]
    else:
        states = [None] * steps
        attended = [policy.budget] * steps
    budgets = [n - 1 - policy.ring for n in attended]
    want = simulate(policy, masses, budgets, layer)
    got, _ = run_jit(policy, masses, states, merge=merge, layer=layer)
    for t in range(steps):
        assert got[t] == want[t], f"step {t}"
        for h in range(H):
            # The next step attends the cache + its own token: at most the budget in force
            # (reached once enough tokens were seen); the newest `ring` are always kept.
            assert len(got[t][h]) + 1 <= attended[t]
            if t + 1 >= attended[t] and not isinstance(policy, ConfKVPolicy):
                assert len(got[t][h]) + 1 == attended[t]  # fixed budgets fill up exactly
            assert set(range(max(0, t - policy.ring + 1), t + 1)) <= got[t][h]


@pytest.mark.parametrize("idx", [0, 5, 6], ids=["h2o", "confkv", "confkv-int8"])
def test_pallas_slot_writes_equal_xla_scatters(idx):
    """write_kernel="pallas" (one slot-write kernel per decode step, interpreted on CPU) leaves
    exactly the cache the XLA scatters leave, step after step, on a random attention stream."""
    policy = dataclasses.replace(policies()[idx], write_kernel="xla")
    fused = dataclasses.replace(policy, write_kernel="pallas")
    rng = np.random.default_rng(idx)
    steps = 20
    masses = rng.random((steps, H, steps)).astype(np.float32)
    states = [jnp.asarray([c]) for c in rng.random(steps) < 0.5]
    if not isinstance(policy, ConfKVPolicy):
        states = [None] * steps
    want_kept, want = run_jit(policy, masses, states, merge=False)
    got_kept, got = run_jit(fused, masses, states, merge=False)
    assert got_kept == want_kept
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_unknown_write_kernel_is_named():
    for build in (lambda: make_policy("h2o", 8, write_kernel="cuda"),
                  lambda: ConfKVPolicy(budget=1000, write_kernel="cuda")):  # fmt: skip
        with pytest.raises(ValueError, match="write_kernel must be one of"):
            build()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"budget": 20, "protected": 32}, r"must exceed the current token \+ the protected"),
        ({"budget": 8, "protected": 3, "int8": False}, "must exceed the current token"),
        ({"budget": 100, "tau": 1.5}, r"tau must be in \[0, 1\]"),
        ({"budget": 100, "ema_decay": 1.0}, r"ema_decay must be in \[0, 1\)"),
        ({"budget": 100, "weights": (1, 2)}, "weights must be 3"),
    ],
)
def test_confkv_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ConfKVPolicy(**kwargs)


@pytest.mark.parametrize(
    "name,budget,match",
    [
        ("h2o", 2, "budget must be >= 3"),
        ("tova", 2, r"must be at least 1 \+ window \+ max\(1, sinks\) = 3"),
        ("random", 33, r"leaves 0 ranked slots.*= 34"),
    ],
)
def test_ranked_bad_budgets(name, budget, match):
    with pytest.raises(ValueError, match=match):
        make_policy(name, budget)


def test_smallest_budgets_are_accepted():
    """The boundary of the definition: one ranked slot after the current token and the ring."""
    assert make_policy("tova", 3).capacity(0) == 2
    assert make_policy("h2o", 3).capacity(0) == 2
    assert make_policy("random", 34).capacity(0) == 33
    assert ConfKVPolicy(budget=10, protected=3, int8=False).capacities(1, 0) == (9,)


def test_unknown_hyperparameter_is_named():
    with pytest.raises(ValueError, match="policy 'h2o'.*unexpected keyword"):
        make_policy("h2o", 8, window=3)


def test_auto_write_kernel_is_pallas_on_gpu_only():
    """The default slot-write path: the one-launch kernel on GPU, XLA's scatters on TPU/CPU;
    an explicit choice is kept everywhere."""
    from kvjax.policies._ranked import resolve_write_kernel

    assert make_policy("h2o", 8).write_kernel == "auto"
    got = {b: resolve_write_kernel("auto", b) for b in ("gpu", "tpu", "cpu")}
    assert got == {"gpu": "pallas", "tpu": "xla", "cpu": "xla"}
    for name in ("xla", "pallas"):
        assert {resolve_write_kernel(name, b) for b in ("gpu", "tpu", "cpu")} == {name}


@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(1, 40),
    seed=st.integers(0, 2**31 - 1),
    p_empty=st.sampled_from([0.0, 0.3, 1.0]),
    levels=st.sampled_from([3, 1000]),
)
def test_slot_stats_is_the_four_reductions_by_brute_force(m, seed, p_empty, levels):
    """The decode step's fused reduction against a per-row Python loop: live count, first empty
    slot, lowest occupied priority and its slot (jnp.argmin's rule: first on ties, NaN first),
    with ties (few priority levels), +inf (sinks), NaN, and rows with no empty / no occupied
    slot."""
    from kvjax.policies._ranked import slot_stats

    rng = np.random.default_rng(seed)
    shape = (3, 2, m)
    # empty: EMPTY (-1) or any other negative position (the sign bit marks it)
    empty = np.where(rng.random(shape) < 0.5, -1, -rng.integers(1, 2**31, shape, dtype=np.int64))
    pos = np.where(rng.random(shape) < p_empty, empty, rng.integers(0, 100, shape)).astype(np.int32)
    prio = rng.integers(0, levels, shape).astype(np.float32)
    prio[rng.random(shape) < 0.1] = np.inf
    prio[rng.random(shape) < 0.05] = np.nan
    got = [np.asarray(x) for x in jax.jit(slot_stats)(jnp.asarray(pos), jnp.asarray(prio))]
    for b, h in np.ndindex(shape[:2]):
        occ = [i for i in range(m) if pos[b, h, i] >= 0]
        free = next((i for i in range(m) if pos[b, h, i] < 0), 0)
        # empty slots count as +inf (so a row of only +inf gives its first slot, empty or not)
        vals = [(prio[b, h, i] if i in occ else np.inf, i) for i in range(m)]
        nans = [i for v, i in vals if np.isnan(v)]
        low = np.nan if nans else min(v for v, _ in vals)
        lowest = nans[0] if nans else next(i for v, i in vals if v == low)
        assert got[0][b, h] == len(occ)
        assert got[1][b, h] == free
        np.testing.assert_array_equal(got[2][b, h], low)
        assert got[3][b, h] == lowest, (pos[b, h], prio[b, h])


@pytest.mark.parametrize("int8", [False, True], ids=["fp", "int8"])
def test_write_layers_plans_all_layers_like_write_per_layer(int8):
    """`write_layers`' joint decode plan (one budget-shrink cond for all layers) equals `write`
    layer by layer, array for array, over decode steps whose confidence state flips, with
    pyramid budgets (so at a flip some layers are over their tight budget and others not)."""
    n_layers, b, t_steps = 3, 2, 40
    policy = ConfKVPolicy(
        budget=20, protected=2, fp_window=3, int8=int8, pyramid=0.5, num_layers=n_layers
    )
    spec = CacheSpec(
        batch=b,
        num_kv_heads=H,
        head_dim=D,
        capacities=policy.capacities(n_layers, 0),
        int8_capacities=policy.int8_capacities(n_layers, 0),
    )
    rng = np.random.default_rng(7)
    joint = list(init_cache(spec).layers)
    alone = list(joint)

    def stats_of(lc, t):
        mass = lambda pos: jnp.where(pos >= 0, jnp.asarray(rng.random(pos.shape), jnp.float32), 0)
        return AttnStats(
            slot_mass=mass(lc.pos),
            new_mass=jnp.asarray(rng.random((b, H, 1)), jnp.float32),
            lse=jnp.zeros((b, 1, H)),
            int8_mass=None if lc.int8 is None else mass(lc.int8.pos),
        )

    per_layer = jax.jit(
        lambda lcs, k, pos, valid, sts, state: tuple(
            policy.write(lc, k, -k, pos, valid, st, state, layer_index=i)
            for i, (lc, st) in enumerate(zip(lcs, sts, strict=True))
        )
    )
    together = jax.jit(
        lambda lcs, k, pos, valid, sts, state: policy.write_layers(
            lcs, [k] * n_layers, [-k] * n_layers, pos, valid, sts, state
        )
    )
    for t in range(t_steps):
        state = jnp.asarray([(t // 7) % 2 == 1, (t // 5) % 2 == 0])  # tight / loose flips
        sts = [stats_of(lc, t) for lc in joint]
        k = jnp.asarray(rng.normal(size=(b, 1, H, D)), jnp.float32)
        pos = jnp.full((b, 1), t, jnp.int32)
        valid = jnp.asarray([[True], [t % 9 != 4]])
        joint = together(joint, k, pos, valid, sts, state)
        alone = per_layer(alone, k, pos, valid, sts, state)
        for x, y in zip(jax.tree.leaves(joint), jax.tree.leaves(alone), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"step {t}")
    live = [int(np.sum(np.asarray((lc.int8 if int8 else lc).pos) >= 0)) for lc in joint]
    assert len(set(live)) > 1  # the pyramid gave the layers different sizes
