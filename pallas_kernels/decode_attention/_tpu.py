"""Decode attention over the full-precision or INT8 tier: Pallas Mosaic TPU.

Grid (B, Hkv, blocks): one (sequence, KV head) per outer index, its G query heads together, an
online softmax carried in VMEM scratch over the "arbitrary" block axis. The live extent arrives
by scalar prefetch: block indices past it are clamped to the last live block, so the pipeline
issues no new DMA for them, and their compute is skipped. TPU cores run the grid in order, so
there is no split-K (S = 1); the parallel B/Hkv axes feed megacore.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kvjax.pallas_kernels.decode_attention._tiers import FullTier, Int8Tier, Partials
from kvjax.pallas_kernels.decode_attention._validate import check_dense, check_query

Array = jax.Array
_NEG = -1e30
_NT = (((1,), (1,)), ((), ()))  # a [M, K] · b [N, K]ᵀ
_NN = (((1,), (0,)), ((), ()))


def dot(a: Array, b: Array, dims) -> Array:
    """MXU dot with float32 accumulation (float32 operands at full precision)."""
    prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


def online_update(s: Array, m_ref, l_ref) -> tuple[Array, Array]:
    """Folds logits s [G, N] into the running max/sum; returns (p [G, N], correction [G, 1])."""
    m_prev = m_ref[...]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    corr = jnp.exp(m_prev - m_new)
    p = jnp.exp(s - m_new)
    l_ref[...] = l_ref[...] * corr + jnp.sum(p, axis=1, keepdims=True)
    m_ref[...] = m_new
    return p, corr


def init_scratch(m_ref, l_ref, acc_ref) -> None:
    m_ref[...] = jnp.full(m_ref.shape, _NEG, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)


def finish(m_ref, l_ref, acc_ref, o_ref, lse_ref) -> None:
    """o = acc / l (0 if nothing was seen), lse = m + log l (-inf if nothing)."""
    l = l_ref[...]
    has = l > 0
    lse_ref[...] = jnp.where(has, m_ref[...] + jnp.log(jnp.where(has, l, 1.0)), -jnp.inf)
    inv = 1.0 / jnp.where(has, l, 1.0)
    o_ref[...] = acc_ref[...] * (inv[None] if acc_ref.ndim == 3 else inv)


def cdiv(x: Array, n: int) -> Array:
    """ceil(x / n) for x >= 0 by truncating division (floor division lowers through sign)."""
    return lax.div(x + (n - 1), jnp.int32(n))


def interpret_params(interpret: bool):
    return pltpu.InterpretParams() if interpret else False


def _kernel(
    ext_ref,  # SMEM [B, Hkv] int32 live extent
    qpos_ref,  # SMEM [B] int32
    q_ref,  # [G, D]
    k_ref,  # [bk, D] keys (float or int8 codes)
    v_ref,  # [bk, D]
    pos_ref,  # [1, bk] int32
    *refs,  # INT8: ks_ref, vs_ref [1, bk]; o_ref [G, D]; lse_ref [G, 1]; logits_ref [G, bk]?;
    # scratch m_ref, l_ref [G, 1], acc_ref [G, D]
    quantized: bool,
    scale: float,
    block_k: int,
    return_logits: bool,
):
    if quantized:
        ks_ref, vs_ref, *refs = refs
    o_ref, lse_ref, *refs = refs
    logits_ref = refs.pop(0) if return_logits else None
    m_ref, l_ref, acc_ref = refs
    b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    extent = ext_ref[b, h]

    @pl.when(i == 0)
    def _():
        init_scratch(m_ref, l_ref, acc_ref)

    @pl.when(i * block_k < extent)
    def _():
        cdt = q_ref.dtype if quantized else k_ref.dtype
        s = dot(q_ref[...].astype(cdt), k_ref[...].astype(cdt), _NT)  # [G, bk]
        s = s * (ks_ref[...] * scale) if quantized else s * scale
        idx = i * block_k + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        pos = pos_ref[...]
        seen = (pos >= 0) & (pos <= qpos_ref[b]) & (idx < extent)  # [1, bk]
        s = jnp.where(seen, s, -jnp.inf)
        if return_logits:
            logits_ref[...] = s
        p, corr = online_update(s, m_ref, l_ref)
        if quantized:  # edge-block padding may hold NaN scales: select, never multiply by 0
            p = jnp.where(seen, p * vs_ref[...], 0.0)
        rows = i * block_k + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
        v = jnp.where(rows < extent, v_ref[...].astype(cdt), 0)  # edge-block padding is garbage
        acc_ref[...] = acc_ref[...] * corr + dot(p.astype(cdt), v, _NN)

    @pl.when(i == pl.num_programs(2) - 1)
    def _():
        finish(m_ref, l_ref, acc_ref, o_ref, lse_ref)


@functools.partial(
    jax.jit, static_argnames=("scale", "block_k", "num_splits", "return_logits", "interpret")
)
def decode_attention_tpu(
    q: Array,
    tier: FullTier | Int8Tier,
    q_pos: Array,
    *,
    scale: float,
    block_k: int | None = None,
    num_splits: int | None = None,
    return_logits: bool = False,
    interpret: bool = False,
) -> Partials:
    """One decode query per sequence attending one full-precision or INT8 tier (Mosaic TPU).

    Args:
        q: [B, Hkv, G, D] queries grouped by KV head.
        tier: FullTier or Int8Tier.
        q_pos: [B] int32 query positions.
        scale: logit scale.
        block_k: slots per grid step (a multiple of 128 on TPU; default 512, capped at C).
        num_splits: accepted for API parity; TPU runs S = 1.
        return_logits: also return every read slot's scaled logits.
        interpret: run in the Pallas TPU interpreter (CPU tests).

    Returns:
        Partials with S = 1.
    """
    del num_splits
    check_query(q, q_pos)
    check_dense(tier, q)
    b, hkv, g, d = q.shape
    cap = tier.pos.shape[-1]
    bk = min(block_k or 512, cap)
    quantized = isinstance(tier, Int8Tier)
    steps = pl.cdiv(cap, bk)

    def blk(b_, h_, i, ext, qp):  # dead steps revisit the last live block: no new DMA
        return jnp.minimum(i, jnp.maximum(cdiv(ext[b_, h_], bk) - 1, 0))

    row = lambda *blk_shape: pl.BlockSpec(
        (None, None, *blk_shape), lambda b_, h_, i, ext, qp: (b_, h_, blk(b_, h_, i, ext, qp), 0)
    )
    lane = pl.BlockSpec(
        (None, None, 1, bk), lambda b_, h_, i, ext, qp: (b_, h_, 0, blk(b_, h_, i, ext, qp))
    )
    fixed = lambda *shape: pl.BlockSpec(
        (None, None, *shape), lambda b_, h_, i, ext, qp: (b_, h_) + (0,) * len(shape)
    )
    as_row = lambda x: x.reshape(b, hkv, 1, cap)
    arrays = [q, tier.k, tier.v, as_row(tier.pos)]
    in_specs = [fixed(g, d), row(bk, d), row(bk, d), lane]
    if quantized:
        arrays += [as_row(tier.k_scale), as_row(tier.v_scale)]
        in_specs += [lane, lane]
    out_shape = [
        jax.ShapeDtypeStruct((b, hkv, 1, g, d), jnp.float32),
        jax.ShapeDtypeStruct((b, hkv, 1, g, 1), jnp.float32),
    ]
    out_specs = [fixed(None, g, d), fixed(None, g, 1)]
    if return_logits:
        out_shape.append(jax.ShapeDtypeStruct((b, hkv, g, cap), jnp.float32))
        out_specs.append(
            pl.BlockSpec(
                (None, None, g, bk),
                lambda b_, h_, i, ext, qp: (b_, h_, 0, blk(b_, h_, i, ext, qp)),
            )
        )
    kernel = functools.partial(
        _kernel, quantized=quantized, scale=scale, block_k=bk, return_logits=return_logits
    )
    outs = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, hkv, steps),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=[
                pltpu.VMEM((g, 1), jnp.float32),
                pltpu.VMEM((g, 1), jnp.float32),
                pltpu.VMEM((g, d), jnp.float32),
            ],
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=(pltpu.PARALLEL, pltpu.PARALLEL, pltpu.ARBITRARY)
        ),
        interpret=interpret_params(interpret),
        name="kvjax_decode_int8_tpu" if quantized else "kvjax_decode_full_tpu",
    )(tier.extent, q_pos, *arrays)
    return Partials(outs[0], outs[1][..., 0], outs[2] if return_logits else None)
