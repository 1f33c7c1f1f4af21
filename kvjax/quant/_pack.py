"""Bit packing of low-bit codes in a layout a kernel unpacks with one shift and one mask.

With n = 8 // bits codes per byte and D codes per vector, the vector is cut into n contiguous
sub-blocks of D // n codes; byte j holds codes[j + i * (D // n)] of every sub-block i at bit
offset i * bits. So `(packed >> (i * bits)) & (2**bits - 1)` is the whole sub-block
codes[i * D // n : (i + 1) * D // n], with no gather or interleave: a kernel loads D // n bytes and
gets n dense tiles of codes. Example, bits 2 and D 8 (sub-blocks of 2):

    byte 0 = c0 | c2 << 2 | c4 << 4 | c6 << 6
    byte 1 = c1 | c3 << 2 | c5 << 4 | c7 << 6
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.quant._checks import as_codes, check_bits

Array = jax.Array


def codes_per_byte(bits: int) -> int:
    """n = 8 // bits."""
    return 8 // check_bits(bits)


def pack(codes: Array, bits: int) -> Array:
    """Packs uint8 codes of `bits` bits along the last axis (bits 8: the identity).

    Args:
        codes: [..., D] uint8, each < 2**bits (higher bits are masked off, never spilled into a
            neighbour). D must be a multiple of 8 // bits.
        bits: 2, 4 or 8 (static).

    Returns:
        [..., D * bits // 8] uint8.
    """
    codes = as_codes(codes, jnp.uint8, "codes")
    n = codes_per_byte(bits)
    d = codes.shape[-1]
    if d % n:
        raise ValueError(f"D must be a multiple of {n} to pack {bits}-bit codes, got D={d}")
    if n == 1:
        return codes
    mask = (1 << bits) - 1
    blocks = jnp.split(codes & jnp.uint8(mask), n, axis=-1)  # n x [..., D // n]
    packed = blocks[0]
    for i in range(1, n):
        packed = packed | (blocks[i] << jnp.uint8(i * bits))
    return packed


def unpack(packed: Array, bits: int) -> Array:
    """Inverse of `pack`.

    Args:
        packed: [..., P] uint8.
        bits: 2, 4 or 8 (static).

    Returns:
        [..., P * 8 // bits] uint8 codes.
    """
    packed = as_codes(packed, jnp.uint8, "packed")
    n = codes_per_byte(bits)
    if n == 1:
        return packed
    # Every sub-block by one broadcast shift, [..., n, P] -> [..., n·P]: a concatenation of n
    # shifted copies is the same codes, but XLA:CPU compiles it ~8x slower (0.7 s vs 0.09 s for
    # one layer's INT2 keys at SmolLM2 shapes).
    blocks = jnp.broadcast_to(packed[..., None, :], (*packed.shape[:-1], n, packed.shape[-1]))
    # sub-block i's bit offset i·bits, an iota so that it fuses into the shift
    shifts = jax.lax.broadcasted_iota(jnp.uint8, blocks.shape, blocks.ndim - 2) * jnp.uint8(bits)
    codes = (blocks >> shifts) & jnp.uint8((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], n * packed.shape[-1])
