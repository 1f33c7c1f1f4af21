"""1-byte cache arrays as wider integer words, for Pallas' Triton lowering.

That lowering (JAX 0.11.2) switches to 64-bit element offsets only for arrays over 2^32 bytes,
so a 1-byte array of 2^31 to 2^32 bytes is indexed with overflowing signed 32-bit offsets (a
layer stack of INT8 codes: 32 layers, B = 8, 8 heads, 12.6K slots, D = 128 is 3.3 GB). The
same bytes seen as n-byte words have n times fewer elements, so their offsets fit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

# A 1-byte array of this many elements or more overflows the lowering's 32-bit offsets.
BYTE_OFFSETS = 2**31
_WORD = {2: jnp.int16, 4: jnp.int32}


def as_words(a: Array, n: int) -> Array:
    """A 1-byte array [..., D] as [..., D/n] integers of n bytes (a bitcast, no copy): byte j
    of word c is element n·c + j (little-endian)."""
    return jax.lax.bitcast_convert_type(a.reshape(*a.shape[:-1], a.shape[-1] // n, n), _WORD[n])


def from_words(x: Array, like: Array) -> Array:
    """`as_words`' result back to the 1-byte dtype and shape of `like`."""
    return jax.lax.bitcast_convert_type(x, like.dtype).reshape(like.shape)
