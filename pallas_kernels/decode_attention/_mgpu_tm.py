"""Decode attention over the full-precision (bfloat16) or the INT8 tier with tokens on the wgmma
M axis: Pallas Mosaic GPU (Hopper, `plgpu`).

The dense counterpart of the low-bit kernel (`_mgpu_lowbit.py`): one CTA (one warpgroup) per
(sequence, KV head, split) walks its split's 64-slot blocks, and every operand of both dots
comes from shared memory as TMA wrote it, with no register conversion:

- QK: S [64 slots, N] = K·q^T, the block's keys [64, D] the A operand, q^T (the G query heads
  zero-padded to N = 8 columns, 16 when G > 8) the B operand.
- Online softmax along the slot axis (the max the block's one cross-warp reduction, the
  denominator a [64, N] tile summed after the loop), P stored transposed to shared memory.
- PV: out^T [D, N] = V^T·P, the block's values read transposed from shared memory (16-bit
  operands may be MN-major) as the A operand.

Nothing is padded to 64 query rows (the `_mgpu.py` kernels put the query heads on M). Keys,
values and positions stream by TMA `stages` blocks ahead, each block's three copies arriving on
one barrier. Needs bfloat16 q, keys and values, D a multiple of 64, G ≤ 16 and a capacity that
is a multiple of 64.

The INT8 tier (`Int8Tier`: int8 codes, one float32 scale a token) takes the same walk:

- QK: the block's key codes, loaded from shared memory into registers and converted to
  bfloat16 (exact), are the A operand against q^T; the logit scale and each slot's key scale
  multiply S after the dot.
- Each slot's value scale multiplies its probability; the value codes are converted to
  bfloat16 into one shared-memory tile (8-bit operands must be K-major, V^T is not), the PV
  dot's A operand read transposed as the dense kernel's.
- Any capacity of at least 64 slots: the last block starts at C − 64 (its rows before
  64·i were the previous block's: not attended again, their logits written again with the
  same values). The codes' shared-memory tiles are therefore untiled (a TMA copy into a
  tiled buffer needs its first row a multiple of the tile's 8), and the per-slot arrays
  (positions, scales) are read from global memory one block ahead into registers, not by TMA
  (a row of C four-byte values needs C a multiple of 4 to be a TMA operand, which the
  policies' INT8 capacities are not).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kvjax.pallas_kernels.decode_attention._mgpu import decode_grid, layer_arrays, smem_tile
from kvjax.pallas_kernels.decode_attention._tiers import FullTier, Int8Tier, Partials
from kvjax.pallas_kernels.decode_attention._tuning import num_splits as _num_splits
from kvjax.pallas_kernels.decode_attention._tuning import tuning_for
from kvjax.pallas_kernels.decode_attention._validate import check_dense, check_query

Array = jax.Array
BLOCK = 64  # slots a loop step: the M of a warpgroup dot
COLS = 16  # most query heads per KV head (the dots' N; 8 when G <= 8)
_NEG = -1e30


def mgpu_tm_applies(tier: FullTier | Int8Tier, q: Array) -> str | None:
    """Why the tokens-on-M Mosaic GPU kernel cannot run this (validated) tier (None if it
    can): a bfloat16 full tier of a capacity that is a multiple of 64, or an INT8 tier of at
    least 64 slots; bfloat16 q, D a multiple of 64, G ≤ 16 either way."""
    cap, d = tier.k.shape[2:]
    quantized = isinstance(tier, Int8Tier)
    if q.dtype != jnp.bfloat16 or (not quantized and tier.k.dtype != jnp.bfloat16):
        keys = "int8 codes" if quantized else f"keys {tier.k.dtype}"
        return f"q {q.dtype} and {keys} (needs a bfloat16 q and bfloat16 or INT8 keys)"
    if d % 64:
        return f"head dim {d} (needs a multiple of 64)"
    if q.shape[2] > COLS:
        return f"{q.shape[2]} query heads per KV head (at most {COLS})"
    if quantized and cap < BLOCK:
        return f"capacity {cap} (the INT8 tier needs at least {BLOCK} slots)"
    if not quantized and cap % BLOCK:
        return f"capacity {cap} (needs a multiple of {BLOCK})"
    return None


def _online_softmax(s: Array, m: Array, l: Array) -> tuple[Array, Array, Array, Array]:
    """One block's logits s [64, N] into the running max m [N] and the denominator tile l
    [64, N]: (p [64, N], m_new, l_new, the accumulator's rescale [N])."""
    m_new = jnp.maximum(m, s.max(axis=0))
    corr = jnp.exp(m - m_new)
    p = jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [1]))
    return p, m_new, l * lax.broadcast_in_dim(corr, s.shape, [1]) + p, corr


def _init_carry(d: int, cols: int) -> tuple[Array, Array, Array]:
    """(out^T accumulator [D, N], running max [N], denominator tile [64, N]) at the start."""
    col = plgpu.Layout.WGMMA.reduce(0)
    return (
        plgpu.layout_cast(jnp.zeros((d, cols), jnp.float32), plgpu.Layout.WGMMA),
        plgpu.layout_cast(jnp.full((cols,), _NEG, jnp.float32), col),
        plgpu.layout_cast(jnp.zeros((BLOCK, cols), jnp.float32), plgpu.Layout.WGMMA),
    )


def _finish(acc, m, l, o_ref, lse_ref, lse_smem, at) -> None:
    """The split's out^T and log-sum-exp (-inf where nothing was seen) to global memory."""
    l = l.sum(axis=0)
    has = l > 0
    safe = lax.broadcast_in_dim(jnp.where(has, l, 1.0), acc.shape, [1])
    lse_smem[...] = jnp.where(has, m + jnp.log(jnp.where(has, l, 1.0)), -jnp.inf)
    o_ref[at] = acc / safe
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[at])
    plgpu.wait_smem_to_gmem(0)


def _masked(s: Array, pos: Array, qpos: Array, idx: Array, extent: Array) -> Array:
    """A block's logits s [64, N], -inf on the slots not attended: no position, a future one,
    or past the extent (idx [64]: each row's slot)."""
    seen = (pos >= 0) & (pos <= qpos) & (idx < extent)
    return jnp.where(lax.broadcast_in_dim(seen, s.shape, [0]), s, -jnp.inf)


def _logit_rows(s: Array, s_smem, dst, rows: int) -> None:
    """A block's logits S [64, N] to `dst` [rows, 64], slot-minor: stored to s_smem as the
    dot left them, read back transposed one slot a thread (`rows` = G rounded up to even:
    that layout needs whole warpgroups)."""
    s_smem[...] = s
    plgpu.commit_smem()
    layout = plgpu.Layout.WG_STRIDED((rows, BLOCK), vec_size=1)
    dst[...] = plgpu.load(s_smem.T.at[pl.ds(0, rows)], layout=layout, optimized=False)


def _pv_step(acc: Array, corr: Array, vt, pt, d: int, cols: int) -> Array:
    """The accumulator out^T [D, N] rescaled by corr, plus the block's V^T·P' (vt [D, 64] and
    pt [64, N] in shared memory)."""

    def pv(o_ref_):
        plgpu.wgmma(o_ref_, vt, pt)
        return o_ref_[...]

    part = pl.run_scoped(pv, plgpu.ACC((d, cols), jnp.float32))
    return acc * lax.broadcast_in_dim(corr, part.shape, [1]) + part


def _split_range(layer_ref, extent_ref, qpos_ref, cap: int, num_splits: int):
    """This CTA's (b, h, layer, extent, query position, its split's first and last blocks,
    the head's block count): blocks of 64 slots up to the head's extent, split evenly."""
    b, h, split = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s")
    extent = jnp.minimum(extent_ref[b, h], cap)
    blocks = lax.div(extent + BLOCK - 1, BLOCK)
    per = lax.div(blocks + num_splits - 1, num_splits)
    first = split * per
    return b, h, layer_ref[0], extent, qpos_ref[b], first, jnp.minimum(first + per, blocks), blocks


def _kernel(
    layer_ref,  # [1] int32: the layer of the stacked arrays below (0 for one layer)
    extent_ref,  # [B, Hkv] int32
    qpos_ref,  # [B] int32
    q_ref,  # [B, Hkv, N, D] bf16: the G query heads, rows >= G zero
    k_ref,  # [L, B, Hkv, C, D] bf16 (L layers: a stacked cache's, or 1)
    v_ref,  # [L, B, Hkv, C, D] bf16
    pos_ref,  # [L, B, Hkv, C] int32
    o_ref,  # [B, Hkv, S, D, N] f32: out^T
    lse_ref,  # [B, Hkv, S, N] f32
    *refs,  # logits [B, Hkv, C, N] f32 (return_logits); then the scratch: q_smem [N, D];
    # k_smem, v_smem [stages, 64, D]; pos_smem [stages, 64] int32; p_smem [N, 64] bf16 (P^T,
    # K-major for the PV dot); lse_smem [N] f32; the barriers (q; one per stage)
    scale: float,
    stages: int,
    num_splits: int,
    return_logits: bool,
):
    logits_ref = refs[0] if return_logits else None
    q_smem, k_smem, v_smem, pos_smem, p_smem, lse_smem, q_bar, bars = refs[
        1 if return_logits else 0 :
    ]
    cap = k_ref.shape[3]
    cols, d = q_ref.shape[2:]
    b, h, lay, extent, qpos, first, last, _ = _split_range(
        layer_ref, extent_ref, qpos_ref, cap, num_splits
    )
    row = plgpu.Layout.WGMMA.reduce(1)  # a vector along the rows

    plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem, q_bar.at[0])

    def issue(i, slot, when):
        @pl.when(when)
        def _():
            blk = pl.ds(i * BLOCK, BLOCK)
            at = (lay, b, h, blk)
            plgpu.copy_gmem_to_smem(k_ref.at[at], k_smem.at[slot], bars.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[at], v_smem.at[slot], bars.at[slot])
            plgpu.copy_gmem_to_smem(pos_ref.at[at], pos_smem.at[slot], bars.at[slot])

    for j in range(stages):
        issue(first + j, j, first + j < last)
    plgpu.barrier_wait(q_bar.at[0])

    def step(i, carry):
        acc, m, l = carry
        slot = lax.rem(i - first, stages)
        plgpu.barrier_wait(bars.at[slot])

        def qk(s_ref):
            plgpu.wgmma(s_ref, k_smem.at[slot], q_smem.T)
            return s_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((BLOCK, cols), jnp.float32))
        pos = plgpu.load(pos_smem.at[slot], layout=row, optimized=True)
        idx = i * BLOCK + lax.broadcasted_iota(jnp.int32, (BLOCK,), 0)
        seen = (pos >= 0) & (pos <= qpos) & (idx < extent)
        s = jnp.where(lax.broadcast_in_dim(seen, s.shape, [0]), s * scale, -jnp.inf)
        if logits_ref is not None:  # the block's scaled logits, [64 slots, N]
            logits_ref[b, h, pl.ds(i * BLOCK, BLOCK)] = s
        p, m_new, l, corr = _online_softmax(s, m, l)
        p_smem.T[...] = p.astype(jnp.bfloat16)
        plgpu.commit_smem()

        def pv(o_ref_):
            plgpu.wgmma(o_ref_, v_smem.at[slot].T, p_smem.T)
            return o_ref_[...]

        part = pl.run_scoped(pv, plgpu.ACC((d, cols), jnp.float32))
        # The block is read (by the dots and the position load): refill its slot.
        plgpu.commit_smem()
        issue(i + stages, slot, i + stages < last)
        return acc * lax.broadcast_in_dim(corr, part.shape, [1]) + part, m_new, l

    acc, m, l = lax.fori_loop(first, last, step, _init_carry(d, cols))
    _finish(acc, m, l, o_ref, lse_ref, lse_smem, (b, h, lax.axis_index("s")))


def _kernel_int8(
    layer_ref,  # [1] int32: the layer of the stacked arrays below (0 for one layer)
    extent_ref,  # [B, Hkv] int32
    qpos_ref,  # [B] int32
    q_ref,  # [B, Hkv, N, D] bf16: the G query heads, rows >= G zero
    k_ref,  # [L, B, Hkv, C, D] int8
    v_ref,  # [L, B, Hkv, C, D] int8
    pos_ref,  # [L, B, Hkv, C] int32
    ks_ref,  # [L, B, Hkv, C] f32
    vs_ref,  # [L, B, Hkv, C] f32
    o_ref,  # [B, Hkv, S, D, N] f32: out^T
    lse_ref,  # [B, Hkv, S, N] f32
    *refs,  # logits [B, Hkv, G + G % 2, C] f32 (return_logits); then the scratch:
    # q_smem [N, D] bf16; k_smem, v_smem [stages, 64, D] int8 (untiled); vc_smem [64, D]
    # bf16 (the block's values converted); p_smem [N, 64] bf16 (P'^T); lse_smem [N] f32;
    # ka_smem [64, D] bf16 (the interpreter only: its wgmma reads the converted keys from
    # there); s_smem [64, N] f32 (return_logits: the block's logits on their way to [G, 64]
    # rows); the barriers (q; one per stage)
    scale: float,
    stages: int,
    num_splits: int,
    return_logits: bool,
    interpret: bool,
):
    logits_ref = refs[0] if return_logits else None
    q_smem, k_smem, v_smem, vc_smem, p_smem, lse_smem, *refs = refs[1 if return_logits else 0 :]
    ka_smem = refs.pop(0) if interpret else None
    s_smem = refs.pop(0) if return_logits else None
    group = logits_ref.shape[2] if return_logits else 0  # G rounded up to even
    q_bar, bars = refs
    cap = k_ref.shape[3]
    cols, d = q_ref.shape[2:]
    b, h, lay, extent, qpos, first, last, blocks = _split_range(
        layer_ref, extent_ref, qpos_ref, cap, num_splits
    )
    row = plgpu.Layout.WGMMA.reduce(1)  # a vector along the rows
    start = lambda i: jnp.minimum(i * BLOCK, cap - BLOCK)  # the last block ends at C

    plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem, q_bar.at[0])

    def issue(i, slot, when):
        @pl.when(when)
        def _():
            at = (lay, b, h, pl.ds(start(i), BLOCK))
            plgpu.copy_gmem_to_smem(k_ref.at[at], k_smem.at[slot], bars.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[at], v_smem.at[slot], bars.at[slot])

    def slot_rows(i):  # block i's positions and scales, from global memory
        at = (lay, b, h, pl.ds(start(i), BLOCK))
        return tuple(plgpu.load(r.at[at], layout=row, optimized=False)
                     for r in (pos_ref, ks_ref, vs_ref))  # fmt: skip

    for j in range(stages):
        issue(first + j, j, first + j < last)
    plgpu.barrier_wait(q_bar.at[0])

    def step(i, carry):
        acc, m, l, (pos, ks, vs) = carry
        ahead = slot_rows(jnp.minimum(i + 1, last - 1))  # in flight during this block
        slot = lax.rem(i - first, stages)
        plgpu.barrier_wait(bars.at[slot])

        keys = k_smem[slot].astype(jnp.bfloat16)  # [64, D], exact
        if ka_smem is not None:  # interpreted: the A operand from shared memory
            ka_smem[...] = keys
            plgpu.commit_smem()
            keys = ka_smem

        def qk(s_ref):
            plgpu.wgmma(s_ref, keys, q_smem.T)
            return s_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((BLOCK, cols), jnp.float32))
        vc_smem[...] = v_smem[slot].astype(jnp.bfloat16)
        # The slot's codes are read (the key load, the value conversion): refill it.
        plgpu.commit_smem()
        issue(i + stages, slot, i + stages < last)
        s = s * lax.broadcast_in_dim(ks * scale, s.shape, [0])
        idx = start(i) + lax.broadcasted_iota(jnp.int32, (BLOCK,), 0)
        s = _masked(s, pos, qpos, idx, extent)
        if logits_ref is not None:  # the block's scaled logits, slot-minor [G, 64]
            _logit_rows(s, s_smem, logits_ref.at[b, h, :, pl.ds(start(i), BLOCK)], group)
        fresh = lax.broadcast_in_dim(idx >= i * BLOCK, s.shape, [0])  # not the block before's
        p, m_new, l, corr = _online_softmax(jnp.where(fresh, s, -jnp.inf), m, l)
        p_smem.T[...] = (p * lax.broadcast_in_dim(vs, p.shape, [0])).astype(jnp.bfloat16)
        plgpu.commit_smem()
        acc = _pv_step(acc, corr, vc_smem.T, p_smem.T, d, cols)
        return acc, m_new, l, ahead

    init = (*_init_carry(d, cols), slot_rows(jnp.clip(first, 0, jnp.maximum(blocks - 1, 0))))
    acc, m, l, _ = lax.fori_loop(first, last, step, init)
    _finish(acc, m, l, o_ref, lse_ref, lse_smem, (b, h, lax.axis_index("s")))


@functools.partial(
    jax.jit, static_argnames=("scale", "num_splits", "stages", "return_logits", "interpret")
)
def decode_attention_mgpu_tm(
    q: Array,
    tier: FullTier | Int8Tier,
    q_pos: Array,
    *,
    scale: float,
    num_splits: int | None = None,
    stages: int | None = None,
    return_logits: bool = False,
    interpret: bool = False,
    layer: Array | None = None,
) -> Partials:
    """One decode query per sequence attending a bfloat16 full tier or an INT8 tier (Mosaic
    GPU, slots on M).

    Args:
        q: [B, Hkv, G, D] bfloat16 queries grouped by KV head (G <= 16, D % 64 == 0).
        tier: FullTier of bfloat16 keys and values, capacity a multiple of 64; or Int8Tier of
            any capacity >= 64.
        q_pos: [B] int32 query positions.
        scale: logit scale.
        num_splits: splits per (sequence, KV head); default fills the chip.
        stages: blocks in flight (TMA copies ahead of the dots); default from the Tuning.
        return_logits: also return the scaled logits of every slot, [B, Hkv, G, C] (slots at
            or past the extent undefined, as the other kernels').
        interpret: run in the Mosaic GPU interpreter (CPU tests).
        layer: None, or an int32 scalar: the tier's slot arrays are then stacks [L, ...] of a
            stacked cache, read at this layer in place (no slice of the stack is copied);
            `extent` is the layer's own [B, Hkv].

    Returns:
        Partials with out [B, Hkv, S, G, D], lse [B, Hkv, S, G] and, with return_logits,
        logits [B, Hkv, G, C].
    """
    check_query(q, q_pos)
    if not isinstance(tier, FullTier | Int8Tier):
        check_dense(tier, q)  # raises: names what was given
    quantized = isinstance(tier, Int8Tier)
    fields = ("k", "v", "pos", "k_scale", "v_scale") if quantized else ("k", "v", "pos")
    data = tuple(getattr(tier, f) for f in fields)
    view, data, lay = layer_arrays(tier, data, layer)
    check_dense(view, q)
    why = mgpu_tm_applies(view, q)
    if why:
        raise ValueError(f"decode attention (Mosaic GPU, slots on M): unsupported {why}")
    b, hkv, group, d = q.shape
    cap = view.k.shape[2]
    tune = tuning_for()
    blocks = -(-cap // BLOCK)
    stages = stages or (tune.mgpu_tm_int8_stages if quantized else tune.mgpu_tm_stages)
    stages = max(1, min(stages, blocks))
    target = tune.mgpu_tm_int8_target_programs if quantized else tune.mgpu_target_programs
    splits = num_splits or _num_splits(b, hkv, blocks, target, tune.mgpu_tm_split_min_blocks)
    cols = 8 if group <= 8 else COLS
    pad = ((0, 0), (0, 0), (0, cols - group))
    f32 = jnp.float32
    out_type = [
        jax.ShapeDtypeStruct((b, hkv, splits, d, cols), f32),
        jax.ShapeDtypeStruct((b, hkv, splits, cols), f32),
    ]
    # The INT8 kernel's logits rows are read back from shared memory in a layout of whole
    # warpgroups (rows × 64 a multiple of 128): an odd G writes one row more, sliced off here.
    rows = group + group % 2
    if return_logits:  # the INT8 kernel's [B, Hkv, G, C], the dense one's [B, Hkv, C, N]
        shape = (b, hkv, rows, cap) if quantized else (b, hkv, cap, cols)
        out_type.append(jax.ShapeDtypeStruct(shape, f32))
    arrays = (jnp.pad(q, (*pad, (0, 0))), *data)  # q [B, Hkv, N, D]
    scratch = [smem_tile((cols, d), jnp.bfloat16)]
    if quantized:  # untiled codes, the block's values converted; no positions by TMA
        codes = plgpu.SMEM((stages, BLOCK, d), jnp.int8)
        scratch += [codes, codes, smem_tile((BLOCK, d), jnp.bfloat16)]
        kernel = functools.partial(_kernel_int8, interpret=interpret)
        name = "kvjax_decode_int8_mgpu_tm"
    else:
        scratch += [smem_tile((stages, BLOCK, d), jnp.bfloat16)] * 2
        scratch.append(plgpu.SMEM((stages, BLOCK), jnp.int32))
        kernel, name = _kernel, "kvjax_decode_bf16_mgpu_tm"
    scratch += [smem_tile((cols, BLOCK), jnp.bfloat16), plgpu.SMEM((cols,), f32)]
    if quantized and interpret:
        scratch.append(smem_tile((BLOCK, d), jnp.bfloat16))
    if quantized and return_logits:  # the block's logits on their way to [G, 64] rows
        scratch.append(plgpu.SMEM((BLOCK, cols), f32))
    scratch += [
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_arrivals=2 if quantized else 3, num_barriers=stages),
    ]
    body = functools.partial(
        kernel, scale=scale, stages=stages, num_splits=splits, return_logits=return_logits
    )
    launch = decode_grid(body, out_type, scratch, (b, hkv, splits), name, interpret)
    o, lse, *lg = launch(lay, tier.extent, q_pos, *arrays)
    out = jnp.swapaxes(o, -1, -2)[..., :group, :]
    logits = None
    if return_logits and quantized:
        logits = lg[0] if rows == group else lg[0][:, :, :group]
    elif return_logits:  # [B, Hkv, C, N] -> [B, Hkv, G, C]
        logits = jnp.swapaxes(lg[0][..., :group], -1, -2)
    return Partials(out, lse[..., :group], logits)
