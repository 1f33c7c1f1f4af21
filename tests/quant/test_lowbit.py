"""Low-bit asymmetric quantization (keys per channel, values per token) against float64 numpy."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from quant_inputs import inputs

from kvjax.quant import (
    STAT_DTYPE,
    bytes_per_token,
    dequantize_per_channel,
    dequantize_per_token,
    pack,
    quantize_keys_values,
    quantize_per_channel,
    quantize_per_token,
)

BITS = (2, 4, 8)


U = 2.0**-7  # bfloat16 spacing relative to its value (8 significant bits)
F32 = 2.0**-22  # slack for the float32 arithmetic of max - zero and the division


def ref_asymmetric(x, bits, axis, scale, zero):
    """float64 checks of the stored bfloat16 statistics, and float64 reference codes from them.

    zero is min rounded down to a bfloat16 (0 <= min - zero <= U·|min|) and scale is
    (max - zero) / levels rounded up (within a factor 1 + U). Returns the reference codes, the
    unrounded quotient and the derived bound (1 + U)·(max - min + U·|min|) / levels on the step.
    """
    levels = 2**bits - 1
    scale = np.expand_dims(np.asarray(scale, np.float64), axis)
    zero = np.expand_dims(np.asarray(zero, np.float64), axis)
    lo = np.min(x, axis=axis, keepdims=True)
    hi = np.max(x, axis=axis, keepdims=True)
    assert np.all(zero <= lo) and np.all(lo - zero <= U * np.abs(lo))
    exact = (hi - zero) / levels
    assert np.all(scale >= exact * (1 - F32)) and np.all(scale <= exact * (1 + U) * (1 + F32))
    bound = (1 + U) * (hi - lo + U * np.abs(lo)) / levels * (1 + F32)
    q = (x - zero) / np.where(scale > 0, scale, 1.0)
    return np.clip(np.round(q), 0, levels), q, bound


def assert_codes_match(codes, ref_codes, q):
    """Equal to the reference except at near-ties of the quotient (off by one at most there)."""
    codes = np.asarray(codes, np.float64)
    assert np.all(np.abs(codes - ref_codes) <= 1)
    clear = np.abs(q - np.floor(q) - 0.5) > 1e-3
    np.testing.assert_array_equal(codes[clear], ref_codes[clear])


def assert_round_trip(x64, deq, scale, zero, bound, kind):
    """|x - deq(q(x))| <= scale / 2 <= bound / 2 up to float32 rounding (relative to the group's
    own statistics, so an outlier elsewhere never loosens it); a constant input comes back exactly
    when it is a bfloat16 (its zero is then exact and its scale 0)."""
    deq = np.asarray(deq, np.float64)
    slack = 1e-6 * (np.abs(x64) + np.abs(zero))
    assert np.all(np.abs(x64 - deq) <= scale * (0.5 + 1e-4) + slack)
    assert np.all(np.abs(x64 - deq) <= bound * (0.5 + 1e-4) + slack)
    is_bf16 = np.all(x64 == np.asarray(jnp.asarray(x64, jnp.bfloat16), np.float64))
    if kind in ("constant", "zeros") and is_bf16:
        np.testing.assert_array_equal(deq, x64)


# One compile per example for both groupings (not one per primitive) keeps hypothesis fast.
@functools.partial(jax.jit, static_argnames=("bits", "group"))
def round_trips(x, bits, group):
    k = quantize_per_channel(x, bits)
    v = quantize_per_token(x, bits, group)
    return (*k, dequantize_per_channel(*k)), (*v, dequantize_per_token(*v))


@given(inputs(), st.sampled_from(BITS), st.sampled_from((None, 1, 4)))
def test_matches_reference_and_bound(case, bits, group):
    x, kind = case
    d = x.shape[-1]
    group = group if group is None or d % group == 0 else None
    (codes, scale, zero, deq), (codes_v, scale_v, zero_v, deq_v) = round_trips(x, bits, group)
    x64 = np.asarray(x.astype(jnp.float32), np.float64)

    # keys, per channel: statistics over T
    assert codes.dtype == jnp.uint8 and codes.shape == x.shape
    stat_shape = x.shape[:-2] + x.shape[-1:]
    assert scale.dtype == zero.dtype == STAT_DTYPE == jnp.bfloat16
    assert scale.shape == zero.shape == stat_shape
    ref_codes, q, bound = ref_asymmetric(x64, bits, -2, scale, zero)
    assert_codes_match(codes, ref_codes, q)
    stat = lambda a: np.asarray(a, np.float64)[..., None, :]
    assert_round_trip(x64, deq, stat(scale), stat(zero), bound, kind)

    # values, per token: statistics over channel groups of size g
    g = d if group is None else group
    grouped = x64.reshape(*x.shape[:-1], d // g, g)
    assert codes_v.dtype == jnp.uint8 and codes_v.shape == x.shape
    assert scale_v.dtype == zero_v.dtype == jnp.bfloat16
    assert scale_v.shape == zero_v.shape == x.shape[:-1] + (d // g,)
    ref_codes, q, bound = ref_asymmetric(grouped, bits, -1, scale_v, zero_v)
    assert_codes_match(codes_v, ref_codes.reshape(x.shape), q.reshape(x.shape))
    groups = lambda a: np.asarray(a, np.float64).reshape(x.shape[:-1] + (-1,))
    per_channel = lambda a: np.repeat(groups(a), g, -1)
    assert_round_trip(
        x64, deq_v, per_channel(scale_v), per_channel(zero_v), per_channel(bound), kind
    )


@functools.partial(jax.jit, static_argnames=("bits", "group"))
def keys_values_apart_and_at_once(k, v, bits, group):
    apart = quantize_per_channel(k, bits), quantize_per_token(v, bits, group)
    return apart, quantize_keys_values(k, v, bits, group)


@given(inputs(), st.sampled_from(BITS), st.sampled_from((None, 1, 4)))
def test_keys_values_at_once_equal_apart(case, bits, group):
    # The same codes and statistics, bit for bit, under jit (how the cache's tier writes).
    x, _ = case
    group = group if group is None or x.shape[-1] % group == 0 else None
    apart, at_once = keys_values_apart_and_at_once(x, -jnp.flip(x, -1), bits, group)
    for a, b in zip(jax.tree.leaves(apart), jax.tree.leaves(at_once), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)


def test_statistics_round_outward_golden():
    # 1 + 2**-10 is not a bfloat16 (8 significant bits): a minimum of -(1 + 2**-10) rounds down to
    # -(1 + 2**-7); the maximum 2 then needs a step (2 + 1 + 2**-7) / 3 = 1.0026..., rounded up to
    # the next bfloat16 1 + 2**-7 = 1.0078125, and every input stays on the grid.
    x = jnp.array([[-(1 + 2**-10)], [2.0]])  # [T=2, D=1]
    codes, scale, zero = quantize_per_channel(x, 2)
    np.testing.assert_array_equal(zero.astype(jnp.float32), [-(1 + 2**-7)])
    np.testing.assert_array_equal(scale.astype(jnp.float32), [1 + 2**-7])
    # (x - zero) / scale = [(2**-7 - 2**-10) / 1.0078125, 3.0078125 / 1.0078125]
    #   = [0.0068, 2.9845] -> codes [0, 3]; dequantized [zero, 3 * scale + zero]
    np.testing.assert_array_equal(codes, np.array([[0], [3]], np.uint8))
    deq = np.asarray(dequantize_per_channel(codes, scale, zero), np.float64)
    np.testing.assert_array_equal(deq[:, 0], [-(1 + 2**-7), 2 + 2**-6])


def test_golden_keys_per_channel_2bit():
    x = jnp.array([[0.0, -6.0], [1.0, -1.0], [3.0, 6.0]])  # [T=3, D=2]
    codes, scale, zero = quantize_per_channel(x, 2)
    # levels = 2**2 - 1 = 3
    # channel 0: [0, 1, 3] -> zero 0, scale (3 - 0) / 3 = 1, codes [0, 1, 3]
    # channel 1: [-6, -1, 6] -> zero -6, scale (6 + 6) / 3 = 4, (x + 6) / 4 = [0, 1.25, 3]
    np.testing.assert_array_equal(scale, [1.0, 4.0])
    np.testing.assert_array_equal(zero, [0.0, -6.0])
    np.testing.assert_array_equal(codes, np.array([[0, 0], [1, 1], [3, 3]], np.uint8))
    # channel 1 middle token: 1 * 4 - 6 = -2, off by 1 <= scale / 2 = 2
    deq = dequantize_per_channel(codes, scale, zero)
    np.testing.assert_array_equal(deq, [[0.0, -6.0], [1.0, -2.0], [3.0, 6.0]])


def test_golden_values_per_token_2bit_and_packed():
    x = jnp.array([0.0, 1.0, 2.0, 3.0])
    codes, scale, zero = quantize_per_token(x, 2)
    # one group of all 4 channels: zero 0, scale (3 - 0) / 3 = 1, codes [0, 1, 2, 3]
    np.testing.assert_array_equal(scale, [1.0])
    np.testing.assert_array_equal(zero, [0.0])
    np.testing.assert_array_equal(codes, np.array([0, 1, 2, 3], np.uint8))
    # 4 codes per byte, sub-blocks of D/4 = 1: byte 0 = c0 | c1 << 2 | c2 << 4 | c3 << 6
    #   = 0 + 4 + 32 + 192 = 228 = 0b11_10_01_00
    np.testing.assert_array_equal(pack(codes, 2), np.array([228], np.uint8))


def test_golden_values_grouped_4bit():
    x = jnp.array([[-1.0, 0.0, 2.0, 14.0, 5.0, 5.0, 5.0, 5.0]])  # one token, D=8, group 4
    codes, scale, zero = quantize_per_token(x, 4, group=4)
    # levels 15; group 0: zero -1, scale 15 / 15 = 1, codes [0, 1, 3, 15]
    # group 1 is constant: zero 5, scale 0, codes 0, and it dequantizes to exactly 5
    np.testing.assert_array_equal(scale, [[1.0, 0.0]])
    np.testing.assert_array_equal(zero, [[-1.0, 5.0]])
    np.testing.assert_array_equal(codes, np.array([[0, 1, 3, 15, 0, 0, 0, 0]], np.uint8))
    np.testing.assert_array_equal(dequantize_per_token(codes, scale, zero), x)


@pytest.mark.parametrize("bits", BITS)
def test_jit_equals_eager_and_output_dtype(bits):
    x = jax.random.normal(jax.random.key(bits), (2, 4, 8), jnp.bfloat16)
    cases = (
        (functools.partial(quantize_per_channel, bits=bits), dequantize_per_channel),
        (functools.partial(quantize_per_token, bits=bits, group=4), dequantize_per_token),
    )
    for quantize, dequantize in cases:
        eager = quantize(x)
        for a, b in zip(eager, jax.jit(quantize)(x), strict=True):
            np.testing.assert_array_equal(a, b)
        # Under jit XLA contracts codes * scale + zero into one FMA (eager rounds twice), so the
        # dequantized values may differ in the last bit.
        deq = dequantize(*eager)
        atol = 2.0**-22 * float(jnp.max(jnp.abs(deq)))
        np.testing.assert_allclose(jax.jit(dequantize)(*eager), deq, rtol=0, atol=atol)
        deq_bf16 = dequantize(*eager, dtype=jnp.bfloat16)
        assert deq_bf16.dtype == jnp.bfloat16
        np.testing.assert_array_equal(deq_bf16, deq.astype(jnp.bfloat16))


def test_bad_inputs():
    x = jnp.ones((2, 4))
    with pytest.raises(ValueError, match=r"^bits must be one of \(2, 4, 8\), got 3$"):
        quantize_per_token(x, 3)
    with pytest.raises(ValueError, match=r"bits must be one of \(2, 4, 8\), got 1"):
        jax.jit(quantize_per_channel, static_argnames="bits")(x, bits=1)
    with pytest.raises(ValueError, match="int32"):
        quantize_per_channel(jnp.ones((2, 4), jnp.int32), 2)
    with pytest.raises(ValueError, match="uint8"):
        quantize_per_token(jnp.ones((4,), jnp.uint8), 4)
    with pytest.raises(ValueError, match="group must be > 0 and divide D=4, got group=3"):
        quantize_per_token(x, 2, group=3)
    with pytest.raises(ValueError, match="k and v must be"):
        quantize_keys_values(x, jnp.ones((2, 8)), 2)
    codes, scale, zero = jnp.zeros((2, 4), jnp.uint8), jnp.ones((2, 2)), jnp.zeros((2, 2))
    with pytest.raises(ValueError, match="codes must have dtype uint8, got int8"):
        dequantize_per_token(codes.astype(jnp.int8), scale, zero)
    with pytest.raises(ValueError, match="zero must have shape"):
        dequantize_per_token(codes, scale, zero[:1])
    with pytest.raises(ValueError, match="scale's last axis must divide D=4"):
        dequantize_per_token(codes, jnp.ones((2, 3)), jnp.ones((2, 3)))
    with pytest.raises(ValueError, match="scale must be a floating array"):
        dequantize_per_channel(codes, jnp.ones((4,), jnp.int32), jnp.zeros((4,)))


def test_bytes_per_token_golden():
    # D 64, 2 bits, key group 32, value group 32, bfloat16 statistics (the default):
    #   codes 2 * 64 * 2 / 8 = 32; keys 2 * 2 * 64 / 32 = 8; values 2 * 2 * (64 / 32) = 8
    assert bytes_per_token(64, 2, key_group=32, value_group=32) == 48.0
    # float32 statistics double the statistics: 32 + 16 + 16
    assert bytes_per_token(64, 2, key_group=32, value_group=32, scale_bytes=4) == 64.0
    # value_group None: one value group -> 2 * 2 * 1 = 4; 4 bits: codes 64
    assert bytes_per_token(64, 4, key_group=32, value_group=None) == 64 + 8 + 4
    # amortized key statistics need not be whole bytes: 2 * 2 * 8 / 3
    assert bytes_per_token(8, 2, key_group=3, value_group=None, scale_bytes=2) == pytest.approx(
        4 + 32 / 3 + 4
    )
    with pytest.raises(ValueError, match="bits must be one of"):
        bytes_per_token(64, 3, key_group=32, value_group=32)
    with pytest.raises(ValueError, match="head_dim"):
        bytes_per_token(6, 2, key_group=32, value_group=None)
    with pytest.raises(ValueError, match="value_group"):
        bytes_per_token(64, 2, key_group=32, value_group=48)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("value_group", (None, 16))
def test_bytes_per_token_matches_stored_arrays(bits, value_group):
    """The formula equals the bytes of what the quantizers and pack actually return."""
    key_group, d = 8, 32

    def store(x):  # one key group of tokens, as a tier would hold it
        k_codes, k_scale, k_zero = quantize_per_channel(x, bits)
        v_codes, v_scale, v_zero = quantize_per_token(x, bits, value_group)
        return pack(k_codes, bits), k_scale, k_zero, pack(v_codes, bits), v_scale, v_zero

    stored = jax.eval_shape(store, jax.ShapeDtypeStruct((key_group, d), jnp.bfloat16))
    total = sum(a.size * a.dtype.itemsize for a in stored)
    assert (
        bytes_per_token(d, bits, key_group=key_group, value_group=value_group) == total / key_group
    )
