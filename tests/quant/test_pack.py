"""Bit packing: exact round trips and the shift/mask sub-block layout kernels rely on."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvjax.quant import codes_per_byte, pack, unpack

BITS = (2, 4, 8)


def ref_pack(codes, bits):
    """Obvious loops: byte j of a row holds codes[j + i * (D // n)] at bit offset i * bits."""
    n = 8 // bits
    rows = codes.reshape(-1, codes.shape[-1])
    m = rows.shape[-1] // n
    out = np.zeros((rows.shape[0], m), np.int64)
    for r in range(rows.shape[0]):
        for j in range(m):
            for i in range(n):
                out[r, j] |= int(rows[r, j + i * m]) << (i * bits)
    return out.reshape(*codes.shape[:-1], m).astype(np.uint8)


@st.composite
def codes_cases(draw):
    """(codes [..., D] uint8 < 2**bits, bits) with D a multiple of 8 // bits."""
    bits = draw(st.sampled_from(BITS))
    lead = draw(st.sampled_from(((), (2, 3))))  # a small menu: compiled functions get reused
    d = codes_per_byte(bits) * draw(st.sampled_from((1, 3)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return rng.integers(0, 2**bits, (*lead, d)).astype(np.uint8), bits


@functools.partial(jax.jit, static_argnames="bits")
def pack_unpack(codes, bits):
    packed = pack(codes, bits)
    return packed, unpack(packed, bits)


@given(codes_cases())
def test_round_trip_matches_reference(case):
    codes, bits = case
    packed, unpacked = pack_unpack(codes, bits)
    assert packed.dtype == jnp.uint8
    assert packed.shape == codes.shape[:-1] + (codes.shape[-1] * bits // 8,)
    np.testing.assert_array_equal(packed, ref_pack(codes, bits))
    np.testing.assert_array_equal(unpacked, codes)


@given(codes_cases())
def test_shift_and_mask_give_contiguous_sub_blocks(case):
    codes, bits = case
    packed = np.asarray(pack_unpack(codes, bits)[0])
    n, m = 8 // bits, codes.shape[-1] // (8 // bits)
    mask = 2**bits - 1
    for i in range(n):
        np.testing.assert_array_equal(
            (packed >> (i * bits)) & mask, codes[..., i * m : (i + 1) * m]
        )


@pytest.mark.parametrize("bits", (2, 4))
def test_every_byte_is_one_packing(bits):
    # Exhaustive: each of the 256 bytes unpacks to one tuple of n codes and packs back to itself,
    # so every code combination round-trips.
    every_byte = jnp.arange(256, dtype=jnp.uint8)[:, None]  # [256, 1]: D = n codes per row
    codes = unpack(every_byte, bits)
    assert codes.shape == (256, 8 // bits) and int(jnp.max(codes)) == 2**bits - 1
    np.testing.assert_array_equal(pack(codes, bits), every_byte)


def test_golden_layouts():
    codes = jnp.array([0, 1, 2, 3, 3, 2, 1, 0], jnp.uint8)  # c0..c7
    # 2 bits, n = 4, sub-blocks of 2: byte 0 = c0 | c2 << 2 | c4 << 4 | c6 << 6
    #   = 0 | 2 << 2 | 3 << 4 | 1 << 6 = 0 + 8 + 48 + 64 = 120
    # byte 1 = c1 | c3 << 2 | c5 << 4 | c7 << 6 = 1 + 12 + 32 + 0 = 45
    np.testing.assert_array_equal(pack(codes, 2), np.array([120, 45], np.uint8))
    # 4 bits, n = 2, sub-blocks of 4: byte j = c_j | c_{j+4} << 4
    #   = [0 | 3 << 4, 1 | 2 << 4, 2 | 1 << 4, 3 | 0 << 4] = [48, 33, 18, 3]
    np.testing.assert_array_equal(pack(codes, 4), np.array([48, 33, 18, 3], np.uint8))
    # 8 bits: the identity
    np.testing.assert_array_equal(pack(codes, 8), codes)
    np.testing.assert_array_equal(unpack(codes, 8), codes)


def test_high_bits_are_masked_not_spilled():
    # 7 = 0b111 at 2 bits keeps only 0b11; it must not leak into c1's bits
    packed = pack(jnp.array([7, 0, 0, 0], jnp.uint8), 2)
    np.testing.assert_array_equal(packed, np.array([3], np.uint8))


@pytest.mark.parametrize("bits", BITS)
def test_jit_equals_eager(bits):
    codes = jax.random.randint(jax.random.key(bits), (2, 3, 16), 0, 2**bits).astype(jnp.uint8)
    packed = pack(codes, bits)
    np.testing.assert_array_equal(jax.jit(pack, static_argnames="bits")(codes, bits=bits), packed)
    unpacked = jax.jit(unpack, static_argnames="bits")(packed, bits=bits)
    np.testing.assert_array_equal(unpacked, unpack(packed, bits))


def test_bad_inputs():
    with pytest.raises(ValueError, match="D must be a multiple of 4 to pack 2-bit codes, got D=6"):
        pack(jnp.zeros((2, 6), jnp.uint8), 2)
    with pytest.raises(ValueError, match="D=3"):
        jax.jit(pack, static_argnames="bits")(jnp.zeros((3,), jnp.uint8), bits=4)
    with pytest.raises(ValueError, match=r"^bits must be one of \(2, 4, 8\), got 3$"):
        pack(jnp.zeros((8,), jnp.uint8), 3)
    with pytest.raises(ValueError, match="codes must have dtype uint8, got int8"):
        pack(jnp.zeros((8,), jnp.int8), 2)
    with pytest.raises(ValueError, match="packed must have dtype uint8, got int32"):
        unpack(jnp.zeros((8,), jnp.int32), 2)
    with pytest.raises(ValueError, match="bits must be one of"):
        unpack(jnp.zeros((8,), jnp.uint8), 16)
