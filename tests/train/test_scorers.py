"""Scorer modules vs the per-layer inference functions the policy uses; scorer files."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.scorers import (
    ScorerConfig,
    features,
    init_mlstm_state,
    init_scorer_params,
    layer_params,
    load_scorer,
    make_scorer,
    mlp_score,
    mlstm_step,
    save_scorer,
)

L, H, D, S = 2, 3, 8, 12


def _kv(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return jax.random.normal(k1, (2, S, L, H, D)), jax.random.normal(k2, (2, S, L, H, D))


def _config(kind, **kw):
    return ScorerConfig(
        kind=kind, num_layers=L, num_kv_heads=H, head_dim=D, hidden=8, memory=4, **kw
    )


def test_mlp_module_equals_per_layer_scores():
    cfg = _config("mlp")
    params = init_scorer_params(cfg, jax.random.key(1))
    k, v = _kv()
    out = make_scorer(cfg).apply({"params": params}, k, v)
    assert out.shape == (2, L, H, S)
    for layer in range(L):
        got = mlp_score(layer_params(params, layer), k[:, :, layer], v[:, :, layer])
        np.testing.assert_allclose(out[:, layer], got, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("delayed", [True, False])
def test_mlstm_module_equals_token_by_token_reads(delayed):
    """Token t is read (its query against the memory) after token t + w entered the memory —
    exactly what the policy does when t leaves its window; `immediate` reads after t itself."""
    cfg = _config("mlstm", delayed=delayed)
    params = jax.tree.map(
        lambda a: a + 0.3 * jax.random.normal(jax.random.key(a.size), a.shape),
        init_scorer_params(cfg, jax.random.key(2)),
    )  # non-zero gates
    k, v = _kv(3)
    window = 4
    out = make_scorer(cfg).apply({"params": params}, k, v, window=window)
    delay = window if delayed else 0
    for layer in range(L):
        p = layer_params(params, layer)
        x = features(k[:, :, layer], v[:, :, layer])  # [B, S, H, F]
        state = init_mlstm_state(cfg, 2)
        for tau in range(S):
            state, score = mlstm_step(p, state, x[:, tau], x[:, max(tau - delay, 0)])
            if tau >= delay:
                np.testing.assert_allclose(
                    out[:, layer, :, tau - delay], score, rtol=2e-5, atol=2e-5
                )
        if delay:
            np.testing.assert_array_equal(out[:, layer, :, S - delay :], 0.0)


def test_delay_changes_the_scores():
    k, v = _kv(4)
    params = init_scorer_params(_config("mlstm"), jax.random.key(5))
    params = jax.tree.map(lambda a: a + 0.3, params)
    run = lambda d: make_scorer(_config("mlstm", delayed=d)).apply(
        {"params": params}, k, v, window=3
    )
    assert not np.allclose(run(True)[..., : S - 3], run(False)[..., : S - 3])


def test_scorer_file_round_trip(tmp_path):
    cfg = _config("mlstm")
    params = init_scorer_params(cfg, jax.random.key(6))
    path = tmp_path / "s.msgpack"
    save_scorer(path, cfg, params, {"model": "tiny"}, dtype=np.float32)
    got_cfg, got, meta = load_scorer(path)
    assert got_cfg == cfg and meta == {"model": "tiny"}
    jax.tree.map(np.testing.assert_array_equal, got, jax.tree.map(np.asarray, params))


def test_corrupt_or_mismatched_scorer_files(tmp_path):
    cfg = _config("mlp")
    params = init_scorer_params(cfg, jax.random.key(7))
    bad = tmp_path / "garbage.msgpack"
    bad.write_bytes(b"\x00not a scorer")
    with pytest.raises(ValueError, match="not a"):
        load_scorer(bad)
    wrong = tmp_path / "wrong.msgpack"
    save_scorer(wrong, cfg, {**params, "w1": jnp.zeros((L, H, 5, 8))})
    with pytest.raises(ValueError, match="do not match its config"):
        load_scorer(wrong)
    with pytest.raises(FileNotFoundError, match="no scorer file"):
        load_scorer(tmp_path / "missing.msgpack")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "lstm"}, "kind must be one of"),
        ({"hidden": 0}, "hidden"),
        ({"num_layers": -1}, "num_layers"),
    ],
)
def test_bad_scorer_config(kwargs, match):
    base = dict(kind="mlp", num_layers=1, num_kv_heads=1, head_dim=4)
    with pytest.raises(ValueError, match=match):
        ScorerConfig(**(base | kwargs))


def test_window_out_of_range():
    cfg = _config("mlstm")
    k, v = _kv()
    params = init_scorer_params(cfg, jax.random.key(0))
    with pytest.raises(ValueError, match="window"):
        make_scorer(cfg).apply({"params": params}, k, v, window=S)


@pytest.mark.parametrize("name", ["mlstm", "mlp"])
def test_shipped_scorers_fit_the_default_model_and_beat_the_baselines(name):
    """The shipped files load, fit SmolLM2-135M, are package data, stay small, and their recorded
    held-out boundary accuracy (measured on the stored float16 parameters) beats recency and H2O
    at the budget they were trained for."""
    import tomllib

    from kvjax.models import SMOLLM2_135M
    from kvjax.scorers import SHIPPED

    cfg, params, meta = load_scorer(name)
    m = SMOLLM2_135M
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) == (
        m.num_layers,
        m.num_kv_heads,
        m.head_dim,
    )
    assert SHIPPED[name].stat().st_size < 4 * 2**20
    root = SHIPPED[name].parents[3]
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "kvjax.scorers.data" in data["packages"]
    assert "*.msgpack" in data["package-data"]["kvjax.scorers.data"]
    acc = meta["accuracy"]
    assert acc["decisions"] > 100_000
    assert acc["scorer"] > acc["h2o"] + 0.1 and acc["scorer"] > acc["recency"] + 0.1
    assert meta["config"]["labels"] == {
        "sinks": 4,
        "window": 32,
        "k": 96,
        "aggregate": "max",
        "decay": 0.0,
        "weighting": "uniform",
    }
