"""Decode attention over the packed low-bit tier: Pallas Mosaic TPU.

Grid (B, Hkv, page blocks), `pages` pages per step. Each packed row is unpacked with one shift and
one mask per sub-block i (kvjax.quant.pack: sub-block i = channels [i·D/n, (i+1)·D/n)), so the
kernel works on n lane-dense sub-blocks and never slices lanes: queries, key scales/zeros and the
output come in (and leave) split into the same n sub-blocks, reshaped outside for free. Value
scales/zeros per channel group are spread over a sub-block's lanes by a one-hot matmul.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kvjax.pallas_kernels.decode_attention._tiers import LowBitTier, Partials
from kvjax.pallas_kernels.decode_attention._tpu import (
    _NN,
    _NT,
    cdiv,
    dot,
    finish,
    init_scratch,
    interpret_params,
    online_update,
)
from kvjax.pallas_kernels.decode_attention._validate import check_lowbit, check_query

Array = jax.Array


def _kernel(
    ext_ref,  # SMEM [B, Hkv] int32 one past the last attended page
    qpos_ref,  # SMEM [B] int32
    q_ref,  # [n, G, sub] queries split into the n channel sub-blocks
    k_ref,  # [pp, Tp, Dp] uint8 packed key codes
    v_ref,  # [pp, Tp, Dp] uint8 packed value codes
    ks_ref,  # [pp, n, sub] f32 key scale per page and channel
    kz_ref,  # [pp, n, sub] f32 key zero
    vs_ref,  # [pp, Tp, NG] f32 value scale per token and channel group
    vz_ref,  # [pp, Tp, NG] f32 value zero
    pos_ref,  # [pp, 1, Tp] int32
    o_ref,  # [n, G, sub] f32
    lse_ref,  # [G, 1] f32
    *refs,  # logits_ref [pp, G, Tp] (return_logits); scratch m, l [G, 1], acc [n, G, sub]
    bits: int,
    scale: float,
    return_logits: bool,
):
    logits_ref = refs[0] if return_logits else None
    m_ref, l_ref, acc_ref = refs[-3:]
    pp, tp, _ = k_ref.shape
    n, g, sub = q_ref.shape
    ng = vs_ref.shape[-1]
    group = sub * n // ng  # channels per value group
    mask = (1 << bits) - 1
    b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    extent = ext_ref[b, h]
    cdt = q_ref.dtype

    @pl.when(i == 0)
    def _():
        init_scratch(m_ref, l_ref, acc_ref)

    def spread(j: int) -> Array:
        """[NG, sub] one-hot: value group of each lane of sub-block j."""
        lane = j * sub + lax.broadcasted_iota(jnp.int32, (ng, sub), 1)
        grp = lax.broadcasted_iota(jnp.int32, (ng, sub), 0)
        return (lax.div(lane, jnp.int32(group)) == grp).astype(jnp.float32)

    def codes(packed: Array, j: int) -> Array:  # [Tp, Dp] uint8 → [Tp, sub] f32
        return ((packed.astype(jnp.int32) >> (j * bits)) & mask).astype(jnp.float32)

    @pl.when(i * pp < extent)
    def _():
        for c in range(pp):  # pages of this step, each folded into the online softmax
            live = i * pp + c < extent
            pk = k_ref[c]
            s = jnp.zeros((g, tp), jnp.float32)
            for j in range(n):
                ksj = ks_ref[c, pl.ds(j, 1), :].astype(jnp.float32)  # stats may be bfloat16
                kj = codes(pk, j) * ksj + kz_ref[c, pl.ds(j, 1), :].astype(jnp.float32)
                s = s + dot(q_ref[j], kj.astype(cdt), _NT)
            pos = pos_ref[c]  # [1, Tp]
            seen = (pos >= 0) & (pos <= qpos_ref[b]) & live
            s = jnp.where(seen, s * scale, -jnp.inf)
            if return_logits:
                logits_ref[c] = s
            p, corr = online_update(s, m_ref, l_ref)
            p = p.astype(cdt)
            pv_ = v_ref[c]
            vs, vz = vs_ref[c].astype(jnp.float32), vz_ref[c].astype(jnp.float32)
            for j in range(n):
                vj = codes(pv_, j) * dot(vs, spread(j), _NN) + dot(vz, spread(j), _NN)
                vj = jnp.where(live, vj, 0.0)  # padding pages past P may hold NaN stats
                acc_ref[j] = acc_ref[j] * corr + dot(p, vj.astype(cdt), _NN)

    @pl.when(i == pl.num_programs(2) - 1)
    def _():
        finish(m_ref, l_ref, acc_ref, o_ref, lse_ref)


@functools.partial(
    jax.jit,
    static_argnames=("bits", "scale", "pages", "num_splits", "return_logits", "interpret"),
)
def decode_attention_lowbit_tpu(
    q: Array,
    tier: LowBitTier,
    q_pos: Array,
    *,
    bits: int,
    scale: float,
    pages: int = 8,
    num_splits: int | None = None,
    return_logits: bool = False,
    interpret: bool = False,
) -> Partials:
    """One decode query per sequence attending the packed low-bit tier (Mosaic TPU).

    Args:
        q: [B, Hkv, G, D] queries grouped by KV head.
        tier: the LowBitTier (extent in pages).
        q_pos: [B] int32 query positions.
        bits: 2, 4 or 8.
        scale: logit scale.
        pages: pages per grid step (capped at P).
        num_splits: accepted for API parity; TPU runs S = 1.
        return_logits: also return the scaled logits of every read slot.
        interpret: run in the Pallas TPU interpreter (CPU tests).

    Returns:
        Partials with S = 1; logits [B, Hkv, G, P·Tp].
    """
    del num_splits
    check_query(q, q_pos)
    check_lowbit(tier, q, bits)
    b, hkv, g, d = q.shape
    num_pages, tp, dp = tier.k.shape[2:]
    n = 8 // bits
    sub = d // n
    ng = tier.v_scale.shape[-1]
    pp = min(pages, num_pages)

    def blk(b_, h_, i, ext, qp):  # dead steps revisit the last live block: no new DMA
        return jnp.minimum(i, jnp.maximum(cdiv(ext[b_, h_], pp) - 1, 0))

    paged = lambda *s: pl.BlockSpec(
        (None, None, pp, *s), lambda b_, h_, i, ext, qp: (b_, h_, blk(b_, h_, i, ext, qp), 0, 0)
    )
    fixed = lambda *s: pl.BlockSpec(
        (None, None, *s), lambda b_, h_, i, ext, qp: (b_, h_) + (0,) * len(s)
    )
    qs = q.reshape(b, hkv, g, n, sub).transpose(0, 1, 3, 2, 4)  # [B, Hkv, n, G, sub]
    split = lambda x: x.reshape(b, hkv, num_pages, n, sub)
    arrays = [qs, tier.k, tier.v, split(tier.k_scale), split(tier.k_zero)]
    arrays += [tier.v_scale, tier.v_zero, tier.pos.reshape(b, hkv, num_pages, 1, tp)]
    in_specs = [fixed(n, g, sub), paged(tp, dp), paged(tp, dp), paged(n, sub), paged(n, sub)]
    in_specs += [paged(tp, ng), paged(tp, ng), paged(1, tp)]
    out_shape = [
        jax.ShapeDtypeStruct((b, hkv, n, g, sub), jnp.float32),
        jax.ShapeDtypeStruct((b, hkv, g, 1), jnp.float32),
    ]
    out_specs = [fixed(n, g, sub), fixed(g, 1)]
    if return_logits:
        out_shape.append(jax.ShapeDtypeStruct((b, hkv, num_pages, g, tp), jnp.float32))
        out_specs.append(paged(g, tp))
    kernel = functools.partial(_kernel, bits=bits, scale=scale, return_logits=return_logits)
    outs = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, hkv, pl.cdiv(num_pages, pp)),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=[
                pltpu.VMEM((g, 1), jnp.float32),
                pltpu.VMEM((g, 1), jnp.float32),
                pltpu.VMEM((n, g, sub), jnp.float32),
            ],
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=(pltpu.PARALLEL, pltpu.PARALLEL, pltpu.ARBITRARY)
        ),
        interpret=interpret_params(interpret),
        name=f"kvjax_decode_int{bits}_tpu",
    )(tier.extent, q_pos, *arrays)
    out = outs[0].transpose(0, 1, 3, 2, 4).reshape(b, hkv, 1, g, d)
    logits = None
    if return_logits:
        logits = outs[2].transpose(0, 1, 3, 2, 4).reshape(b, hkv, g, num_pages * tp)
    return Partials(out, outs[1][:, :, None, :, 0], logits)
