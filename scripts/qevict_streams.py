"""QEvict's caches over random write streams, saved, and two such files compared bit for bit: the
check that a change to QEvict's write leaves every array of the cache as it was.

    PYTHONPATH=$OLD .venv/bin/python -P scripts/qevict_streams.py dump old.npz   # old code
    PYTHONPATH=$NEW .venv/bin/python -P scripts/qevict_streams.py dump new.npz
    .venv/bin/python scripts/qevict_streams.py compare old.npz new.npz

`dump` drives `QEvictPolicy.write` (and `write_layers`, `write_stack`) over random chunked
streams whose attention statistics are random tables with spikes (so windows move between all
three tiers), and saves every array of the cache after every call (28,210 arrays): 36
single-layer streams over six settings of quant_share, moves, bits and budget, three seeds,
batch 1 and 2 (the second row lagging); 3-layer `write_layers` and `write_stack` streams; and
SmolLM2-shaped (D 64, 3 KV heads, budget 256) 2-layer streams, stacked and unrolled, a
300-token prefill then 120 decode steps. It uses only the public API, so it runs against any
commit's kvjax (PYTHONPATH). `compare` prints how many arrays differ (exit status 1 if any).
"""

from __future__ import annotations

import itertools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.attention import AttnStats
from kvjax.policies import QEvictPolicy


def _stats(layer, pos, valid, table, heads):
    """Attention statistics of one call: every cached or new token's mass is table[position]."""
    b, t = pos.shape

    def look(p):
        idx = jnp.clip(p, 0, table.shape[-1] - 1).reshape(b, heads, -1)
        got = jnp.take_along_axis(table, idx, axis=2).reshape(p.shape)
        return jnp.where(p >= 0, got, 0.0)

    new = jnp.broadcast_to(jnp.where(valid, pos, -1)[:, None, :], (b, heads, t))
    return AttnStats(
        slot_mass=look(layer.pos),
        new_mass=look(new),
        lse=jnp.zeros((b, t, heads)),
        lowbit_mass=look(layer.lowbit.pos),
    )


def _stream(out, tag, policy, heads, d, batch, chunks, seed, *, layers=1, mode="single",
            spikes=0.08, lag=0):  # fmt: skip
    spec = policy.cache_spec(
        batch=batch, num_layers=layers, num_kv_heads=heads, head_dim=d, max_len=0,
        dtype=jnp.float32,
    )  # fmt: skip
    rng = np.random.default_rng(seed)
    n, tmax = sum(chunks), max(chunks)
    data = rng.standard_normal((layers, batch, 2, n + tmax, heads, d)).astype(np.float32)
    cache = list(policy.empty_cache(spec).layers)
    if mode == "stack":
        cache = jax.tree.map(lambda *x: jnp.stack(x), *cache)

    @jax.jit
    def step(cache, ks, vs, n0, n_valid, tables):
        t = ks.shape[2]
        pos = n0[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        valid = jnp.arange(t)[None, :] < n_valid[:, None]
        if mode == "single":
            st = _stats(cache[0], pos, valid, tables[0], heads)
            return [policy.write(cache[0], ks[0], vs[0], pos, valid, st, None, layer_index=0)]
        if mode == "layers":
            sts = [_stats(c, pos, valid, tables[i], heads) for i, c in enumerate(cache)]
            return list(policy.write_layers(cache, list(ks), list(vs), pos, valid, sts, None))
        sts = jax.vmap(lambda c, tb: _stats(c, pos, valid, tb, heads))(cache, tables)
        return policy.write_stack(cache, ks, vs, pos, valid, sts, None)

    n0 = np.zeros(batch, np.int32)
    for c, t in enumerate(chunks):
        n_valid = np.array([t - (lag if (r and c == 0) else 0) for r in range(batch)], np.int32)
        tables = rng.integers(0, 10, (layers, batch, heads, n)).astype(np.float32)
        tables += 200 * (rng.random((layers, batch, heads, n)) < spikes)
        ks, vs = (
            np.stack([np.stack([data[i, r, kv, n0[r] : n0[r] + t] for r in range(batch)])
                      for i in range(layers)])
            for kv in (0, 1)
        )  # fmt: skip
        cache = step(cache, ks, vs, n0.copy(), n_valid, tables)
        for i, a in enumerate(jax.tree.leaves(cache)):
            out[f"{tag}/{c}/{i}"] = np.asarray(a)
        n0 += n_valid


def dump(path: str) -> None:
    out: dict[str, np.ndarray] = {}
    small = dict(window=4, sinks=2, band=8)
    settings = [(0.25, None, 2, 40), (0.5, 1, 2, 40), (0.75, 2, 4, 44), (0.5, 16, 8, 44),
                (0.5, 2, 2, 60), (0.25, 1, 4, 52)]  # fmt: skip
    for share, moves, bits, budget in settings:
        p = QEvictPolicy(budget=budget, quant_share=share, moves=moves, bits=bits, **small)
        for seed, batch in itertools.product(range(3), (1, 2)):
            chunks = [9] + list(np.random.default_rng(seed).choice([1, 1, 1, 2, 5, 9], 40))
            tag = f"s{share}-{moves}-{bits}-{budget}/{seed}/{batch}"
            _stream(out, tag, p, 2, 8, batch, chunks, seed, lag=3 if batch == 2 else 0)
    p = QEvictPolicy(budget=44, quant_share=0.5, moves=2, **small)
    for mode in ("layers", "stack"):
        _stream(out, mode, p, 2, 8, 2, [6] + [1] * 40 + [5, 9, 2], 11, layers=3, mode=mode, lag=3)
    p = QEvictPolicy(budget=256)  # SmolLM2-like: D 64, 3 KV heads, window 8
    for mode in ("stack", "layers"):
        chunks = [300] + [1] * 120
        _stream(out, f"big-{mode}", p, 3, 64, 1, chunks, 5, layers=2, mode=mode, spikes=0.03)
    np.savez_compressed(path, **out)
    print(len(out), "arrays")


def compare(path_a: str, path_b: str) -> int:
    a, b = np.load(path_a), np.load(path_b)
    if sorted(a.files) != sorted(b.files):
        print("different arrays:", sorted(set(a.files) ^ set(b.files))[:5])
        return 1
    bad = [
        k for k in a.files
        if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape or a[k].tobytes() != b[k].tobytes()
    ]  # fmt: skip
    print(len(a.files), "arrays compared,", len(bad), "differ", bad[:5])
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["dump"] and len(sys.argv) == 3:
        dump(sys.argv[2])
    elif sys.argv[1:2] == ["compare"] and len(sys.argv) == 4:
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    else:
        sys.exit(__doc__)
