"""INT8 symmetric quantization against float64 numpy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from quant_inputs import inputs

from kvjax.quant import (
    dequantize_int8,
    dequantize_int8_channel,
    int8_bytes_per_token,
    quantize_int8,
    quantize_int8_channel,
)


def ref_int8(x, axis):
    """float64 reference: codes, scale (axis kept) and the unrounded quotient."""
    scale = np.max(np.abs(x), axis=axis, keepdims=True) / 127
    q = x / np.where(scale > 0, scale, 1.0)
    return np.clip(np.round(q), -127, 127), scale, q


# One compile per example for both groupings (not one per primitive) keeps hypothesis fast.
@jax.jit
def round_trips(x):
    codes, scale = quantize_int8(x)
    codes_c, scale_c = quantize_int8_channel(x)
    deq, deq_c = dequantize_int8(codes, scale), dequantize_int8_channel(codes_c, scale_c)
    return (codes, scale, deq), (codes_c, scale_c, deq_c)


def assert_codes_match(codes, ref_codes, q):
    """Equal to the reference except at near-ties of the quotient, where float32 may round the
    other way (off by one at most)."""
    codes = np.asarray(codes, np.float64)
    assert np.all(np.abs(codes - ref_codes) <= 1)
    clear = np.abs(q - np.floor(q) - 0.5) > 1e-3
    np.testing.assert_array_equal(codes[clear], ref_codes[clear])


def assert_round_trip(x64, deq, scale):
    """|x - deq(q(x))| <= scale / 2, up to float32 rounding (relative to the group's own scale
    and magnitude, so an outlier elsewhere never loosens it)."""
    tol = scale * (0.5 + 1e-4) + 1e-6 * np.abs(x64)
    assert np.all(np.abs(x64 - np.asarray(deq, np.float64)) <= tol)


@given(inputs())
def test_matches_reference_and_bound(case):
    x, kind = case
    (codes, scale, deq), (codes_c, scale_c, deq_c) = round_trips(x)
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    # per token: scale over D
    ref_codes, ref_scale, q = ref_int8(x64, axis=-1)
    assert codes.dtype == jnp.int8 and codes.shape == x.shape
    assert scale.dtype == jnp.float32 and scale.shape == x.shape[:-1]
    np.testing.assert_allclose(scale, ref_scale[..., 0], rtol=1e-6)
    assert_codes_match(codes, ref_codes, q)
    assert_round_trip(x64, deq, ref_scale)
    # per channel: scale over T
    ref_codes, ref_scale, q = ref_int8(x64, axis=-2)
    assert codes_c.dtype == jnp.int8 and codes_c.shape == x.shape
    assert scale_c.dtype == jnp.float32 and scale_c.shape == x.shape[:-2] + x.shape[-1:]
    np.testing.assert_allclose(scale_c, ref_scale[..., 0, :], rtol=1e-6)
    assert_codes_match(codes_c, ref_codes, q)
    assert_round_trip(x64, deq_c, ref_scale)
    if kind == "zeros":
        assert not np.any(scale) and not np.any(scale_c)
        assert not np.any(deq) and not np.any(deq_c)


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


def test_jit_equals_eager_and_output_dtype():
    x = jax.random.normal(jax.random.key(0), (2, 4, 8), jnp.bfloat16)
    for quantize, dequantize in (
        (quantize_int8, dequantize_int8),
        (quantize_int8_channel, dequantize_int8_channel),
    ):
        eager = quantize(x)
        for a, b in zip(eager, jax.jit(quantize)(x), strict=True):
            np.testing.assert_array_equal(a, b)
        deq = dequantize(*eager, dtype=jnp.float16)
        assert deq.dtype == jnp.float16
        np.testing.assert_array_equal(deq, dequantize(*eager).astype(jnp.float16))
        np.testing.assert_array_equal(
            jax.jit(dequantize, static_argnames="dtype")(*eager, dtype=jnp.float16), deq
        )


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
