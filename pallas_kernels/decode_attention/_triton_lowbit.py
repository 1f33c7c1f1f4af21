"""Decode attention over the packed low-bit tier (2/4/8-bit pages): Pallas through Triton (GPU).

Codes are unpacked in registers with one shift and one mask per sub-block (kvjax.quant.pack's
layout: byte j holds channel j + i·D/n of sub-block i at bit offset i·bits). Dequantization is
folded out of the per-element path: the per-page, per-channel key scale multiplies the query
chunk and the key zero adds q·zero to the logits; the per-token value scale multiplies the
probabilities and the value zero adds Σ p·zero to the output. So a code costs a shift, a mask
and a convert; the dots run on raw codes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax.pallas_kernels.decode_attention._tiers import LowBitTier, Partials
from kvjax.pallas_kernels.decode_attention._triton import (
    dot_f32,
    head_spec,
    pad_group,
    partials,
    split_out_shapes,
    split_range,
    store_rows,
)
from kvjax.pallas_kernels.decode_attention._tuning import num_splits as _num_splits
from kvjax.pallas_kernels.decode_attention._tuning import tuning_for

Array = jax.Array
_NEG = -1e30


def chunks(d: int, bits: int, num_groups: int) -> list[tuple[int, int, int, int]]:
    """(sub-block i, byte offset, first channel, value group) of every w-channel chunk.

    A chunk is w = min(D/n, D/NG) bytes of a packed row shifted by i·bits: channels
    [i·D/n + byte, +w), all inside one value group.
    """
    n = 8 // bits
    sub = d // n
    w = min(sub, d // num_groups)
    vg = d // num_groups
    return [(i, j, i * sub + j, (i * sub + j) // vg) for i in range(n) for j in range(0, sub, w)]


def _kernel(
    extent_ref,  # [] int32 one past the last attended page
    qpos_ref,  # [] int32
    q_ref,  # [Gp, D]
    k_ref,  # [P, Tp, Dp] uint8 packed key codes
    v_ref,  # [P, Tp, Dp] uint8 packed value codes
    ks_ref,  # [P, D] f32 key scale per page and channel
    kz_ref,  # [P, D] f32 key zero
    vs_ref,  # [P, Tp, NG] f32 value scale per token and channel group
    vz_ref,  # [P, Tp, NG] f32 value zero
    pos_ref,  # [P, Tp] int32, -1 = not attended
    o_ref,  # [Gp, D] f32 (rows >= G never written)
    lse_ref,  # [Gp] f32
    *logits_ref,  # [Gp, P·Tp] f32 (return_logits; rows >= G never written)
    bits: int,
    scale: float,
    num_splits: int,
    pages_per_step: int,
    group: int,
    return_logits: bool,
):
    pages, tp, _ = k_ref.shape
    gp, d = q_ref.shape
    ng = vs_ref.shape[-1]
    mask = (1 << bits) - 1
    parts = chunks(d, bits, ng)
    w = min(d * bits // 8, d // ng)  # channels per chunk
    cdt = q_ref.dtype
    qpos = qpos_ref[()]
    q = [q_ref[:, pl.ds(c0, w)].astype(jnp.float32) for _, _, c0, _ in parts]  # [Gp, w] each
    extent = jnp.minimum(extent_ref[()], pages)
    n_steps = pl.cdiv(pages, pages_per_step)
    first, last = split_range(extent, n_steps, pages_per_step, num_splits)

    def codes(packed: Array, i: int) -> Array:
        return ((packed >> (i * bits)) & mask).astype(cdt)  # [Tp, w]

    js = sorted({j for _, j, _, _ in parts})

    def load(pg):
        """Every array of page pg (clamped in bounds), loaded before any is used."""
        return dict(
            pos=pos_ref[pg, :],
            k={j: k_ref[pg, :, pl.ds(j, w)] for j in js},
            v={j: v_ref[pg, :, pl.ds(j, w)] for j in js},
            ks=[ks_ref[pg, pl.ds(c0, w)] for _, _, c0, _ in parts],
            kz=[kz_ref[pg, pl.ds(c0, w)] for _, _, c0, _ in parts],
            vs=[vs_ref[pg, :, grp] for _, _, _, grp in parts],  # [Tp] each
            vz=[vz_ref[pg, :, grp] for _, _, _, grp in parts],
        )

    def attend(page, pg, live, carry):
        acc, m, l = carry
        s = jnp.zeros((gp, tp), jnp.float32)
        qz = jnp.zeros((gp,), jnp.float32)
        for qc, ksc, kzc, (i, j, _, _) in zip(q, page["ks"], page["kz"], parts, strict=True):
            s = s + dot_f32((qc * ksc[None, :]).astype(cdt), codes(page["k"][j], i), trans_b=True)
            qz = qz + jnp.sum(qc * kzc[None, :], axis=1)
        s = (s + qz[:, None]) * scale
        pos = page["pos"]
        s = jnp.where(((pos >= 0) & (pos <= qpos) & live)[None, :], s, -jnp.inf)
        if return_logits:
            cols = pl.ds(pl.multiple_of(pg * tp, tp), tp)
            store_rows(logits_ref[0], s, group, cols, jnp.full((tp,), live))
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        corr = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])  # [Gp, Tp]
        l = l * corr + jnp.sum(p, axis=1)
        new = []
        for a, vsc, vzc, (i, j, _, _) in zip(acc, page["vs"], page["vz"], parts, strict=True):
            pv = dot_f32((p * vsc[None, :]).astype(cdt), codes(page["v"][j], i), trans_b=False)
            zero = jnp.sum(p * vzc[None, :], axis=1)
            new.append(a * corr[:, None] + pv + zero[:, None])
        return new, m_new, l

    def step(st, carry):
        pgs = [jnp.minimum(st * pages_per_step + c, pages - 1) for c in range(pages_per_step)]
        loaded = [load(pg) for pg in pgs]  # all loads of the step in flight together
        for c, (pg, page) in enumerate(zip(pgs, loaded, strict=True)):
            carry = attend(page, pg, st * pages_per_step + c < extent, carry)
        return carry

    init = (
        [jnp.zeros((gp, w), jnp.float32) for _ in parts],
        jnp.full((gp,), _NEG, jnp.float32),
        jnp.zeros((gp,), jnp.float32),
    )
    acc, m, l = lax.fori_loop(first, last, step, init)
    has = l > 0
    lse_ref[...] = jnp.where(has, m + jnp.log(jnp.where(has, l, 1.0)), -jnp.inf)
    inv = 1.0 / jnp.where(has, l, 1.0)
    for a, (_, _, c0, _) in zip(acc, parts, strict=True):
        store_rows(o_ref, a * inv[:, None], group, pl.ds(c0, w))


@functools.partial(
    jax.jit,
    static_argnames=(
        "bits",
        "scale",
        "num_splits",
        "pages_per_step",
        "num_warps",
        "num_stages",
        "return_logits",
        "interpret",
    ),
)
def decode_attention_lowbit_triton(
    q: Array,
    tier: LowBitTier,
    q_pos: Array,
    *,
    bits: int,
    scale: float,
    num_splits: int | None = None,
    pages_per_step: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    return_logits: bool = False,
    interpret: bool = False,
) -> Partials:
    """One decode query per sequence attending the packed low-bit tier, page by page.

    Args:
        q: [B, Hkv, G, D] queries grouped by KV head, in the compute dtype.
        tier: the LowBitTier (extent counted in pages).
        q_pos: [B] int32 query positions.
        bits: code width, 2, 4 or 8.
        scale: logit scale.
        num_splits: splits S per (sequence, KV head); default fills the chip.
        pages_per_step: pages whose loads are issued together per loop step (default: tuned).
        num_warps, num_stages: Triton launch knobs; default from the device's Tuning.
        return_logits: also return the scaled logits of every read slot.
        interpret: run in the Pallas interpreter (CPU tests).

    Returns:
        Partials; logits are [B, Hkv, G, P·Tp].
    """
    if bits not in (2, 4, 8):
        raise ValueError(f"bits must be 2, 4 or 8, got {bits}")
    tune = tuning_for()
    b, hkv, group, d = q.shape
    pages, tp, dp = tier.k.shape[2:]
    if dp * 8 != d * bits:
        raise ValueError(f"packed width {dp} does not hold D={d} channels at {bits} bits")
    pps = pages_per_step or tune.pages_per_step
    splits = num_splits or _num_splits(b, hkv, pl.cdiv(pages, pps), tune.target_programs)
    qp = pad_group(q)
    out_shape, out_specs = split_out_shapes(qp, group, splits, pages * tp, return_logits)
    arrays = [tier.extent, q_pos, qp, tier.k, tier.v, tier.k_scale, tier.k_zero]
    arrays += [tier.v_scale, tier.v_zero, tier.pos]
    specs = [head_spec(), pl.BlockSpec((None,), lambda i, j, s: (i,))]
    specs += [head_spec(*x.shape[2:]) for x in arrays[2:]]
    kernel = functools.partial(
        _kernel,
        bits=bits,
        scale=scale,
        num_splits=splits,
        pages_per_step=pps,
        group=group,
        return_logits=return_logits,
    )
    outs = pl.pallas_call(
        kernel,
        grid=(b, hkv, splits),
        in_specs=specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(
            num_warps=num_warps or tune.num_warps, num_stages=num_stages or tune.num_stages
        ),
        interpret=interpret,
        name=f"kvjax_decode_int{bits}",
    )(*arrays)
    return partials(outs, group, return_logits)
