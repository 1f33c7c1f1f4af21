"""INT8 symmetric quantization against float64 numpy references."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvjax.quant import (
    dequantize_int8,
    dequantize_int8_channel,
    int8_bytes_per_token,
    quantize_int8,
    quantize_int8_channel,
)

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
KINDS = ("normal", "constant", "zeros", "outlier")


@st.composite
def inputs(draw, *, min_lead=0):
    """(x [..., D] in a float dtype, kind): shapes, magnitudes 1e-3..1e3, adversarial kinds."""
    lead = draw(st.lists(st.integers(1, 3), min_size=min_lead, max_size=min_lead + 2))
    shape = (*lead, draw(st.integers(1, 9)))
    dtype = draw(st.sampled_from(DTYPES))
    kind = draw(st.sampled_from(KINDS))
    mag = 10.0 ** draw(st.floats(-3, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = mag * rng.standard_normal(shape)
    if kind == "constant":
        x = np.full(shape, mag * rng.standard_normal())
    elif kind == "zeros":
        x = np.zeros(shape)
    elif kind == "outlier":
        x.flat[rng.integers(x.size)] = min(1e4 * mag, float(jnp.finfo(dtype).max) / 4)
    return jnp.asarray(x, dtype), kind


def ref_int8(x, axis):
    """float64 reference: codes, scale (axis kept) and the unrounded quotient."""
    scale = np.max(np.abs(x), axis=axis, keepdims=True) / 127
    q = x / np.where(scale > 0, scale, 1.0)
    return np.clip(np.round(q), -127, 127), scale, q


# One compile per (shape, dtype) instead of one per primitive keeps hypothesis fast.
@jax.jit
def round_trip(x):
    codes, scale = quantize_int8(x)
    return codes, scale, dequantize_int8(codes, scale)


@jax.jit
def round_trip_channel(x):
    codes, scale = quantize_int8_channel(x)
    return codes, scale, dequantize_int8_channel(codes, scale)


def assert_codes_match(codes, ref_codes, q):
    """Equal to the reference except at near-ties of the quotient, where float32 may round the
    other way (off by one at most)."""
    codes = np.asarray(codes, np.float64)
    assert np.all(np.abs(codes - ref_codes) <= 1)
    clear = np.abs(q - np.floor(q) - 0.5) > 1e-3
    np.testing.assert_array_equal(codes[clear], ref_codes[clear])


def assert_round_trip(x64, deq, scale):
    """|x - deq(q(x))| <= scale / 2, up to float32 rounding."""
    tol = scale * (0.5 + 1e-4) + 1e-6 * np.max(np.abs(x64))
    assert np.all(np.abs(x64 - np.asarray(deq, np.float64)) <= tol)


@given(inputs())
def test_per_token_matches_reference_and_bound(case):
    x, kind = case
    codes, scale, deq = round_trip(x)
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    ref_codes, ref_scale, q = ref_int8(x64, axis=-1)
    assert codes.dtype == jnp.int8 and codes.shape == x.shape
    assert scale.dtype == jnp.float32 and scale.shape == x.shape[:-1]
    np.testing.assert_allclose(scale, ref_scale[..., 0], rtol=1e-6)
    assert_codes_match(codes, ref_codes, q)
    assert_round_trip(x64, deq, np.asarray(scale, np.float64)[..., None])
    if kind == "zeros":
        assert np.all(np.asarray(scale) == 0) and np.all(np.asarray(deq) == 0)


@given(inputs(min_lead=1))
def test_per_channel_matches_reference_and_bound(case):
    x, kind = case
    codes, scale, deq = round_trip_channel(x)
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    ref_codes, ref_scale, q = ref_int8(x64, axis=-2)
    assert codes.dtype == jnp.int8 and codes.shape == x.shape
    assert scale.shape == x.shape[:-2] + x.shape[-1:]
    np.testing.assert_allclose(scale, ref_scale[..., 0, :], rtol=1e-6)
    assert_codes_match(codes, ref_codes, q)
    assert_round_trip(x64, deq, np.asarray(scale, np.float64)[..., None, :])
    if kind == "zeros":
        assert np.all(np.asarray(deq) == 0)


def test_golden_per_token():
    x = jnp.array([254.0, -127.0, 1.0, 0.0])
    codes, scale = quantize_int8(x)
    # scale = max|x| / 127 = 254 / 127 = 2
    # x / 2 = [127, -63.5, 0.5, 0]; round half to even: -63.5 -> -64, 0.5 -> 0
    assert float(scale) == 2.0
    np.testing.assert_array_equal(codes, np.array([127, -64, 0, 0], np.int8))
    # codes * 2 = [254, -128, 0, 0]: errors [0, 1, 1, 0] = scale / 2 at the ties
    np.testing.assert_array_equal(dequantize_int8(codes, scale), [254.0, -128.0, 0.0, 0.0])


def test_golden_per_channel():
    x = jnp.array([[1.0, -4.0], [-127.0, 2.0]])  # [T=2, D=2]
    codes, scale = quantize_int8_channel(x)
    # channel 0: max|x| = 127 -> scale 1, codes [1, -127]
    # channel 1: max|x| = 4 -> scale 4/127; -4 -> -127, 2 -> 63.5 -> 64 (ties to even)
    np.testing.assert_allclose(scale, [1.0, 4.0 / 127], rtol=1e-7)
    np.testing.assert_array_equal(codes, np.array([[1, -127], [-127, 64]], np.int8))


def test_never_uses_minus_128():
    codes, _ = quantize_int8(jnp.array([-1.0, 1.0, -1.0000001]))
    assert int(jnp.min(codes)) == -127


def test_dequantize_dtype():
    x = jnp.linspace(-3.0, 5.0, 24).reshape(2, 3, 4)
    codes, scale = quantize_int8(x)
    out = dequantize_int8(codes, scale, jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(out, dequantize_int8(codes, scale).astype(jnp.bfloat16))


def test_jit_equals_eager():
    x = jax.random.normal(jax.random.key(0), (2, 3, 5, 8), jnp.bfloat16)
    for quantize, dequantize in (
        (quantize_int8, dequantize_int8),
        (quantize_int8_channel, dequantize_int8_channel),
    ):
        eager = quantize(x)
        jitted = jax.jit(quantize)(x)
        for a, b in zip(eager, jitted, strict=True):
            np.testing.assert_array_equal(a, b)
        deq = jax.jit(functools.partial(dequantize, dtype=jnp.float16))(*eager)
        np.testing.assert_array_equal(deq, dequantize(*eager, dtype=jnp.float16))


def test_bad_inputs():
    with pytest.raises(ValueError, match="int32"):
        quantize_int8(jnp.ones((4,), jnp.int32))
    with pytest.raises(ValueError, match="int32"):
        jax.jit(quantize_int8_channel)(jnp.ones((2, 4), jnp.int32))
    with pytest.raises(ValueError, match="codes must have dtype int8, got uint8"):
        dequantize_int8(jnp.ones((4,), jnp.uint8), jnp.ones(()))
    with pytest.raises(ValueError, match="scale must have shape"):
        dequantize_int8(jnp.ones((2, 4), jnp.int8), jnp.ones((4,)))
    with pytest.raises(ValueError, match="T >= 1"):
        quantize_int8_channel(jnp.ones((4,)))
    with pytest.raises(ValueError, match="floating dtype"):
        dequantize_int8(jnp.ones((4,), jnp.int8), jnp.ones(()), jnp.int32)


def test_int8_bytes_per_token():
    # K and V: 64 int8 codes each + one float32 scale each = 128 + 8
    assert int8_bytes_per_token(64) == 136
    assert int8_bytes_per_token(64, scale_bytes=2) == 132
