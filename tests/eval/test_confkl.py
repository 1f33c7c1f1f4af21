"""`kvjax confidence-kl`: the ablated pass is exact, the statistics match references."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache import CacheSpec, init_cache
from kvjax.cli import main
from kvjax.eval import (
    bootstrap_ci,
    check_confidence_kl_args,
    held_out_essays,
    iter_ablation_logits,
    kl_divergence,
    pearson,
    rankdata,
    run_confidence_kl,
    sample_positions,
    spearman,
)
from kvjax.models import forward
from kvjax.weights import LoadedModel, essay_text

# Tiny random models give float32 logits of magnitude < 1; the cached and dense paths differ only
# in reduction order (observed <= 3e-7 on CPU).
ATOL = 1e-5
N = 48
POSITIONS = [30, 31, 36, 44, 47]  # widest gap 8: x_0..x_30 in 4 chunks, then padded chunks


def _dense_logits(config, params, ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Plain forward of [B, S] ids at explicit positions [S] with an empty 1-slot cache.

    Padded to N tokens (padding is neither attended nor cached) so that one compilation serves.
    """
    b, s = ids.shape
    spec = CacheSpec(
        batch=b,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        capacities=(1,) * config.num_layers,
    )
    pad = lambda x: np.pad(np.broadcast_to(x, (b, s)), ((0, 0), (0, N - s)))
    out = _jit_forward(
        config,
        params,
        jnp.asarray(pad(ids), jnp.int32),
        jnp.asarray(pad(positions), jnp.int32),
        jnp.asarray(pad(np.ones((1, s), bool))),
        init_cache(spec),
    )
    return np.asarray(out.logits)[:, :s]


_jit_forward = jax.jit(forward, static_argnums=0)  # eager op-by-op dispatch is slower than this


def _tokens(config, b: int, n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, config.vocab_size, (b, n)).astype(np.int32)


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_gpt2"])
def test_ablated_logits_match_dense_reference(request, model):
    """x_t at position t over [0, t-R) ∪ {t} equals a dense pass of [x_0..x_{t-R-1}, x_t]."""
    config, params = request.getfixturevalue(model)
    tokens = _tokens(config, 2, N)
    dense = _dense_logits(config, params, tokens, np.arange(N))  # causal: row t sees x_0..x_t
    for ablate in (1, 5, 12):
        for t, full, ablated in iter_ablation_logits(
            config, params, tokens, POSITIONS, ablate=ablate
        ):
            keep = np.r_[np.arange(t - ablate), t]
            ref_ablated = _dense_logits(config, params, tokens[:, keep], keep)[:, -1]
            msg = f"t={t} R={ablate}"
            np.testing.assert_allclose(np.asarray(ablated), ref_ablated, atol=ATOL, err_msg=msg)
            np.testing.assert_allclose(np.asarray(full), dense[:, t], atol=ATOL, err_msg=msg)
            assert np.abs(ref_ablated - dense[:, t]).max() > 10 * ATOL  # ablation does something


def test_no_ablation_gives_the_full_distribution(tiny_llama):
    """R = 0 hides nothing: the ablated pass reproduces the full one and KL is 0."""
    config, params = tiny_llama
    tokens = _tokens(config, 2, N, seed=1)
    for _, full, ablated in iter_ablation_logits(config, params, tokens, POSITIONS, ablate=0):
        np.testing.assert_allclose(np.asarray(ablated), np.asarray(full), atol=1e-5)
        np.testing.assert_allclose(kl_divergence(full, ablated), 0.0, atol=1e-9)


def test_kl_divergence_is_nonnegative_and_matches_definition():
    rng = np.random.default_rng(0)
    p, q = rng.normal(size=(2, 7, 11)) * 3
    kl = kl_divergence(p, q)
    assert kl.shape == (7,) and np.all(kl >= 0)
    # Two outcomes: softmax([0, log 3]) = (1/4, 3/4) vs uniform: KL = 1/4 ln(1/2) + 3/4 ln(3/2).
    two = kl_divergence(np.array([0.0, np.log(3.0)]), np.array([5.0, 5.0]))
    assert two == pytest.approx(0.25 * np.log(0.5) + 0.75 * np.log(1.5))
    np.testing.assert_allclose(kl_divergence(p, p), 0.0, atol=1e-12)


def test_pearson_matches_numpy():
    rng = np.random.default_rng(1)
    x = rng.normal(size=200)
    y = -0.7 * x + rng.normal(size=200)
    assert pearson(x, y) == pytest.approx(np.corrcoef(x, y)[0, 1], abs=1e-12)
    assert np.isnan(pearson(np.ones(5), np.arange(5.0)))


def _brute_ranks(x: np.ndarray) -> np.ndarray:
    """Rank of x_i = #smaller + (#equal + 1) / 2 (1-based, ties averaged)."""
    return np.array([np.sum(x < v) + (np.sum(x == v) + 1) / 2 for v in x])


def test_rankdata_and_spearman_match_brute_force():
    rng = np.random.default_rng(2)
    x = rng.integers(0, 10, size=60).astype(np.float64)  # many ties
    y = x + rng.integers(-3, 4, size=60)
    np.testing.assert_array_equal(rankdata(x), _brute_ranks(x))
    assert rankdata(np.array([3.0, 1.0, 3.0, 2.0])).tolist() == [3.5, 1.0, 3.5, 2.0]
    ref = np.corrcoef(_brute_ranks(x), _brute_ranks(y))[0, 1]
    assert spearman(x, y) == pytest.approx(ref, abs=1e-12)
    # Without ties: rho = 1 - 6 sum d^2 / (n (n^2 - 1)).
    u, v = rng.normal(size=(2, 50))
    d = _brute_ranks(u) - _brute_ranks(v)
    assert spearman(u, v) == pytest.approx(1 - 6 * np.sum(d * d) / (50 * (50**2 - 1)))
    assert spearman(u, np.exp(u)) == pytest.approx(1.0)  # monotone, nonlinear


def test_bootstrap_ci_contains_r_and_is_seeded():
    rng = np.random.default_rng(3)
    x = rng.normal(size=150)
    y = -0.5 * x + rng.normal(size=150)
    lo, hi = bootstrap_ci(x, y, resamples=500, seed=7)
    assert lo < pearson(x, y) < hi < 0
    assert bootstrap_ci(x, y, resamples=500, seed=7) == (lo, hi)
    lo_s, hi_s = bootstrap_ci(x, y, spearman, resamples=300, seed=0)
    assert lo_s < spearman(x, y) < hi_s


def test_sample_positions_are_distinct_and_even():
    t = sample_positions(1024, 128, 256)
    assert t[0] == 256 and t[-1] == 1023 and len(np.unique(t)) == 128
    assert set(np.diff(t).tolist()) <= {6, 7}
    assert sample_positions(10, 6, 4).tolist() == [4, 5, 6, 7, 8, 9]


@dataclasses.dataclass(frozen=True)
class _CharTokenizer:
    """Stands in for a real tokenizer of the tiny models (vocab 128)."""

    def encode(self, text: str) -> list[int]:
        return [ord(ch) % 128 for ch in text]


@pytest.fixture
def tiny_loaded(tiny_llama) -> LoadedModel:
    config, params = tiny_llama
    return LoadedModel(config=config, params=params, tokenizer=_CharTokenizer(), source="tiny")


def test_run_confidence_kl_end_to_end(tiny_loaded):
    res = run_confidence_kl(
        tiny_loaded,
        essays=2,
        n_tokens=96,
        samples=8,
        ablate=8,
        min_context=32,
        resamples=200,
        progress=False,
    )
    assert len(res.texts) == 2 and res.n == 16 == len(res.kl) == len(res.values["c"])
    kl, c = np.asarray(res.kl), np.asarray(res.values["c"])
    assert np.all(kl >= -1e-6) and res.mean_kl == pytest.approx(kl.mean())
    assert res.pearson["c"] == pytest.approx(np.corrcoef(c, kl)[0, 1], abs=1e-9)
    assert res.pearson_ci["c"][0] <= res.pearson["c"] <= res.pearson_ci["c"][1]
    v = res.values
    np.testing.assert_allclose(
        c,
        0.4 * np.asarray(v["one_minus_entropy"])
        + 0.3 * np.asarray(v["sigmoid_margin"])
        + 0.3 * np.asarray(v["top1"]),
        atol=1e-6,
    )
    # The jitted float32 KL agrees with the float64 reference on the same logits.
    tokens = np.asarray([_CharTokenizer().encode(essay_text(n))[:96] for n in res.texts], np.int32)
    ref = [
        kl_divergence(f, a)
        for _, f, a in iter_ablation_logits(
            tiny_loaded.config, tiny_loaded.params, tokens, res.positions[:8], ablate=8
        )
    ]
    np.testing.assert_allclose(kl, np.stack(ref, axis=1).reshape(-1), rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(ablate=0), "--ablate"),
        (dict(ablate=32, min_context=32), "--min-context"),
        (dict(n_tokens=256), "--tokens"),
        (dict(samples=2), "--samples"),
        (dict(n_tokens=300, samples=100), "--samples"),
        (dict(texts=["no-such-essay.txt"]), "unknown essay"),
        (dict(essays=0), "--essays"),
    ],
)
def test_bad_input_raises(kwargs, match):
    args = dict(n_tokens=1024, samples=128, ablate=32, min_context=256) | kwargs
    with pytest.raises(ValueError, match=match):
        check_confidence_kl_args(**args)


def test_short_essays_are_rejected_or_skipped(tiny_loaded):
    with pytest.raises(ValueError, match="has only"):
        run_confidence_kl(tiny_loaded, texts=["avg.txt"], n_tokens=10**7, samples=4, progress=False)
    with pytest.raises(ValueError, match="essays have"):
        held_out_essays(tiny_loaded, 3, 10**7)


def test_cli_rejects_bad_input_before_loading(capsys):
    assert main(["confidence-kl", "--ablate", "0", "--model", "/nonexistent"]) == 2
    assert "--ablate" in capsys.readouterr().err
    assert main(["confidence-kl", "--texts", "nope.txt", "--model", "/nonexistent"]) == 2
    assert "unknown essay" in capsys.readouterr().err


@pytest.mark.slow
def test_smollm2_ablation_is_exact(smollm):
    """The real model: an ablated distribution equals the dense reference."""
    from kvjax.eval import essay_tokens

    ids = essay_tokens(smollm, 200, "vw.txt")[None]
    t, r = 199, 32
    *_, (_, full, ablated) = iter_ablation_logits(
        smollm.config, smollm.params, ids, [150, t], ablate=r
    )
    keep = np.r_[np.arange(t - r), t]
    spec = CacheSpec(
        batch=1,
        num_kv_heads=smollm.config.num_kv_heads,
        head_dim=smollm.config.head_dim,
        capacities=(1,) * smollm.config.num_layers,
    )
    out = _jit_forward(
        smollm.config,
        smollm.params,
        jnp.asarray(ids[:, keep]),
        jnp.asarray(keep[None], jnp.int32),
        jnp.ones((1, len(keep)), bool),
        init_cache(spec),
    )
    ref = np.asarray(out.logits)[:, -1]
    # Logits of magnitude ~20: 2e-3 as in the transformers goldens (tests/models).
    np.testing.assert_allclose(np.asarray(ablated), ref, atol=2e-3)
    assert kl_divergence(full, ablated)[0] > 0.01
