"""The decode step's own token joined with the cache's split partials in one kernel launch.

A decode step attends the cache through one kernel per tier, each returning split partials
(out, lse); the step's own key and value are not in the cache yet. `join_new_token` computes
the new token's logit, merges every split of every tier and the new token by one log-sum-exp
over the splits, and writes the output in q's dtype, the final lse and the new token's weight:
one launch per layer where XLA ran four small fusions (the partials' max and sum over the
splits, the new token's dot, the merge and the cast).

One program per (sequence, KV head, query head, chunk of DC channels), as `combine_triton`:
it loads each tier's S log-sum-exps and [S, DC] partial outputs of its query head at once (one
trip to memory, no loop over the splits), so a layer's join is B·Hkv·G programs, not B·Hkv
walking the splits in turn. The partials may keep the attention kernels' padded query rows
(R >= G, `decode_partials(padded=True)`): only the G real rows are read, and no slice of them
is copied first. Pallas, lowered through Triton on GPU (D a power of two); the interpreter
elsewhere (CPU tests).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax.pallas_kernels.decode_attention._combine_triton import (
    MAX_TILE,
    channel_chunk,
    tile_rows,
)
from kvjax.pallas_kernels.decode_attention._tiers import Partials

Array = jax.Array


def join_applies(q: Array, splits: Sequence[int] = ()) -> str | None:
    """Why the compiled (Triton) join cannot run for q [B, Hkv, G, D] and tiers of `splits`
    splits each (None if it can)."""
    d = q.shape[3]
    if d & (d - 1) or d < 16:
        return f"D={d} (the Triton lowering needs a power of two, at least 16)"
    if tile_rows(splits) * 16 > MAX_TILE:
        return f"{'+'.join(map(str, splits))} splits (at most {MAX_TILE // 16} in all)"
    return None


def _kernel(*refs, splits: tuple[int, ...], chunks: int, scale: float):
    tiers = len(splits)
    parts = list(zip(refs[: 2 * tiers : 2], refs[1 : 2 * tiers : 2], strict=True))
    q_ref, k_ref, v_ref, valid_ref, o_ref, lse_ref, wnew_ref = refs[2 * tiers :]
    # part refs: out [S, R, D], lse [S, R] of one sequence and KV head; q_ref [D] (query head
    # g), k_ref [D], v_ref [DC]; o_ref [DC]; lse_ref, wnew_ref [1]
    g = pl.program_id(2) // chunks
    c = pl.program_id(2) % chunks
    dc = o_ref.shape[0]
    valid = valid_ref[0] != 0
    s_new = jnp.sum(q_ref[...].astype(jnp.float32) * k_ref[...].astype(jnp.float32)) * scale
    s_new = jnp.where(valid, s_new, -jnp.inf)
    # Every load first (none waits on another's reductions): one trip to memory.
    tiles = []
    for (out_ref, lse_ref_in), s in zip(parts, splits, strict=True):
        sp = pl.next_power_of_2(s)
        live = jax.lax.broadcasted_iota(jnp.int32, (sp,), 0) < s
        rows = pl.ds(0, sp)
        part = plgpu.load(out_ref.at[rows, g, pl.ds(c * dc, dc)], mask=live[:, None], other=0.0)
        lse = plgpu.load(lse_ref_in.at[rows, g], mask=live, other=-jnp.inf)
        tiles.append((part, lse))
    m = s_new
    for _, lse in tiles:
        m = jnp.maximum(m, jnp.max(lse))
    m = jnp.where(m > -jnp.inf, m, 0.0)  # -inf splits and an invalid new token weigh 0
    w_own = jnp.where(valid, jnp.exp(s_new - m), 0.0)
    den = w_own
    acc = w_own * v_ref[...].astype(jnp.float32)
    for part, lse in tiles:
        w = jnp.exp(lse - m)
        den = den + jnp.sum(w)
        acc = acc + jnp.sum(w[:, None] * part, axis=0)
    has = den > 0
    lse = jnp.where(has, m + jnp.log(jnp.where(has, den, 1.0)), -jnp.inf)
    o_ref[...] = (acc / jnp.where(has, den, 1.0)).astype(o_ref.dtype)
    lse_ref[...] = jnp.full((1,), lse)
    wnew_ref[...] = jnp.full((1,), jnp.where(has, w_own / jnp.where(has, den, 1.0), 0.0))


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def join_new_token(
    parts: Sequence[Partials],
    q: Array,
    k_new: Array,
    v_new: Array,
    valid: Array,
    *,
    scale: float,
    interpret: bool = False,
) -> tuple[Array, Array, Array]:
    """Every tier's split partials and the step's own token, merged in one launch.

    Args:
        parts: each tier's Partials (out [B, Hkv, S_i, R_i, D] float32, lse [B, Hkv, S_i,
            R_i], R_i >= G rows of which the first G are the query heads: the padding rows of
            `decode_partials(padded=True)` are never read).
        q: [B, Hkv, G, D] queries grouped by KV head.
        k_new, v_new: [B, Hkv, D] this step's key and value.
        valid: [B] bool, the new token is real (else it is not attended).
        scale: logit scale.
        interpret: run in the Pallas interpreter (CPU).

    Returns:
        out [B, Hkv, G, D] in q's dtype (0 where nothing was visible), lse [B, Hkv, G] float32
        over the cache and the new token (-inf if nothing), and the new token's weight
        [B, Hkv, G] float32 (its probability; 0 where it is not valid).
    """
    b, hkv, g, d = q.shape
    if k_new.shape != (b, hkv, d) or v_new.shape != (b, hkv, d):
        raise ValueError(
            f"join_new_token: k_new {k_new.shape} and v_new {v_new.shape} must be {(b, hkv, d)}"
        )
    if valid.shape != (b,):
        raise ValueError(f"join_new_token: valid must be [B]={(b,)}, got {valid.shape}")
    if not parts:
        raise ValueError("join_new_token: no partials given (at least one tier's)")
    for p in parts:
        o = p.out.shape
        if len(o) != 5 or o[:2] != (b, hkv) or o[3] < g or o[4] != d or p.lse.shape != o[:4]:
            raise ValueError(
                f"join_new_token: partials out {o} / lse {p.lse.shape} do not fit q {q.shape} "
                "(out [B, Hkv, S, R >= G, D], lse [B, Hkv, S, R])"
            )
    splits = tuple(p.out.shape[2] for p in parts)
    if not interpret and (why := join_applies(q, splits)):
        raise ValueError(f"join_new_token: unsupported {why}")
    dc = channel_chunk(splits, d)
    chunks = d // dc
    arrays, specs = [], []
    for p in parts:
        s, r = p.out.shape[2:4]
        arrays += [p.out.astype(jnp.float32), p.lse.astype(jnp.float32)]
        specs += [
            pl.BlockSpec((None, None, s, r, d), lambda i, j, k: (i, j, 0, 0, 0)),
            pl.BlockSpec((None, None, s, r), lambda i, j, k: (i, j, 0, 0)),
        ]
    arrays += [q, k_new, v_new, valid.astype(jnp.int32)]
    specs += [
        pl.BlockSpec((None, None, None, d), lambda i, j, k: (i, j, k // chunks, 0)),
        pl.BlockSpec((None, None, d), lambda i, j, k: (i, j, 0)),
        pl.BlockSpec((None, None, dc), lambda i, j, k: (i, j, k % chunks)),
        pl.BlockSpec((1,), lambda i, j, k: (i,)),
    ]
    f32 = jnp.float32
    row = lambda i, j, k: (i, j, k // chunks, k % chunks)
    o, lse, w_new = pl.pallas_call(
        functools.partial(_kernel, splits=splits, chunks=chunks, scale=scale),
        grid=(b, hkv, g * chunks),
        in_specs=specs,
        out_specs=[
            pl.BlockSpec((None, None, None, dc), row),
            pl.BlockSpec((None, None, None, 1), row),
            pl.BlockSpec((None, None, None, 1), row),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, hkv, g, d), q.dtype),
            jax.ShapeDtypeStruct((b, hkv, g, chunks), f32),
            jax.ShapeDtypeStruct((b, hkv, g, chunks), f32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="kvjax_decode_join",
    )(*arrays)
    return o, lse[..., 0], w_new[..., 0]
