"""The decode step's own token joined with the cache's split partials in one kernel launch.

A decode step attends the cache through one kernel per tier, each returning split partials
(out, lse); the step's own key and value are not in the cache yet. `join_new_token` computes
the new token's logit, merges every split of every tier and the new token by one online
log-sum-exp over the splits, and writes the output in q's dtype, the final lse and the new
token's weight: one launch per layer where XLA ran several small fusions (the partials' max
and sum over the splits, the new token's dot, the merge and the cast). Pallas, lowered through
Triton on GPU (G and D powers of two); the interpreter elsewhere (CPU tests).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kvjax.pallas_kernels.decode_attention._tiers import Partials

Array = jax.Array
_NEG = -1e30  # running-max floor: never inf - inf


def join_applies(q: Array) -> str | None:
    """Why the compiled (Triton) join cannot run for q [B, Hkv, G, D] (None if it can)."""
    g, d = q.shape[2:]
    if g & (g - 1) or d & (d - 1):
        return f"G={g}, D={d} (the Triton lowering needs powers of two)"
    return None


def _chunk(splits: int, g: int, d: int) -> int:
    """Splits a loop step of the join reads at once: a power of two with at most 4096 floats
    of partial outputs (32 a thread of 4 warps), at most 8, at most `splits`."""
    c = 1
    while c < 8 and 2 * c <= splits and 2 * c * g * d <= 4096:
        c *= 2
    return c


def _over_splits(parts, fn, carry):
    """carry = fn(rows, carry) over every tier's splits, `rows` a static or dynamic slice of a
    chunk of them: full chunks in a loop, the remainder one split at a time."""
    for out_ref, lse_ref in parts:
        s, g, d = out_ref.shape
        c = _chunk(s, g, d)
        full = s // c
        if full:

            def step(i, cr, out_ref=out_ref, lse_ref=lse_ref, c=c):
                return fn(out_ref, lse_ref, pl.ds(i * c, c), cr)

            carry = lax.fori_loop(0, full, step, carry)
        for r in range(full * c, s):
            carry = fn(out_ref, lse_ref, pl.ds(r, 1), carry)
    return carry


def _kernel(*refs, tiers: int, scale: float):
    parts = list(zip(refs[: 2 * tiers : 2], refs[1 : 2 * tiers : 2], strict=True))
    q_ref, k_ref, v_ref, valid_ref, o_ref, lse_ref, wnew_ref = refs[2 * tiers :]
    q = q_ref[...].astype(jnp.float32)  # [G, D]
    valid = valid_ref[0] != 0
    s_new = jnp.sum(q * k_ref[...].astype(jnp.float32)[None, :], axis=1) * scale  # [G]
    s_new = jnp.where(valid, s_new, -jnp.inf)
    g, d = q.shape
    ok = jnp.broadcast_to(valid, (g,))
    # Two passes with no chain of rescales between the splits: their max, then their sum.
    # lse is -inf where a split saw nothing.
    m = _over_splits(
        parts, lambda o, lse, rows, m: jnp.maximum(m, lse[rows, :].max(axis=0)),
        jnp.maximum(s_new, _NEG),
    )  # fmt: skip

    def add(out_in, lse_in, rows, carry):
        den, acc = carry
        w = jnp.exp(lse_in[rows, :] - m[None, :])  # [C, G]
        return den + w.sum(axis=0), acc + (w[:, :, None] * out_in[rows, :, :]).sum(axis=0)

    w_own = jnp.where(ok, jnp.exp(s_new - m), jnp.zeros((g,), jnp.float32))
    vb = jnp.broadcast_to(v_ref[...].astype(jnp.float32)[None, :], (g, d))
    den, acc = _over_splits(parts, add, (w_own, w_own[:, None] * vb))
    has = den > 0
    lse = jnp.where(has, m + jnp.log(jnp.where(has, den, 1.0)), -jnp.inf)
    o_ref[...] = (acc / jnp.where(has, den, 1.0)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = lse
    w_new = jnp.exp(s_new - jnp.where(has, lse, 0.0))
    wnew_ref[...] = jnp.where(ok & has, w_new, jnp.zeros((g,), jnp.float32))


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
        parts: each tier's Partials (out [B, Hkv, S_i, G, D] float32, lse [B, Hkv, S_i, G]).
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
    if not interpret and (why := join_applies(q)):
        raise ValueError(f"join_new_token: unsupported {why}")
    arrays, specs = [], []
    for p in parts:
        if p.out.shape[:2] != (b, hkv) or p.out.shape[3:] != (g, d):
            raise ValueError(f"join_new_token: partials out {p.out.shape} do not fit q {q.shape}")
        s = p.out.shape[2]
        arrays += [p.out.astype(jnp.float32), p.lse.astype(jnp.float32)]
        specs += [
            pl.BlockSpec((None, None, s, g, d), lambda i, j: (i, j, 0, 0, 0)),
            pl.BlockSpec((None, None, s, g), lambda i, j: (i, j, 0, 0)),
        ]
    arrays += [q, k_new, v_new, valid.astype(jnp.int32)]
    specs += [
        pl.BlockSpec((None, None, g, d), lambda i, j: (i, j, 0, 0)),
        pl.BlockSpec((None, None, d), lambda i, j: (i, j, 0)),
        pl.BlockSpec((None, None, d), lambda i, j: (i, j, 0)),
        pl.BlockSpec((1,), lambda i, j: (i,)),
    ]
    f32 = jnp.float32
    return pl.pallas_call(
        functools.partial(_kernel, tiers=len(parts), scale=scale),
        grid=(b, hkv),
        in_specs=specs,
        out_specs=[
            pl.BlockSpec((None, None, g, d), lambda i, j: (i, j, 0, 0)),
            pl.BlockSpec((None, None, g), lambda i, j: (i, j, 0)),
            pl.BlockSpec((None, None, g), lambda i, j: (i, j, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, hkv, g, d), q.dtype),
            jax.ShapeDtypeStruct((b, hkv, g), f32),
            jax.ShapeDtypeStruct((b, hkv, g), f32),
        ],
        interpret=interpret,
        name="kvjax_decode_join",
    )(*arrays)
