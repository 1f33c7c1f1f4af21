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

# float32 logits of the tiny random models are O(1); cached vs dense differ only by reduction order.
ATOL = 1e-4


def _dense_logits(config, params, ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Plain forward of [B, S] ids at explicit positions [S] with an empty 1-slot cache."""
    b, s = ids.shape
    spec = CacheSpec(batch=b, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                     capacities=(1,) * config.num_layers)
    out = _jit_forward(config, params, jnp.asarray(ids, jnp.int32),
                       jnp.asarray(np.broadcast_to(positions, (b, s)), jnp.int32),
                       jnp.ones((b, s), bool), init_cache(spec))
    return np.asarray(out.logits)


_jit_forward = jax.jit(forward, static_argnums=0)  # eager op-by-op dispatch is slower than this


def _tokens(config, b: int, n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, config.vocab_size, (b, n)).astype(np.int32)


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_gpt2"])
@pytest.mark.parametrize("ablate", [1, 5])
def test_ablated_logits_match_dense_reference(request, model, ablate):
    """x_t at position t over [0, t-R) ∪ {t} equals a dense pass of [x_0..x_{t-R-1}, x_t]."""
    config, params = request.getfixturevalue(model)
    tokens = _tokens(config, 2, 48)
    positions = [12, 13, 20, 29, 47]  # a wide first segment, then gaps of 1, 7 and 18 (padding)
    dense = _dense_logits(config, params, tokens, np.arange(48))  # causal: row t sees x_0..x_t
    for t, full, ablated in iter_ablation_logits(config, params, tokens, positions,
                                                 ablate=ablate):
        keep = np.r_[np.arange(t - ablate), t]
        ref_ablated = _dense_logits(config, params, tokens[:, keep], keep)[:, -1]
        ref_full = dense[:, t]
        np.testing.assert_allclose(np.asarray(ablated), ref_ablated, atol=ATOL, err_msg=str(t))
        np.testing.assert_allclose(np.asarray(full), ref_full, atol=ATOL, err_msg=str(t))
        assert np.abs(ref_ablated - ref_full).max() > 10 * ATOL  # the ablation changes something


def test_no_ablation_gives_the_full_distribution(tiny_llama):
    """R = 0 hides nothing: the ablated pass reproduces the full one and KL is 0."""
    config, params = tiny_llama
    tokens = _tokens(config, 2, 40, seed=1)
    for _, full, ablated in iter_ablation_logits(config, params, tokens, [8, 20, 39], ablate=0):
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
    res = run_confidence_kl(tiny_loaded, essays=2, n_tokens=96, samples=8, ablate=8,
                            min_context=32, resamples=200, progress=False)
    assert len(res.texts) == 2 and res.n == 16 == len(res.kl) == len(res.values["c"])
    kl, c = np.asarray(res.kl), np.asarray(res.values["c"])
    assert np.all(kl >= -1e-6) and res.mean_kl == pytest.approx(kl.mean())
    assert res.pearson["c"] == pytest.approx(np.corrcoef(c, kl)[0, 1], abs=1e-9)
    assert res.pearson_ci["c"][0] <= res.pearson["c"] <= res.pearson_ci["c"][1]
    v = res.values
    np.testing.assert_allclose(c, 0.4 * np.asarray(v["one_minus_entropy"])
                               + 0.3 * np.asarray(v["sigmoid_margin"])
                               + 0.3 * np.asarray(v["top1"]), atol=1e-6)
    # The pooled KL agrees with the float64 reference on the logits of the first essay.
    tokens = np.asarray([_CharTokenizer().encode(essay_text(res.texts[0]))[:96]], np.int32)
    ref = [kl_divergence(f, a)[0] for _, f, a in iter_ablation_logits(
        tiny_loaded.config, tiny_loaded.params, tokens, res.positions[:8], ablate=8)]
    np.testing.assert_allclose(kl[:8], ref, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("kwargs,match", [
    (dict(ablate=0), "--ablate"),
    (dict(ablate=32, min_context=32), "--min-context"),
    (dict(n_tokens=256), "--tokens"),
    (dict(samples=2), "--samples"),
    (dict(n_tokens=300, samples=100), "--samples"),
    (dict(texts=["no-such-essay.txt"]), "unknown essay"),
    (dict(essays=0), "--essays"),
])
def test_bad_input_raises(kwargs, match):
    args = dict(n_tokens=1024, samples=128, ablate=32, min_context=256) | kwargs
    with pytest.raises(ValueError, match=match):
        check_confidence_kl_args(**args)


def test_short_essays_are_rejected_or_skipped(tiny_loaded):
    with pytest.raises(ValueError, match="has only"):
        run_confidence_kl(tiny_loaded, texts=["avg.txt"], n_tokens=10**7, samples=4,
                          progress=False)
    with pytest.raises(ValueError, match="essays have"):
        held_out_essays(tiny_loaded, 3, 10**7)


def test_cli_rejects_bad_input_before_loading(capsys):
    assert main(["confidence-kl", "--ablate", "0", "--model", "/nonexistent"]) == 2
    assert "--ablate" in capsys.readouterr().err
    assert main(["confidence-kl", "--texts", "nope.txt", "--model", "/nonexistent"]) == 2
    assert "unknown essay" in capsys.readouterr().err
