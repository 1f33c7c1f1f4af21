"""Small helpers shared by the GGUF and Hugging Face loaders."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike


def to_jax(array: np.ndarray, dtype: DTypeLike) -> jax.Array:
    """Cast on the host (ml_dtypes knows bf16) and place on the default device once.

    Args:
        array: any shape, any float dtype.
        dtype: target dtype, e.g. `jnp.float32` or `jnp.bfloat16`.

    Returns:
        The same values as a `jax.Array` of `dtype`.
    """
    return jnp.asarray(np.asarray(array, dtype=jnp.dtype(dtype)))


def check_shape(name: str, array: np.ndarray, expected: Sequence[int], source: str) -> None:
    """Raise a ValueError naming the tensor, the expected and the actual shape when they differ."""
    if tuple(array.shape) != tuple(expected):
        raise ValueError(
            f"Tensor {name!r} in {source} has shape {tuple(array.shape)}, expected "
            f"{tuple(expected)} from the model config."
        )


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row permutation of a Q or K projection.

    llama.cpp's `convert_hf_to_gguf.py` reorders the output rows of each head from the HF layout
    (first halves of the rotary pairs, then second halves) to interleaved pairs. This is the
    inverse, written like transformers' `_reverse_permute_weights`.

    Args:
        weight: [H*D, E] (out, in) projection or [H*D] bias, float.
        num_heads: H, heads of this projection (Hkv for K).

    Returns:
        Same shape and dtype, rows back in Hugging Face order.
    """
    out = weight.shape[0]
    if out % (2 * num_heads):
        raise ValueError(
            f"Cannot un-permute a tensor with {out} rows for {num_heads} heads: rows must be a "
            "multiple of 2 * heads."
        )
    half = out // num_heads // 2
    return (
        weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def clean_float(value: float) -> float:
    """A float32 read from a file as its shortest decimal (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))
