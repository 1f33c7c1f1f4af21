"""Decode attention over the full-precision or the INT8 tier: Pallas Mosaic GPU (Hopper, `plgpu`).

One CTA (one warpgroup) per (sequence, KV head, split) attends the G query heads of that KV head
over its split's share of the live blocks. Keys and values stream through shared memory with
TMA copies `stages` blocks ahead of the tensor cores (a software pipeline on mbarriers); QK and
PV are wgmma dots on the query tile padded to the 64 rows of a warpgroup dot, with the online
softmax in registers. The INT8 tier runs QK as an int8 × int8 → int32 wgmma on q quantized per
query head (outside, once per call) and the per-token key scale on the logits; value codes are
converted to the compute dtype in registers and written back to shared memory for the PV dot,
with the per-token value scale on the probabilities. Splits are combined outside (`combine`).

Contract and outputs are those of `_triton.decode_attention_triton` (`Partials`); capacities
must be a multiple of block_k (the dispatch falls back to Triton otherwise).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kvjax.pallas_kernels.decode_attention._tiers import FullTier, Int8Tier, Partials
from kvjax.pallas_kernels.decode_attention._tuning import num_splits as _num_splits
from kvjax.pallas_kernels.decode_attention._tuning import tuning_for
from kvjax.pallas_kernels.decode_attention._validate import check_dense, check_query, layer_view

Array = jax.Array
ROWS = 64  # rows of a warpgroup dot: the G query heads, zero-padded
_NEG = -1e30  # running-max floor: exp(-inf - _NEG) = 0 and never inf - inf
_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def smem_tile(shape: tuple[int, ...], dtype) -> plgpu.SMEM:
    """A shared-memory buffer of [..., R, W] tiles laid out for wgmma/TMA: (8, S) tiles, S bytes
    a tile row, with the S-byte swizzle, S the largest of 128/64/32 dividing a row's W·bits/8
    (sub-byte dtypes such as int4 by their bits)."""
    bits = jax.dtypes.itemsize_bits(dtype)
    swz = plgpu.find_swizzle(shape[-1] * bits)
    tr = (plgpu.TilingTransform((8, swz * 8 // bits)), plgpu.SwizzleTransform(swz))
    return plgpu.SMEM(shape, dtype, transforms=tr)


def layer_arrays(tier, data: tuple, layer):
    """(the tier's one-layer view for the checks, the arrays with a leading [L] axis, the
    layer index as an int32 [1]) for a Mosaic GPU kernel that reads stacks in place: with
    `layer`, the tier's arrays are already stacks [L, ...] read at it; without, one layer
    gets a free leading axis and index 0."""
    if layer is not None:  # checked as one layer of the stack
        return layer_view(tier, layer), data, jnp.reshape(layer, (1,)).astype(jnp.int32)
    return tier, tuple(a[None] for a in data), jnp.zeros((1,), jnp.int32)


def decode_grid(
    body,
    out_type,
    scratch,
    grid: tuple[int, int, int],
    name: str,
    interpret: bool,
    auto_barriers: bool = True,
):
    """The Mosaic GPU decode kernels' launch: one warpgroup a (sequence, KV head, split), grid
    axes named "b", "h", "s", approximate exp/log, the interpreter when asked.
    `auto_barriers=False`: Pallas inserts no warpgroup barrier around each shared-memory store
    and before each TMA copy (`unsafe_no_auto_barriers`); only for a kernel whose every
    shared-memory hazard is ordered by its own barriers (`commit_smem`, barrier waits)."""
    return plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch,
        grid=grid,
        grid_names=("b", "h", "s"),
        compiler_params=plgpu.CompilerParams(
            approx_math=True, unsafe_no_auto_barriers=not auto_barriers
        ),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
        kernel_name=name,
    )


def mgpu_applies(tier, q: Array, block_k: int) -> str | None:
    """Why the Mosaic GPU dense kernel cannot run this tier (None if it can)."""
    cap, d = tier.k.shape[-2:]
    if jnp.dtype(q.dtype) not in _HALF:
        return f"q dtype {q.dtype} (needs bfloat16 or float16)"
    if isinstance(tier, FullTier) and tier.k.dtype != q.dtype:
        return f"keys {tier.k.dtype} differ from q {q.dtype}"
    if isinstance(tier, Int8Tier) and q.dtype != jnp.bfloat16:
        # QK is an int8 dot on q quantized per head: a bfloat16 q's own rounding is of that
        # size, a float16 q would lose precision (the Triton kernel keeps it).
        return f"q dtype {q.dtype} for the INT8 tier (needs bfloat16)"
    if d % 64:
        return f"head dim {d} (needs a multiple of 64)"
    if q.shape[2] > ROWS:
        return f"{q.shape[2]} query heads per KV head (at most {ROWS})"
    if block_k < 64 or block_k % 64 or cap % block_k:
        return f"capacity {cap} is no multiple of block_k {block_k} (a multiple of 64)"
    return None


def _kernel(
    extent_ref,  # [B, Hkv] int32 GMEM
    qpos_ref,  # [B] int32 GMEM
    q_ref,  # [B, Hkv, 64, D] GMEM: queries (int8 codes for the INT8 tier), rows >= G zero
    k_ref,  # [B, Hkv, C, D] GMEM keys (float or int8 codes)
    v_ref,  # [B, Hkv, C, D] GMEM values
    pos_ref,  # [B, Hkv, C] int32 GMEM, -1 = empty
    *refs,  # INT8: qs_ref [B, Hkv, 64], ks_ref, vs_ref [B, Hkv, C] f32; outputs; scratch
    quantized: bool,
    scale: float,
    block_k: int,
    stages: int,
    num_splits: int,
    group: int,
    return_logits: bool,
    p_in_smem: bool,
    q_in_smem: bool,
    cdt,
):
    if quantized:
        qs_ref, ks_ref, vs_ref, *refs = refs
    o_ref, lse_ref, *refs = refs  # o [B, Hkv, S, 64, D] f32, lse [B, Hkv, S, 64] f32
    if return_logits:
        logits_ref, *refs = refs  # [B, Hkv, G, C] f32
    if q_in_smem:
        q_smem, *refs = refs  # [64, D]
    k_smem, v_smem, pos_smem, lse_smem, *refs = refs
    if quantized:
        ks_smem, vs_smem, *refs = refs  # [stages, T] f32 each
    if quantized:
        vc_smem, *refs = refs  # [T, D] cdt: the step's value codes converted
    if return_logits:
        s_smem, *refs = refs  # [64, T] f32
    p_smem = refs.pop(0) if p_in_smem else None  # [64, T] cdt
    q_bar, k_bar, v_bar, pos_bar, *stat_bars = refs
    b, h, split = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s")
    cap = k_ref.shape[2]
    t = block_k
    extent = jnp.minimum(extent_ref[b, h], cap)
    qpos = qpos_ref[b]
    n_blocks = lax.div(extent + t - 1, t)
    per = lax.div(n_blocks + num_splits - 1, num_splits)
    first = split * per
    last = jnp.minimum(first + per, n_blocks)
    col = plgpu.Layout.WGMMA.reduce(0)  # a [T] vector along the columns of a [64, T] tile
    row = plgpu.Layout.WGMMA.reduce(1)  # a [64] vector along the rows

    if q_in_smem:  # interpreted (its wgmma reads operands from shared memory), or int8 at D < 128
        plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem, q_bar.at[0])
        q_op = q_smem
    else:  # q as the A operand from registers: no shared memory, room for another CTA
        qlay = plgpu.Layout.WGMMA_8BIT if quantized else plgpu.Layout.WGMMA
        q_op = plgpu.load(q_ref.at[b, h], layout=qlay, optimized=False)

    def issue_k(i, slot, when):  # keys, positions and the per-token scales of block i
        @pl.when(when)
        def _():
            blk = pl.ds(i * t, t)
            plgpu.copy_gmem_to_smem(k_ref.at[b, h, blk], k_smem.at[slot], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(pos_ref.at[b, h, blk], pos_smem.at[slot], pos_bar.at[slot])
            if quantized:  # the per-token scales stream with their codes
                ks_bar, vs_bar = stat_bars
                plgpu.copy_gmem_to_smem(ks_ref.at[b, h, blk], ks_smem.at[slot], ks_bar.at[slot])
                plgpu.copy_gmem_to_smem(vs_ref.at[b, h, blk], vs_smem.at[slot], vs_bar.at[slot])

    def issue_v(i, slot, when):
        @pl.when(when)
        def _():
            blk = pl.ds(i * t, t)
            plgpu.copy_gmem_to_smem(v_ref.at[b, h, blk], v_smem.at[slot], v_bar.at[slot])

    for j in range(stages):
        issue_k(first + j, j, first + j < last)
        issue_v(first + j, j, first + j < last)
    if q_in_smem:
        plgpu.barrier_wait(q_bar.at[0])
    if quantized:
        q_scale = plgpu.load(qs_ref.at[b, h], layout=row, optimized=False)

    def step(i, carry):
        acc, m, l = carry
        slot = lax.rem(i - first, stages)
        blk = pl.ds(i * t, t)
        plgpu.barrier_wait(pos_bar.at[slot])
        pos = plgpu.load(pos_smem.at[slot], layout=col, optimized=False)
        if quantized:
            for bar in stat_bars:
                plgpu.barrier_wait(bar.at[slot])
            ks = plgpu.load(ks_smem.at[slot], layout=col, optimized=False)
            vs = plgpu.load(vs_smem.at[slot], layout=col, optimized=False)
        plgpu.barrier_wait(k_bar.at[slot])
        acc_t = jnp.int32 if quantized else jnp.float32

        def qk(s_ref):
            plgpu.wgmma(s_ref, q_op, k_smem.at[slot].T)
            return s_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((ROWS, t), acc_t))
        if quantized:
            s = s.astype(jnp.float32) * lax.broadcast_in_dim(q_scale, s.shape, [0])
            s = s * lax.broadcast_in_dim(ks * scale, s.shape, [1])
        else:
            s = s * scale
        # The slot's keys, positions and scales are read: once every thread is past its reads
        # (commit_smem: a proxy fence and a warpgroup barrier), refill it.
        plgpu.commit_smem()
        issue_k(i + stages, slot, i + stages < last)
        seen = (pos >= 0) & (pos <= qpos)
        s = jnp.where(lax.broadcast_in_dim(seen, s.shape, [1]), s, -jnp.inf)
        if return_logits:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            s_smem[...] = s
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(s_smem.at[pl.ds(0, group)], logits_ref.at[b, h, :, blk])
        m_new = jnp.maximum(m, s.max(axis=1))
        corr = jnp.exp(m - m_new)
        p = jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
        l = l * corr + p.sum(axis=1)
        if quantized:
            p = p * lax.broadcast_in_dim(vs, s.shape, [1])
        acc = acc * lax.broadcast_in_dim(corr, acc.shape, [0])
        plgpu.barrier_wait(v_bar.at[slot])
        if quantized:
            vc_smem[...] = v_smem[slot].astype(cdt)
            plgpu.commit_smem()
            issue_v(i + stages, slot, i + stages < last)  # the codes are converted
            v_op = vc_smem
        else:
            v_op = v_smem.at[slot]

        if p_smem is None:
            p_op = p.astype(cdt)  # the A operand from registers
        else:  # through shared memory (the interpreter's wgmma reads operands from there)
            p_smem[...] = p.astype(cdt)
            plgpu.commit_smem()
            p_op = p_smem

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p_op, v_op)
            return acc_ref[...]

        acc = acc + pl.run_scoped(pv, plgpu.ACC(acc.shape, jnp.float32))
        if not quantized:  # the dot has read the slot's values
            plgpu.commit_smem()
            issue_v(i + stages, slot, i + stages < last)
        return acc, m_new, l

    d = k_ref.shape[3]
    init = (
        plgpu.layout_cast(jnp.zeros((ROWS, d), jnp.float32), plgpu.Layout.WGMMA),
        plgpu.layout_cast(jnp.full((ROWS,), _NEG, jnp.float32), row),
        plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), row),
    )
    acc, m, l = lax.fori_loop(first, last, step, init)
    has = l > 0
    safe = jnp.where(has, l, 1.0)
    lse_smem[...] = jnp.where(has, m + jnp.log(safe), -jnp.inf)
    # Straight from registers into the padded [64, D] rows (no shared-memory staging: the
    # freed 32 KB fit another CTA on the multiprocessor); `partials` slices the G real rows.
    o_ref[b, h, split] = acc / lax.broadcast_in_dim(safe, acc.shape, [0])
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, split])
    plgpu.wait_smem_to_gmem(0)


def quantize_q(q: Array) -> tuple[Array, Array]:
    """Symmetric int8 codes of q per query head: (codes [..., D] int8, scale [...] f32)."""
    qf = q.astype(jnp.float32)
    qs = jnp.max(jnp.abs(qf), axis=-1) / 127.0
    qs = jnp.where(qs > 0, qs, 1.0)
    return jnp.floor(qf / qs[..., None] + 0.5).astype(jnp.int8), qs


@functools.partial(
    jax.jit,
    static_argnames=("scale", "block_k", "num_splits", "stages", "return_logits", "interpret"),
)
def decode_attention_mgpu(
    q: Array,
    tier: FullTier | Int8Tier,
    q_pos: Array,
    *,
    scale: float,
    block_k: int | None = None,
    num_splits: int | None = None,
    stages: int | None = None,
    return_logits: bool = False,
    interpret: bool = False,
) -> Partials:
    """One decode query per sequence attending one full-precision or INT8 tier (Mosaic GPU).

    Args:
        q: [B, Hkv, G, D] bfloat16/float16 queries grouped by KV head (G <= 64, D % 64 == 0).
        tier: FullTier (same dtype as q) or Int8Tier; capacity a multiple of block_k.
        q_pos: [B] int32 query positions.
        scale: logit scale.
        block_k: slots per pipeline step (a multiple of 64); default from the device's Tuning.
        num_splits: splits per (sequence, KV head); default fills the chip.
        stages: blocks in flight (TMA copies ahead of the dots); default from the Tuning.
        return_logits: also return every read slot's scaled logits.
        interpret: run in the Mosaic GPU interpreter (CPU tests).

    Returns:
        Partials with out [B, Hkv, S, G, D], lse [B, Hkv, S, G], logits [B, Hkv, G, C] or None.
    """
    check_query(q, q_pos)
    check_dense(tier, q)
    tune = tuning_for()
    block_k = block_k or tune.mgpu_block_k
    stages = stages or tune.mgpu_stages
    why = mgpu_applies(tier, q, block_k)
    if why:
        raise ValueError(f"decode attention (Mosaic GPU): unsupported {why}")
    quantized = isinstance(tier, Int8Tier)
    b, hkv, group, d = q.shape
    cap = tier.k.shape[2]
    n_blocks = cap // block_k
    splits = num_splits or _num_splits(b, hkv, n_blocks, tune.mgpu_target_programs)
    stages = max(1, min(stages, n_blocks))
    cdt = q.dtype
    pad = ((0, 0), (0, 0), (0, ROWS - group), (0, 0))
    arrays = [tier.extent, q_pos]
    if quantized:
        q8, qs = quantize_q(q)
        arrays += [jnp.pad(q8, pad), tier.k, tier.v, tier.pos]
        arrays += [jnp.pad(qs, pad[:3], constant_values=1.0), tier.k_scale, tier.v_scale]
    else:
        arrays += [jnp.pad(q, pad), tier.k, tier.v, tier.pos]
    f32 = jnp.float32
    out_type = [
        jax.ShapeDtypeStruct((b, hkv, splits, ROWS, d), f32),
        jax.ShapeDtypeStruct((b, hkv, splits, ROWS), f32),
    ]
    if return_logits:
        out_type.append(jax.ShapeDtypeStruct((b, hkv, group, cap), f32))
    kdt = tier.k.dtype
    # An int8 q from registers computed wrong QK at D = 64 (64-byte swizzle) on the H200 and
    # right at D = 128 (2026-12-01, docs/lab/2026-12-01-mosaic-kernels.md): int8 q at D < 128
    # stays in shared memory, as under the interpreter.
    q_in_smem = interpret or (quantized and d % 128 != 0)
    scratch = [smem_tile((ROWS, d), kdt)] if q_in_smem else []
    scratch += [
        smem_tile((stages, block_k, d), kdt),
        smem_tile((stages, block_k, d), kdt),
        plgpu.SMEM((stages, block_k), jnp.int32),
        plgpu.SMEM((ROWS,), f32),
    ]
    if quantized:
        scratch += [plgpu.SMEM((stages, block_k), f32)] * 2
    if quantized:
        scratch.append(smem_tile((block_k, d), cdt))
    if return_logits:
        scratch.append(plgpu.SMEM((ROWS, block_k), f32))
    if interpret:
        scratch.append(smem_tile((ROWS, block_k), cdt))
    n_bars = 5 if quantized else 3  # K, V, pos (and the two scales) per slot
    scratch += [plgpu.Barrier(num_barriers=1)] + [plgpu.Barrier(num_barriers=stages)] * n_bars
    body = functools.partial(
        _kernel,
        quantized=quantized,
        scale=scale,
        block_k=block_k,
        stages=stages,
        num_splits=splits,
        group=group,
        return_logits=return_logits,
        p_in_smem=interpret,
        q_in_smem=q_in_smem,
        cdt=cdt,
    )
    name = "kvjax_decode_int8_mgpu" if quantized else "kvjax_decode_full_mgpu"
    outs = decode_grid(body, out_type, scratch, (b, hkv, splits), name, interpret)(*arrays)
    logits = outs[2] if return_logits else None
    return Partials(outs[0][:, :, :, :group], outs[1][..., :group], logits)
