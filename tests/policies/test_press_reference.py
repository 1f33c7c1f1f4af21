"""kvpress's presses (Knorm, KeyDiff, ChunkKV, PyramidKV) against brute-force NumPy versions of
their published rules on random streams: the same kept set per KV head after every call,
through the decode fast path and the merge path. Kept counts come from the policy's own ranked
budget and window (not a hard-coded N), so the references hold whatever a budget counts."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.attention import AttnStats
from kvjax.cache import CacheSpec, init_cache
from kvjax.policies import make_policy
from kvjax.policies._base import cached_tokens

H, D = 2, 4


def n_ranked(policy, layer=0):
    return int(policy.ranked_budget(None, layer, 1)[0])


def spec_of(policy, layer, num_layers):
    caps = policy.capacities(num_layers, 0)
    return CacheSpec(batch=1, num_kv_heads=H, head_dim=D, capacities=(caps[layer],))


# --- Knorm / KeyDiff ------------------------------------------------------------------------
def np_key_scores(name, keys: dict) -> dict:
    """pos -> score of every held key (higher = keep), float64."""
    if name == "knorm":
        return {p: -np.linalg.norm(k) for p, k in keys.items()}
    anchor = np.mean([k / np.linalg.norm(k) for k in keys.values()], axis=0)
    cos = lambda k: k @ anchor / (np.linalg.norm(k) * np.linalg.norm(anchor))
    return {p: -cos(k) for p, k in keys.items()}


def simulate_keyed(policy, keys, chunks):
    """keys [S, H, D]; chunks: list of position ranges written together."""
    held = [dict() for _ in range(H)]
    out = []
    for chunk in chunks:
        for h in range(H):
            for p in chunk:
                held[h][p] = keys[p, h].astype(np.float64)
            ring = sorted(held[h])[-policy.ring :]
            scores = np_key_scores(policy.name, held[h])
            ranked = sorted((p for p in held[h] if p not in ring), key=lambda p: -scores[p])
            for p in ranked[n_ranked(policy) :]:
                del held[h][p]
        out.append([set(x) for x in held])
    return out


@functools.cache
def jitted_write(policy, merge: bool, layer: int):
    """One compiled write per policy and path: `write` (the decode path for one-token calls)
    or the general merge path for every call."""

    def general(lc, k, v, pos, valid, stats):
        if hasattr(policy, "_keyed"):
            lc, stats = policy._keyed(lc, k, pos, valid, stats)
        return policy.merge(lc, k, v, pos, valid, stats, None, layer)

    return jax.jit(general if merge else lambda *a: policy.write(*a, None, layer_index=layer))


def run_keyed(policy, keys, chunks, *, merge):
    write = jitted_write(policy, merge, 0)
    lc = init_cache(spec_of(policy, 0, 1)).layers[0]
    out = []
    for chunk in chunks:
        t = len(chunk)
        k = jnp.asarray(keys[chunk.start : chunk.stop])[None]  # [1, T, H, D]
        pos = jnp.asarray(list(chunk), jnp.int32)[None]
        stats = AttnStats(
            slot_mass=jnp.zeros(lc.pos.shape), new_mass=jnp.zeros((1, H, t)),
            lse=jnp.zeros((1, t, H)),
        )  # fmt: skip
        lc = write(lc, k, -k, pos, jnp.ones((1, t), bool), stats)
        out.append(held_sets(lc, keys))
    return out


def held_sets(lc, keys):
    """Per head, the positions held; checks that each slot holds its own token's key once."""
    step = []
    for h in range(H):
        p = np.asarray(lc.pos[0, h])
        for slot in np.nonzero(p >= 0)[0]:
            np.testing.assert_array_equal(np.asarray(lc.k[0, h, slot]), keys[p[slot], h])
        assert len(set(p[p >= 0].tolist())) == int(np.sum(p >= 0)), "a position is held twice"
        step.append(set(int(x) for x in p[p >= 0]))
    return step


KEYED = [("knorm", 7, {}), ("knorm", 9, {"window": 3}), ("keydiff", 7, {}),
         ("keydiff", 9, {"window": 3})]  # fmt: skip


@pytest.mark.parametrize("path", ["decode", "merge", "merge-chunks"])
@pytest.mark.parametrize("idx", range(len(KEYED)), ids=[f"{n}-{b}" for n, b, _ in KEYED])
@settings(max_examples=2)
@given(seed=st.integers(0, 10_000))
def test_key_scored_policy_equals_numpy(seed, idx, path):
    name, budget, kwargs = KEYED[idx]
    policy = make_policy(name, budget, **kwargs)
    rng = np.random.default_rng(seed)
    steps = 26
    # Keys of varied norms and directions (a shared offset makes cosine scores spread).
    keys = rng.standard_normal((steps, H, D)) * rng.uniform(0.2, 3, (steps, H, 1)) + 0.5
    keys = keys.astype(np.float32)
    size = 3 if path == "merge-chunks" else 1
    chunks = [range(s, min(s + size, steps)) for s in range(0, steps, size)]
    want = simulate_keyed(policy, keys, chunks)
    got = run_keyed(policy, keys, chunks, merge=path != "decode")
    cap = policy.capacities(1, 0)[0]
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"call {i}"
        assert all(len(x) <= cap for x in g)
    assert all(len(x) == policy.ring + n_ranked(policy) for x in got[-1])  # evictions happened


# --- ChunkKV / PyramidKV (SnapKV's engine: prefill merges, frozen decode) -------------------
def np_snap_keys(policy, votes: dict) -> dict:
    """pos -> sort key (higher = keep) of every held token: SnapKV's pooled vote over
    neighbours in position order, and for ChunkKV (chunk mean, own pooled vote, -pos)."""
    order = sorted(votes)
    r = policy.pool // 2
    near = lambda i: order[max(0, i - r) : i + r + 1]
    pooled = {p: max(votes[q] for q in near(i)) for i, p in enumerate(order)}
    if policy.name != "chunkkv":
        return pooled
    chunk_of = lambda p: p // policy.chunk
    mean = {}
    for p in order:
        mean[p] = np.mean([pooled[q] for q in order if chunk_of(q) == chunk_of(p)])
    return {p: (mean[p], pooled[p], -p) for p in order}


def simulate_snap(policy, masses, chunks, layer):
    held = [dict() for _ in range(H)]  # pos -> vote
    keep = n_ranked(policy, layer)
    out = []
    for m, chunk in zip(masses, chunks, strict=True):
        for h in range(H):
            toks = held[h]
            before = sorted(toks)[-policy.ring :]
            for p in chunk:
                toks[p] = m[h, p]
            ring = sorted(toks)[-policy.ring :]
            if len(chunk) > 1:  # prefill: every held token votes afresh, top keys kept
                for p in toks:
                    toks[p] = m[h, p]
                key = np_snap_keys(policy, toks)
                ranked = sorted((p for p in toks if p not in ring), key=lambda p: key[p])[::-1]
                for p in ranked[keep:]:
                    del toks[p]
            else:  # frozen decode: the token leaving the ring stays only if a slot is free
                leaving = [p for p in before if p not in ring]
                if leaving and len([p for p in toks if p not in ring]) > keep:
                    del toks[leaving[0]]
        out.append([set(x) for x in held])
    return out


def run_snap(policy, masses, chunks, layer, num_layers):
    lc = init_cache(spec_of(policy, layer, num_layers)).layers[0]
    write = jitted_write(policy, False, layer)
    out = []
    for m, chunk in zip(masses, chunks, strict=True):
        t = len(chunk)
        mj = jnp.asarray(m)
        slot_mass = jnp.where(lc.pos >= 0, mj[jnp.arange(H)[:, None], jnp.maximum(lc.pos[0], 0)], 0)
        stats = AttnStats(
            slot_mass=slot_mass, new_mass=mj[:, chunk.start : chunk.stop][None],
            lse=jnp.zeros((1, t, H)),
        )  # fmt: skip
        k = jnp.arange(chunk.start, chunk.stop, dtype=jnp.float32)[None, :, None, None]
        k = jnp.broadcast_to(k, (1, t, H, D))
        pos = jnp.asarray(list(chunk), jnp.int32)[None]
        lc = write(lc, k, -k, pos, jnp.ones((1, t), bool), stats)
        out.append(held_sets(lc, np.broadcast_to(np.arange(200.0)[:, None, None], (200, H, D))))
    return out


_PYR = {"window": 3, "observation": 4, "pool": 1, "beta": 2, "num_layers": 4}
SNAP = [  # name, budget, kwargs, layer, layers, prefill chunk size (40 % size != 1)
    ("chunkkv", 12, {"window": 3, "observation": 4, "pool": 3, "chunk": 3}, 0, 1, 8),
    ("chunkkv", 14, {"window": 2, "observation": 4, "pool": 1, "chunk": 4}, 0, 1, 11),
    ("pyramidkv", 12, _PYR, 0, 4, 5),
    ("pyramidkv", 12, _PYR, 3, 4, 8),
]


@pytest.mark.parametrize("idx", range(len(SNAP)), ids=[f"{c[0]}-l{c[3]}" for c in SNAP])
@settings(max_examples=2)
@given(seed=st.integers(0, 10_000))
def test_snapkv_family_equals_numpy(seed, idx):
    """Prefill chunks (each compressed from its own votes), then decode steps."""
    name, budget, kwargs, layer, num_layers, size = SNAP[idx]
    policy = make_policy(name, budget, **kwargs)
    rng = np.random.default_rng(seed)
    prefill = 40
    chunks = [range(s, min(s + size, prefill)) for s in range(0, prefill, size)]
    chunks += [range(p, p + 1) for p in range(prefill, prefill + 8)]
    masses = rng.random((len(chunks), H, prefill + 8)).astype(np.float32)
    want = simulate_snap(policy, masses, chunks, layer)
    got = run_snap(policy, masses, chunks, layer, num_layers)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"call {i} ({chunks[i]})"
        assert all(len(x) <= policy.capacities(num_layers, 0)[layer] for x in g)


@pytest.mark.parametrize("n,beta,window,layers", [(1000, 20, 64, 32), (2048, 20, 64, 30),
                                                  (12, 2, 3, 4), (300, 20, 64, 30)])  # fmt: skip
def test_pyramid_budgets_are_kvpress_formula(n, beta, window, layers):
    """Layer budgets = kvpress PyramidKVPress.get_layer_budget with q_len(1 − ratio) = n,
    written out here; below the pyramid's floor (n/β <= window) every layer gets n."""
    policy = make_policy("pyramidkv", n, beta=beta, window=window, observation=window,
                         num_layers=layers)  # fmt: skip
    low = n / beta
    high = 2 * n - low
    if round(low) > window:
        want = [round(high - li * (high - low) / (layers - 1)) for li in range(layers)]
        assert abs(np.mean(want) - n) <= 1
        assert want[0] > want[-1]
    else:
        want = [n] * layers
    assert [policy.max_budget(li) for li in range(layers)] == want
    assert policy.capacities(layers, 10**6) == tuple(cached_tokens(w) for w in want)


# --- when ChunkKV and PyramidKV coincide ------------------------------------------------------
# pool 1: max-pooling makes equal votes, which the NumPy reference and the engine may order
# differently (neither rule says which of two equal votes to keep)
_TWINS = {"window": 3, "observation": 4, "pool": 1}


def twins(num_layers=4, beta=20.0):
    """ChunkKV and PyramidKV at one budget and window (PyramidKV flat: 12/β <= window)."""
    return (make_policy("chunkkv", 12, chunk=3, **_TWINS),
            make_policy("pyramidkv", 12, beta=beta, num_layers=num_layers, **_TWINS))  # fmt: skip


def first_and_last(policy, steps, layer=0):
    """What a frozen-decode policy keeps after `steps` one-token calls and no prefill: the first
    cached(N) − W positions (never evicted: nothing is ever scored) and the last W."""
    ranked = cached_tokens(policy.max_budget(layer)) - policy.ring
    return set(range(min(ranked, steps))) | set(range(max(0, steps - policy.ring), steps))


@pytest.mark.parametrize("seed", [0, 1])
def test_chunkkv_and_pyramidkv_coincide_on_one_token_calls(seed):
    """Teacher-forced perplexity feeds one token per call (`kvjax compare`, chunk=1): with no
    prefill merge neither press ever scores, so both keep the first tokens and the window —
    the same set per step whatever the votes, hence equal perplexities."""
    chunk_kv, pyramid_kv = twins()
    assert [pyramid_kv.max_budget(li) for li in range(4)] == [12] * 4  # the pyramid collapsed
    steps = 30
    masses = np.random.default_rng(seed).random((steps, H, steps)).astype(np.float32)
    chunks = [range(p, p + 1) for p in range(steps)]
    got_c = run_snap(chunk_kv, masses, chunks, 0, 1)
    got_p = run_snap(pyramid_kv, masses, chunks, 0, 4)
    assert got_c == simulate_snap(chunk_kv, masses, chunks, 0)
    for i, (c, p) in enumerate(zip(got_c, got_p, strict=True)):
        assert c == p == [first_and_last(chunk_kv, i + 1)] * H, f"call {i}"


@pytest.mark.parametrize("seed", [0, 1])
def test_chunkkv_and_pyramidkv_differ_after_a_prefill_merge(seed):
    """Prefill chunks of several tokens: ChunkKV ranks whole chunks by their mean pooled vote,
    PyramidKV (flat here) ranks tokens by their own pooled vote: different kept sets, each its
    NumPy reference."""
    chunk_kv, pyramid_kv = twins()
    prefill = 40
    chunks = [range(s, min(s + 8, prefill)) for s in range(0, prefill, 8)]
    masses = np.random.default_rng(seed).random((len(chunks), H, prefill)).astype(np.float32)
    got_c = run_snap(chunk_kv, masses, chunks, 0, 1)
    got_p = run_snap(pyramid_kv, masses, chunks, 0, 4)
    assert got_c == simulate_snap(chunk_kv, masses, chunks, 0)
    assert got_p == simulate_snap(pyramid_kv, masses, chunks, 0)
    assert got_c != got_p


def test_pyramidkv_differs_on_one_token_calls_when_its_pyramid_is_on():
    """With N/β above the window the layers' budgets differ (lower layers more, same mean), so
    even on one-token calls PyramidKV's layers keep different first-token prefixes."""
    _, pyramid_kv = twins(beta=2.0)
    budgets = [pyramid_kv.max_budget(li) for li in range(4)]
    assert budgets[0] > budgets[-1] and abs(np.mean(budgets) - 12) <= 1
    steps = 30
    masses = np.random.default_rng(0).random((steps, H, steps)).astype(np.float32)
    chunks = [range(p, p + 1) for p in range(steps)]
    kept = [run_snap(pyramid_kv, masses, chunks, li, 4)[-1] for li in (0, 3)]
    assert kept == [[first_and_last(pyramid_kv, steps, li)] * H for li in (0, 3)]
    assert kept[0] != kept[1]
