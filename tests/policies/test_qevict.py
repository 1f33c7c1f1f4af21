"""QEvict against the obvious NumPy version (tests/qevict_reference.py) on random
attention streams, decode and chunked calls: same tiers, same data, same ledger codes after every
call; plus its invariants (write-once ledger, byte budget, sinks/band, positions)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from qevict_reference import Head

from kvjax.attention import AttnStats
from kvjax.cache import live_bytes
from kvjax.policies import QEvictPolicy, make_policy
from kvjax.quant import unpack

H, D = 2, 8


def make(budget=40, batch=1, **kw):
    kw = {"window": 4, "sinks": 2, "band": 8, **kw}
    policy = QEvictPolicy(budget=budget, **kw)
    spec = policy.cache_spec(
        batch=batch, num_layers=1, num_kv_heads=H, head_dim=D, max_len=0, dtype=jnp.float32
    )
    return policy, spec


@functools.partial(jax.jit, static_argnums=0)
def _write(policy, layer, k, v, n0, n_valid, table):
    """One call of T tokens per row at n0 [B], the first n_valid [B] of them real; `table`
    [B, H, S] is this call's attention mass per position."""
    b, t = k.shape[:2]
    pos = n0[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    valid = jnp.arange(t)[None, :] < n_valid[:, None]

    def look(p):
        idx = jnp.clip(p, 0, table.shape[-1] - 1).reshape(b, H, -1)
        got = jnp.take_along_axis(table, idx, axis=2).reshape(p.shape)
        return jnp.where(p >= 0, got, 0.0)

    stats = AttnStats(
        slot_mass=look(layer.pos),
        new_mass=look(jnp.broadcast_to(jnp.where(valid, pos, -1)[:, None, :], (b, H, t))),
        lse=jnp.zeros((b, t, H)),
        lowbit_mass=look(layer.lowbit.pos),
    )
    return policy.write(layer, k, v, pos, valid, stats, None, layer_index=0)


def ledger_of(layer, h):
    """{window: (k codes, v codes, k_scale, k_zero, v_scale, v_zero)} of held pages of head h."""
    lb = jax.tree.map(np.asarray, layer.lowbit)
    fp_pos = np.asarray(layer.pos)[0, h]
    led = np.asarray(layer.aux.fp_ledger)[0, h]
    out = {}
    for p in np.flatnonzero(lb.held[0, h]):
        if lb.pos[0, h, p, 0] >= 0:
            first = lb.pos[0, h, p, 0]
        else:  # dormant: the full-precision slot linking it says which window
            f = int(np.flatnonzero(led == p)[0])
            first = fp_pos[fp_pos.shape[0] - led.shape[0] * lb.pos.shape[-1] :][
                f * lb.pos.shape[-1]
            ]
        codes = (
            np.asarray(unpack(lb.k[0, h, p], lb.bits)),
            np.asarray(unpack(lb.v[0, h, p], lb.bits)),
        )
        out[int(first)] = codes + tuple(
            a[0, h, p] for a in (lb.k_scale, lb.k_zero, lb.v_scale, lb.v_zero)
        )
    return out


def run(policy, spec, chunks, seed, spikes=0.05, lag=0):
    """Drive the jitted policy and the reference; compare after every call. Returns the heads.

    With spec.batch = 2, row 1 has `lag` fewer real tokens in the first call (padding), so the
    rows reach routing events on different calls."""
    lay = policy.layout(D, jnp.float32)
    rng = np.random.default_rng(seed)
    rows, n = spec.batch, sum(chunks)
    t_max = max(chunks)
    data = rng.standard_normal((rows, 2, n + t_max, H, D)).astype(np.float32)
    layer = policy.empty_cache(spec).layers[0]
    heads = [[Head(policy, lay, spec.lowbit_value_group) for _ in range(H)] for _ in range(rows)]
    first_codes = [[{} for _ in range(H)] for _ in range(rows)]
    n0 = np.zeros(rows, np.int32)
    for c, t in enumerate(chunks):
        n_valid = np.array([t - (lag if (r and c == 0) else 0) for r in range(rows)], np.int32)
        # Integer masses keep every sum exact, so ranks (and ties) agree bit for bit.
        table = rng.integers(0, 10, (rows, H, n)).astype(np.float32)
        table += 200 * (rng.random((rows, H, n)) < spikes)
        ks = np.stack([data[r, 0, n0[r] : n0[r] + t] for r in range(rows)])
        vs = np.stack([data[r, 1, n0[r] : n0[r] + t] for r in range(rows)])
        layer = _write(policy, layer, ks, vs, n0.copy(), n_valid, table)  # n0 changes below
        for r in range(rows):
            m = n_valid[r]
            for h, head in enumerate(heads[r]):
                mass = functools.partial(lambda row, p: row[p], table[r, h])
                head.call(ks[r, :m, h], vs[r, :m, h], int(n0[r]), mass)
            n0[r] += m
            one = jax.tree.map(lambda a, r=r: a[r : r + 1], layer)
            check(policy, lay, one, heads[r], first_codes[r], int(n0[r]))
    return [h for row in heads for h in row]


def check(policy, lay, layer, heads, first_codes, n):
    pos = np.asarray(layer.pos)[0]
    k = np.asarray(layer.k)[0]
    lb_pos = np.asarray(layer.lowbit.pos)[0]
    for h, head in enumerate(heads):
        want = head.attended()
        got = {int(p): 1 for p in pos[h][pos[h] >= 0]}
        got.update({int(p): 2 for p in lb_pos[h][lb_pos[h] >= 0]})
        assert got == want, f"head {h} after {n} tokens"
        # Full-precision data: the original token, or its ledger dequantized after a promotion.
        ref_k = {p: v[0] for p, v in head.recent.items()}
        for j, (kk, _, _) in head.fp.items():
            ref_k.update({lay.sinks + j * lay.window + i: kk[i] for i in range(lay.window)})
        for slot in np.flatnonzero(pos[h] >= 0):  # dequantization may fuse a multiply-add: 1 ulp
            np.testing.assert_allclose(k[h, slot], ref_k[int(pos[h, slot])], rtol=3e-7, atol=3e-7)
        # The ledger: the same windows and bit-identical codes, written once.
        led = ledger_of(layer, h)
        assert sorted(led) == sorted(lay.sinks + j * lay.window for j in head.ledger)
        for j, entry in head.ledger.items():
            got_e = led[lay.sinks + j * lay.window]
            for a, b in zip(got_e, entry.codes + entry.stats, strict=True):
                np.testing.assert_array_equal(a, b)
            first = first_codes[h].setdefault(j, got_e)
            for a, b in zip(got_e, first, strict=True):
                np.testing.assert_array_equal(a, b)
        for j in list(first_codes[h]):
            if j not in head.ledger:  # evicted for good: never comes back
                del first_codes[h][j]
        # Sinks and the band never leave full precision.
        for p in range(n):
            if p < lay.sinks or p >= n - policy.local_band:
                assert got[p] == 1
    # The byte budget (sinks + ring + routed windows) is never exceeded.
    assert live_bytes_of(layer) <= policy.budget * 2 * D * 4 * H


def live_bytes_of(layer):
    from kvjax.cache import Cache

    return int(live_bytes(Cache(layers=(layer,), length=jnp.zeros((1,), jnp.int32)))[0])


@settings(max_examples=10)
@given(
    seed=st.integers(0, 2**16),
    chunks=st.lists(st.sampled_from([1, 1, 1, 2, 5, 9]), min_size=8, max_size=30),
    share=st.sampled_from([0.25, 0.5, 0.75]),
    moves=st.sampled_from([None, 1, 2]),
)
def test_matches_reference_on_random_streams(seed, chunks, share, moves):
    """moves 1/2: events that move more windows than that run several rounds; None: one round
    over every candidate."""
    policy, spec = make(quant_share=share, moves=moves)
    run(policy, spec, chunks, seed)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_promote_demote_cycles_keep_ledger_codes(bits):
    """Spiky attention makes windows bounce between tiers; codes stay bit-identical (checked in
    `check` after every call) and the stream really does promote windows."""
    policy, spec = make(budget=44, bits=bits, quant_share=0.5)
    heads = run(policy, spec, [1] * 120, seed=3, spikes=0.08)
    assert sum(h.promotions for h in heads) >= 3


def test_batch_rows_with_different_lengths_route_on_their_own_events():
    policy, spec = make(batch=2)
    run(policy, spec, [6] + [1] * 50, seed=5, spikes=0.1, lag=3)


def test_budget_large_enough_keeps_everything_full_precision():
    policy, spec = make(budget=200)
    heads = run(policy, spec, [7] + [1] * 40, seed=1)
    assert all(not h.low and not h.ledger for h in heads)


def test_bad_budgets_and_fields_raise_clear_errors():
    with pytest.raises(ValueError, match="budget"):
        QEvictPolicy(budget=10, window=4, sinks=2, band=8)
    with pytest.raises(ValueError, match="band"):
        QEvictPolicy(budget=64, window=8, band=12)
    with pytest.raises(ValueError, match="quant_share"):
        QEvictPolicy(budget=64, quant_share=1.5)
    with pytest.raises(ValueError, match="bits"):
        QEvictPolicy(budget=64, bits=3)
    with pytest.raises(ValueError, match="value_group"):
        QEvictPolicy(budget=64, value_group=5).layout(64, jnp.float32)
    with pytest.raises(ValueError, match="needs a budget"):
        make_policy("qevict")


def test_generate_stays_within_byte_budget_and_uses_the_low_bit_tier(tiny_llama):
    from kvjax.generate import GenerateConfig, generate

    config, params = tiny_llama
    policy = QEvictPolicy(budget=40, window=4, sinks=2, band=8)
    out = generate(
        config,
        params,
        [list(range(1, 40)), list(range(3, 12))],
        policy=policy,
        gen=GenerateConfig(max_new_tokens=40, chunk_size=8),
    )
    live = out.telemetry.live_bytes()  # [N, B]
    tok = 2 * config.head_dim * 4
    assert live.max() <= policy.budget * tok * config.num_kv_heads * config.num_layers
    pages = np.asarray(out.telemetry.live_slots)[..., 2]
    assert pages.max() > 0  # windows did go to the low-bit tier


@functools.partial(jax.jit, static_argnums=0)
def _write_layers(policy, layers, k, v, n0, tables):
    """_write's call for several layers (one mass table each) through `write_layers`."""
    b, t = k.shape[:2]
    pos = n0[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    valid = jnp.ones((b, t), bool)

    def stats(layer, table):
        look = lambda p: jnp.where(
            p >= 0,
            jnp.take_along_axis(
                table, jnp.clip(p, 0, table.shape[-1] - 1).reshape(b, H, -1), axis=2
            ).reshape(p.shape),
            0.0,
        )
        return AttnStats(
            slot_mass=look(layer.pos),
            new_mass=look(jnp.broadcast_to(pos[:, None, :], (b, H, t))),
            lse=jnp.zeros((b, t, H)),
            lowbit_mass=look(layer.lowbit.pos),
        )

    st = [stats(layer, table) for layer, table in zip(layers, tables, strict=True)]
    n = len(layers)
    return policy.write_layers(layers, [k] * n, [v] * n, pos, valid, st, None)


def _write_stack(policy, stacked, k, v, n0, tables):
    """`_write_layers`' call over a stacked cache (leading [L] axis) through `write_stack` (not
    jitted here: each test jits it after setting the move loop's form)."""
    b, t = k.shape[:2]
    n = tables.shape[0]
    pos = n0[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    valid = jnp.ones((b, t), bool)

    def look(table, p):
        idx = jnp.clip(p, 0, table.shape[-1] - 1).reshape(b, H, -1)
        return jnp.where(p >= 0, jnp.take_along_axis(table, idx, axis=2).reshape(p.shape), 0.0)

    new_pos = jnp.broadcast_to(pos[:, None, :], (b, H, t))
    stats = AttnStats(
        slot_mass=jax.vmap(look)(tables, stacked.pos),
        new_mass=jax.vmap(look, (0, None))(tables, new_pos),
        lse=jnp.zeros((n, b, t, H)),
        lowbit_mass=jax.vmap(look)(tables, stacked.lowbit.pos),
    )
    stack = lambda x: jnp.broadcast_to(x, (n, *x.shape))
    return policy.write_stack(stacked, stack(k), stack(v), pos, valid, stats, None)


@pytest.mark.parametrize("flat", [True, False])
@pytest.mark.parametrize("moves", [1, None])
def test_write_stack_equals_write_per_layer(moves, flat, monkeypatch):
    """The stacked write's move loop gives exactly each layer's own `write_layers`, batch rows
    and layers routing differently: flat, every head of every layer end to end and taken many
    entries a round (here more moves an event than a round takes: several rounds of each
    kind), and by per-head rounds. Flat, the routing event also reads the moved windows'
    metadata from each kind's arrays; the reference always from one table of candidates."""
    from kvjax.cache import stack_trees
    from kvjax.policies import _qevict_move

    monkeypatch.setattr(_qevict_move, "_FLAT_MIN_HEADS", 0 if flat else 10**9)
    policy, spec = make(budget=44, batch=2, quant_share=0.5, moves=moves)
    write = jax.jit(lambda *a: _write_stack(policy, *a))  # traced with the setting
    per_layer = jax.jit(_write_layers.__wrapped__, static_argnums=0)  # traced below, as few heads

    def reference(*args):
        with monkeypatch.context() as few:
            few.setattr(_qevict_move, "_FLAT_MIN_HEADS", 10**9)
            return per_layer(policy, *args)

    rng = np.random.default_rng(11)
    n_layers, n = 3, 90
    layers = (policy.empty_cache(spec).layers[0],) * n_layers
    stacked = stack_trees(layers, "layers")
    data = rng.standard_normal((2, 2, n + 9, H, D)).astype(np.float32)
    n0 = 0
    for t in [9] + [1] * 40 + [5] * 8:
        tables = rng.integers(0, 10, (n_layers, 2, H, n)).astype(np.float32)
        spikes = rng.random(tables.shape) < np.array([0.02, 0.1, 0.3])[:, None, None, None]
        tables += 200 * spikes
        k, v = data[0, :, n0 : n0 + t], data[1, :, n0 : n0 + t]
        start = np.full((2,), n0, np.int32)
        layers = reference(layers, k, v, start, tuple(tables))
        stacked = write(stacked, k, v, start, jnp.asarray(tables))
        n0 += t
        want = stack_trees(layers, "layers")
        jax.tree.map(np.testing.assert_array_equal, stacked, want)
    low = np.asarray(stacked.lowbit.pos)  # the layers and rows routed differently
    assert not np.array_equal(low[0], low[1]) and not np.array_equal(low[0, 0], low[0, 1])


def test_stacked_moves_write_ascending_distinct_windows(monkeypatch):
    """The stacked move loop promises XLA's scatter ascending, distinct window starts (its
    GPU scatter relies on it): every round's starts, checked as they run."""
    from kvjax.cache import stack_trees
    from kvjax.policies import _qevict_move

    seen = []
    put_rows = _qevict_move._put_rows

    def spy(a, start, x):
        jax.debug.callback(lambda s: seen.append(np.asarray(s)), start)
        return put_rows(a, start, x)

    monkeypatch.setattr(_qevict_move, "_put_rows", spy)
    monkeypatch.setattr(_qevict_move, "_FLAT_MIN_HEADS", 0)
    policy, spec = make(budget=44, batch=2, quant_share=0.5, moves=1)
    stacked = stack_trees((policy.empty_cache(spec).layers[0],) * 2, "layers")
    write = jax.jit(lambda *a: _write_stack(policy, *a))  # traced with the spy
    rng = np.random.default_rng(5)
    n0 = 0
    for t in [9] + [1] * 70 + [5] * 4:
        tables = rng.integers(0, 10, (2, 2, H, 100)).astype(np.float32)
        tables += 200 * (rng.random(tables.shape) < 0.2)
        kv = rng.standard_normal((2, 2, t, H, D)).astype(np.float32)
        stacked = write(stacked, kv[0], kv[1], np.full((2,), n0, np.int32), jnp.asarray(tables))
        n0 += t
    jax.block_until_ready(stacked)
    rows = 2 * 2 * H * policy.capacity(0)  # starts below this write a window
    assert any((s < rows).any() for s in seen) and any((s >= rows).sum() > 1 for s in seen)
    for s in seen:
        assert (np.diff(s) > 0).all(), s


def test_write_layers_equals_write_per_layer():
    """One pair of movement loops for all layers (layers routing different numbers of windows,
    so some run rounds past their own) gives exactly each layer's own `write`."""
    policy, spec = make(budget=44, quant_share=0.5, moves=1)
    rng = np.random.default_rng(7)
    n_layers, n = 3, 90
    layers = (policy.empty_cache(spec).layers[0],) * n_layers
    alone = list(layers)
    data = rng.standard_normal((2, n + 9, H, D)).astype(np.float32)
    n0 = 0
    for t in [9] + [1] * 40 + [5] * 8:
        tables = rng.integers(0, 10, (n_layers, 1, H, n)).astype(np.float32)
        tables += 200 * (rng.random(tables.shape) < np.array([0.02, 0.1, 0.3])[:, None, None, None])
        k, v = data[0, None, n0 : n0 + t], data[1, None, n0 : n0 + t]
        start = np.array([n0], np.int32)
        layers = _write_layers(policy, layers, k, v, start, tuple(tables))
        alone = [
            _write(policy, layer, k, v, start, np.array([t], np.int32), table)
            for layer, table in zip(alone, tables, strict=True)
        ]
        n0 += t
        for got, want in zip(layers, alone, strict=True):
            jax.tree.map(np.testing.assert_array_equal, got, want)
    low = [np.asarray(layer.lowbit.pos) for layer in layers]  # the layers routed differently
    assert not np.array_equal(low[0], low[1]) and not np.array_equal(low[1], low[2])


@pytest.mark.parametrize("stacked", [False, True])
def test_pallas_ring_write_equals_xla_scatters(stacked):
    """write_kernel="pallas" (a decode step's ring write as one slot-write kernel, interpreted
    on CPU; over a stacked cache, one launch for every layer) leaves exactly the cache XLA's
    scatters leave, through prefill chunks (XLA's write either way) and routing events."""
    from kvjax.cache import stack_trees

    xla, spec = make(budget=44, batch=2, quant_share=0.5, write_kernel="xla")
    fused = dataclasses.replace(xla, write_kernel="pallas")
    rng = np.random.default_rng(3)
    n_layers, n = 2, 90
    caches = {}
    for policy in (xla, fused):
        layers = (policy.empty_cache(spec).layers[0],) * n_layers
        caches[policy.write_kernel] = stack_trees(layers, "layers") if stacked else layers
    write = {
        p.write_kernel: jax.jit(lambda *a, p=p: _write_stack(p, *a))
        if stacked
        else functools.partial(_write_layers, p)
        for p in (xla, fused)
    }
    data = rng.standard_normal((2, 2, n + 9, H, D)).astype(np.float32)
    n0 = 0
    for t in [9] + [1] * 70:
        tables = rng.integers(0, 10, (n_layers, 2, H, n)).astype(np.float32)
        tables += 200 * (rng.random(tables.shape) < 0.1)
        k, v = data[0, :, n0 : n0 + t], data[1, :, n0 : n0 + t]
        start = np.full((2,), n0, np.int32)
        for name in caches:
            args = jnp.asarray(tables) if stacked else tuple(tables)
            caches[name] = write[name](caches[name], k, v, start, args)
        n0 += t
        jax.tree.map(np.testing.assert_array_equal, caches["pallas"], caches["xla"])
    pages = np.asarray((caches["xla"].lowbit if stacked else caches["xla"][0].lowbit).pos)
    assert (pages >= 0).any()  # windows did reach the low-bit tier through events


def test_unknown_write_kernel_is_named():
    with pytest.raises(ValueError, match="write_kernel must be one of"):
        QEvictPolicy(budget=100, write_kernel="cuda")


def test_gpu_form_of_the_ranking_matches_the_reference(monkeypatch):
    """The routing event's GPU ranking (its tiers back by a scatter), here on the CPU, keeps
    every call equal to the NumPy reference through events that promote and demote."""
    from kvjax.policies import _qevict_rank

    monkeypatch.setattr(_qevict_rank, "_gpu_ranking", lambda: True)
    jax.clear_caches()  # `_write` traces again, under the GPU form
    try:
        policy, spec = make(quant_share=0.5, moves=2)
        heads = run(policy, spec, [9] + [1] * 50 + [5] * 6, seed=7, spikes=0.2)
        assert any(h.ledger for h in heads)  # windows did reach the low-bit tier
    finally:
        jax.clear_caches()
