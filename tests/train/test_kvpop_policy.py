"""The kvpop policy against a brute-force top-k on random K/V streams: after every call the cache
holds exactly the sinks, the newest w tokens and the k best priorities among the tokens that left
the window, each priority being the scorer module's (delayed) read — the training-time math."""

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.attention import AttnStats
from kvjax.policies import KVpopPolicy, make_policy
from kvjax.scorers import load_scorer, make_scorer, save_scorer

DATA = pathlib.Path(__file__).parent / "data"
B, H, D, S = 2, 2, 16, 48


def _scorer(kind, tmp_path=None):
    if kind == "mlstm-immediate":  # the ablation: same parameters, read as each token arrives
        config, params, meta = load_scorer(_scorer("mlstm"))
        path = tmp_path / "immediate.msgpack"
        save_scorer(
            path, dataclasses.replace(config, delayed=False), params, meta, dtype=np.float32
        )
        return str(path)
    return str(DATA / f"tiny_llama_{kind}.msgpack")


def _expected(prio, p, sinks, window, k):
    """Positions kept once tokens 0..p are written (prio: [S] static priorities)."""
    left = list(range(sinks, max(sinks, p - window + 1)))
    best = sorted(left, key=lambda t: -prio[t])[:k]
    return set(range(min(sinks, p + 1))) | set(range(max(0, p - window + 1), p + 1)) | set(best)


@pytest.mark.parametrize(
    ("kind", "decay"), [("mlstm", 0.0), ("mlp", 0.0), ("mlstm-immediate", 0.0), ("mlp", 0.05)]
)
@pytest.mark.parametrize("chunks", [[1] * S, [5, 1, 7, 3, 1, 1, 9, 2, 11, 8]])
def test_running_top_k_equals_brute_force(kind, decay, chunks, tmp_path):
    sinks, window, k = 2, 4, 6
    scorer = _scorer(kind, tmp_path)
    budget = 1 + sinks + window + k  # attended: the current token + what the cache keeps
    policy = KVpopPolicy(budget=budget, sinks=sinks, window=window, scorer=scorer, decay=decay)
    spec = policy.cache_spec(
        batch=B, num_layers=2, num_kv_heads=H, head_dim=D, max_len=S, dtype=jnp.float32
    )
    layer = policy.empty_cache(spec).layers[1]
    kk, kv = jax.random.split(jax.random.key(len(chunks)))
    k_all = jax.random.normal(kk, (B, S, H, D))
    v_all = jax.random.normal(kv, (B, S, H, D))
    config, params, _ = load_scorer(scorer)
    stacked = lambda x: jnp.stack([x, x], axis=2)  # [B, S, L, H, D]: layer 1 is the one checked
    prio = make_scorer(config).apply(
        {"params": params}, stacked(k_all), stacked(v_all), window=window
    )
    prio = np.asarray(prio[:, 1]) + np.float32(decay) * np.arange(S, dtype=np.float32)  # [B, H, S]
    write = jax.jit(policy.write, static_argnames="layer_index")
    start = 0
    for n in chunks:
        pos = jnp.broadcast_to(jnp.arange(start, start + n, dtype=jnp.int32), (B, n))
        stats = AttnStats(
            slot_mass=jnp.zeros((B, H, layer.capacity)),
            new_mass=jnp.zeros((B, H, n)),
            lse=jnp.zeros((B, n, 4)),
        )
        sl = slice(start, start + n)
        valid = jnp.ones((B, n), bool)
        layer = write(layer, k_all[:, sl], v_all[:, sl], pos, valid, stats, None, layer_index=1)
        start += n
        got = np.asarray(layer.pos)
        for b in range(B):
            for h in range(H):
                want = _expected(prio[b, h], start - 1, sinks, window, k)
                assert set(got[b, h][got[b, h] >= 0].tolist()) == want, (b, h, start)
    assert start == S


def test_scorer_that_does_not_fit_the_model():
    policy = KVpopPolicy(budget=16, sinks=2, window=4, scorer=_scorer("mlp"))
    with pytest.raises(
        ValueError, match=r"trained for a model with \(layers, KV heads, head_dim\)"
    ):
        policy.cache_spec(
            batch=1, num_layers=3, num_kv_heads=2, head_dim=16, max_len=8, dtype=jnp.float32
        )
        policy.empty_cache(
            policy.cache_spec(
                batch=1, num_layers=3, num_kv_heads=2, head_dim=16, max_len=8, dtype=jnp.float32
            )
        )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"budget": 7, "sinks": 2, "window": 4}, "must exceed the current token \\+ sinks"),
        ({"budget": 16, "window": 0}, "window must be >= 1"),
        ({"budget": 16, "sinks": -1}, "sinks must be >= 0"),
        ({"budget": 16, "window": 4, "decay": -0.1}, "decay must be >= 0"),
        ({"budget": 16, "window": 4, "scorer": "/nonexistent.msgpack"}, "no scorer file"),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    kwargs = {"scorer": _scorer("mlp")} | kwargs
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        KVpopPolicy(**kwargs)


def test_registry():
    p = make_policy("kvpop", 16, window=4, scorer=_scorer("mlstm"))
    assert isinstance(p, KVpopPolicy) and p.sinks == 4 and p.capacity(100) == 15
    with pytest.raises(ValueError, match="needs a budget"):
        make_policy("kvpop", window=4, scorer=_scorer("mlstm"))


@pytest.mark.parametrize("kind", ["mlstm", "mlp"])
def test_recency_dominated_priorities_reproduce_streaming_llm(tiny_llama, kind):
    """With a huge temporal decay the priority is the position, so sinks + window + the k newest
    of the rest is StreamingLLM at the same budget: the same NLL through the whole loop (decode
    and chunked prefill), up to float32 summation order (slots sit in other places)."""
    from kvjax.generate import score_tokens
    from kvjax.policies import StreamingPolicy

    config, params = tiny_llama
    ids = np.random.default_rng(1).integers(0, 128, size=(2, 40))
    kv = KVpopPolicy(budget=12, sinks=2, window=3, scorer=_scorer(kind), decay=1e3)
    for chunk in (1, 4):
        run = lambda p, c=chunk: np.asarray(
            score_tokens(config, params, ids, policy=p, chunk=c).nll
        )
        want = run(StreamingPolicy(budget=12, sinks=2))
        np.testing.assert_allclose(run(kv), want, rtol=1e-5, atol=1e-5)
        assert not np.allclose(
            run(KVpopPolicy(budget=12, sinks=2, window=3, scorer=_scorer(kind))), want
        )
