"""CONF-KV's confidence statistics against a float64 reference (chunked reductions, no sort)."""

import hypothesis.extra.numpy as hnp
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.policies import confidence
from kvjax.policies._confidence import MAX_CHUNK, chunk_width


def reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(entropy / log V, top-2 log-probability margin, top-1 probability) in float64."""
    x = x.astype(np.float64)
    top = x.max(axis=-1, keepdims=True)
    logp = x - (top + np.log(np.exp(x - top).sum(axis=-1, keepdims=True)))
    p = np.exp(logp)
    entropy = -np.where(p > 0, p * np.where(p > 0, logp, 0.0), 0.0).sum(axis=-1)
    two = np.sort(logp, axis=-1)[:, ::-1][:, :2]
    return entropy / np.log(x.shape[-1]), two[:, 0] - two[:, 1], np.exp(two[:, 0])


def check(x: np.ndarray) -> None:
    got = confidence(jnp.asarray(x))
    want = reference(np.asarray(jnp.asarray(x).astype(jnp.float32)))
    fields = (got.entropy_norm, got.margin, got.top1)
    for name, g, w in zip(("entropy_norm", "margin", "top1"), fields, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), w, rtol=2e-5, atol=2e-6, err_msg=name)


@settings(max_examples=40, deadline=None)
@given(
    x=st.integers(1, 3).flatmap(
        lambda b: st.sampled_from([2, 3, 7, 64, 1000, 2053, 4096, 6000]).flatmap(
            lambda v: hnp.arrays(np.float32, (b, v), elements=st.floats(-30, 30, width=32))
        )
    )
)
def test_matches_float64_reference(x):
    check(x)


def test_chunked_vocabularies_match():
    """Llama-3's, SmolLM2's and GPT-2's vocabularies (chunked 2004, 2048, 1733 wide), with a
    tied top (margin 0), masked entries (-inf) and bfloat16 logits."""
    rng = np.random.default_rng(0)
    for v in (128256, 49152, 50257):
        assert 1 < chunk_width(v) <= MAX_CHUNK and v % chunk_width(v) == 0
        x = (rng.standard_normal((3, v)) * 4).astype(np.float32)
        x[0, [11, v - 1]] = 25.0  # two equal maxima in different chunks
        x[1, : v // 3] = -np.inf  # a masked part of the vocabulary
        check(x)
        check(np.asarray(jnp.asarray(x).astype(jnp.bfloat16)))
    tie = confidence(jnp.asarray(np.where(np.arange(5000) % 2500 == 7, 9.0, 0.0)[None]))
    assert float(tie.margin[0]) == 0.0


@pytest.mark.parametrize("v, peak", [(1000, 10.394642), (4096, 13.132131), (6000, 13.7974615)])
def test_one_peak_over_many_small_terms(v, peak):
    """One large logit over v − 1 zeros: the softmax sum is 1 plus many terms near e^−peak.
    Summed one term at a time in float32 (an XLA:CPU variadic reduction is such a loop) the
    entropy came out 3–7e-5 (relative) off the float64 reference on exactly these rows."""
    x = np.zeros((2, v), np.float32)
    x[0, 3] = peak
    x[1, v - 1] = peak
    check(x)


def test_prime_vocabulary_is_one_reduction():
    assert chunk_width(4099) == 1  # no divisor up to MAX_CHUNK but 1: the row as one chunk
    check(np.random.default_rng(1).standard_normal((2, 4099)).astype(np.float32))


@pytest.mark.parametrize(
    "shape, match", [((5,), r"\[B, V\]"), ((2, 3, 4), r"\[B, V\]"), ((2, 1), "at least 2")]
)
def test_bad_shapes_raise(shape, match):
    with pytest.raises(ValueError, match=match):
        confidence(jnp.zeros(shape))
