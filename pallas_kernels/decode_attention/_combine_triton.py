"""The split combine as one Triton kernel (GPU): what `combine` does in plain jnp, in one launch.

After the dense Triton kernel, `combine` costs XLA several small kernels (the max over splits,
the weights, the weighted sum, the normalization), each a launch that at batch 1 takes as long
as its work; this kernel reads the split partials once, still padded to the attention kernel's
Gp query rows (no slice of them is copied first), and writes out [B, Hkv, G, D] and lse
[B, Hkv, G]. One program per (sequence, KV head, query head, chunk of DC channels) loads its
query head's S log-sum-exps and its [S, DC] partial outputs at once.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

Array = jax.Array
MAX_TILE = 8192  # elements of a program's [S, DC] tile of partial outputs (registers)


def tile_rows(splits: Sequence[int]) -> int:
    """Rows of a program's tiles of partial outputs: each tier's S splits padded to 2^k."""
    return sum(pl.next_power_of_2(s) for s in splits)


def channel_chunk(splits: Sequence[int], d: int) -> int:
    """DC: the most channels (a power of two, at least 16, at most d) a program takes with its
    tiles [S_i (each padded to 2^k), DC] summing to at most MAX_TILE elements (also
    `join_new_token`'s)."""
    return min(d, max(16, pl.next_power_of_2(MAX_TILE // tile_rows(splits) + 1) // 2))


def combine_applies(splits: int, d: int) -> str | None:
    """Why `combine_triton` cannot combine S = `splits` partials of head dim d (None if it can)."""
    if d & (d - 1) or d < 16:
        return f"head dim {d} (needs a power of 2, at least 16)"
    if tile_rows((splits,)) * 16 > MAX_TILE:
        return f"{splits} splits (at most {MAX_TILE // 16})"
    return None


def _kernel(out_ref, lse_ref, o_ref, l_ref, *, splits: int, chunks: int):
    # out_ref [S, R, D], lse_ref [S, R] (one sequence and KV head); o_ref [DC]; l_ref [1]
    g = pl.program_id(2) // chunks
    c = pl.program_id(2) % chunks
    sp, dc = pl.next_power_of_2(splits), o_ref.shape[0]
    rows = lax.broadcasted_iota(jnp.int32, (sp,), 0)
    live = rows < splits
    # Both loads first (neither waits on the other's reductions): one trip to memory.
    part = plgpu.load(out_ref.at[pl.ds(0, sp), g, pl.ds(c * dc, dc)], mask=live[:, None], other=0.0)
    lse = plgpu.load(lse_ref.at[pl.ds(0, sp), g], mask=live, other=-jnp.inf)
    m = jnp.max(lse)
    m = jnp.where(m > -jnp.inf, m, 0.0)
    w = jnp.where(live, jnp.exp(lse - m), 0.0)  # -inf splits weigh 0
    den = jnp.sum(w)
    has = den > 0
    o_ref[...] = jnp.sum(w[:, None] * part, axis=0) / jnp.where(has, den, 1.0)
    l_ref[...] = jnp.full((1,), jnp.where(has, m + jnp.log(jnp.where(has, den, 1.0)), -jnp.inf))


@functools.partial(jax.jit, static_argnames=("group", "interpret"))
def combine_triton(out: Array, lse: Array, group: int, interpret: bool = False):
    """Log-sum-exp combine of one tier's split partials, as `combine` of that one part.

    Args:
        out: [B, Hkv, S, R, D] float32 split outputs, R >= group rows of which the first
            `group` are the query heads (the rest, padding, are never read).
        lse: [B, Hkv, S, R] float32 split log-sum-exps (-inf where a split saw nothing).
        group: G, the query heads per KV head.
        interpret: run in the Pallas interpreter (CPU tests).

    Returns:
        out [B, Hkv, G, D] float32 (0 where nothing was visible), lse [B, Hkv, G] float32
        (-inf where nothing was visible).
    """
    if out.ndim != 5 or lse.shape != out.shape[:4]:
        raise ValueError(
            f"combine_triton: out must be [B, Hkv, S, R, D] and lse [B, Hkv, S, R], got "
            f"{out.shape} and {lse.shape}"
        )
    if out.dtype != jnp.float32 or lse.dtype != jnp.float32:
        raise ValueError(f"combine_triton: float32 partials, got {out.dtype} and {lse.dtype}")
    b, hkv, splits, rows, d = out.shape
    if not 1 <= group <= rows:
        raise ValueError(f"combine_triton: group {group} must be in 1..{rows} (the rows given)")
    why = combine_applies(splits, d)
    if why:
        raise ValueError(f"combine_triton: unsupported {why}")
    dc = channel_chunk((splits,), d)
    chunks = d // dc
    o, l = pl.pallas_call(
        functools.partial(_kernel, splits=splits, chunks=chunks),
        grid=(b, hkv, group * chunks),
        in_specs=[
            pl.BlockSpec((None, None, splits, rows, d), lambda i, j, k: (i, j, 0, 0, 0)),
            pl.BlockSpec((None, None, splits, rows), lambda i, j, k: (i, j, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, dc), lambda i, j, k: (i, j, k // chunks, k % chunks)),
            pl.BlockSpec((None, None, None, 1), lambda i, j, k: (i, j, k // chunks, k % chunks)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, hkv, group, d), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, group, chunks), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="kvjax_combine_splits",
    )(out, lse)
    return o, l[..., 0]
