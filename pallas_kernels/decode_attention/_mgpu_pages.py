"""Decode attention over a token-major low-bit tier of 8-token pages (QEvict's windows) with
tokens on the wgmma M axis: Pallas Mosaic GPU (Hopper, `plgpu`).

The low-bit counterpart of the slots-on-M kernel (`_mgpu_tm.py`) for the `LowBitTier` the
policies write (`kvjax.quant.pack` codes, per-page per-channel key statistics, one value scale
and zero a token). One CTA (one warpgroup) per (sequence, KV head, split) walks its split's
64-token blocks, eight pages each:

- Key statistics, one row a token: a page's scale and zero hold for its 8 tokens, so a block's
  rows need eight different rows of statistics. The tensor cores broadcast them: E·scale and
  E·zero, E [64, 16] the constant one-hot of each token's page among 16 pages' statistics
  [16, D], the B operand (the block's 8 and the next block's 8, against E's zeros; past the
  end TMA's zeros); float32, exact.
- QK: S [64 tokens, N] = K·q^T with K = code·scale + zero dequantized in registers (each code
  slice one AND, the top slice's sign bit flipped first so that it converts linearly) and
  rounded to bfloat16: the A operand against q^T (the G query heads zero-padded to N = 8
  columns, 16 when G > 8).
- Online softmax along the token axis, as the INT8 tier's: each token's value scale multiplies
  its probability; the value codes, converted to bfloat16 (exact), are one shared-memory tile
  read transposed as the PV dot's A operand; each token's value zero adds up as Σ p·zero in a
  [64, N] tile summed after the loop.

Every array of a block (codes, statistics, positions) streams by TMA `stages` blocks ahead on
one barrier. Needs a bfloat16 q and bfloat16 statistics, 2- or 4-bit codes, 8-token pages, one
value group, D a multiple of 64, G ≤ 16 and a page count that is a multiple of 8 (TMA into
the statistics' tiled buffer needs the source's page axis a multiple of the tile's 8 rows:
compiled, 17 and 25 pages failed there, though the interpreter and the lowering on CPU
accepted them).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kvjax.pallas_kernels.decode_attention._mgpu import decode_grid, layer_arrays, smem_tile
from kvjax.pallas_kernels.decode_attention._mgpu_tm import (
    BLOCK,
    COLS,
    _finish,
    _init_carry,
    _logit_rows,
    _masked,
    _online_softmax,
    _pv_step,
    _split_range,
)
from kvjax.pallas_kernels.decode_attention._tiers import LowBitTier, Partials
from kvjax.pallas_kernels.decode_attention._tuning import num_splits as _num_splits
from kvjax.pallas_kernels.decode_attention._tuning import tuning_for
from kvjax.pallas_kernels.decode_attention._validate import check_lowbit, check_query

Array = jax.Array
PAGE_TOKENS = 8  # tokens a page (QEvict's window)
PAGES = BLOCK // PAGE_TOKENS  # pages a block
K_PAD = 16  # the statistics dot's K: pages of statistics copied a block


def pages_mgpu_applies(tier: LowBitTier, q: Array, bits: int) -> str | None:
    """Why the 8-token-page Mosaic GPU kernel cannot run this (validated, one layer's) tier
    (None if it can)."""
    pages, tp, _ = tier.k.shape[2:]
    d = q.shape[3]
    if q.dtype != jnp.bfloat16:
        return f"q {q.dtype} (needs bfloat16)"
    if bits not in (2, 4):
        return f"{bits}-bit codes (needs 2 or 4)"
    if tp != PAGE_TOKENS:
        return f"pages of {tp} tokens (needs {PAGE_TOKENS})"
    if tier.v_scale.shape[-1] != 1:
        return f"{tier.v_scale.shape[-1]} value groups (needs one a token)"
    stats = ("k_scale", "k_zero", "v_scale", "v_zero")
    if any(getattr(tier, f).dtype != jnp.bfloat16 for f in stats):
        kinds = ", ".join(f"{f} {getattr(tier, f).dtype}" for f in stats)
        return f"statistics {kinds} (needs bfloat16)"
    if d % 64:
        return f"head dim {d} (needs a multiple of 64)"
    if q.shape[2] > COLS:
        return f"{q.shape[2]} query heads per KV head (at most {COLS})"
    if pages % PAGES or not pages:
        # TMA into the statistics' tiled buffer needs the page axis a multiple of its tile's 8
        return f"{pages} pages (needs a positive multiple of {PAGES})"
    return None


def _codes(packed: Array, c: int, bits: int) -> Array:
    """Code slice c of packed bytes [64, W] as float32 codes (exact): one AND where it lies,
    converted through int8, scaled by 2^-(c·bits); the top slice's sign bit is flipped first
    so that its int8 value is 2^(c·bits)·code − 128 for every code."""
    shift = c * bits
    mask = ((1 << bits) - 1) << shift
    top = shift + bits == 8
    x = (packed ^ jnp.uint8(0x80)) if top else packed
    x = (x & jnp.uint8(mask)).astype(jnp.int8).astype(jnp.float32)
    if top:
        x = x + 128.0
    return x * (1.0 / (1 << shift)) if shift else x


def _kernel(
    layer_ref,  # [1] int32: the layer of the stacked arrays below (0 for one layer)
    extent_ref,  # [B, Hkv] int32: one past the last attended token (pages · 8)
    qpos_ref,  # [B] int32
    q_ref,  # [B, Hkv, N, D] bf16: the G query heads, rows >= G zero
    e_ref,  # [64, 16] bf16: E, row t one-hot at column t // 8
    k_ref,  # [L, B, Hkv, C, Dp] uint8 packed key codes (C = P · 8 tokens)
    v_ref,  # [L, B, Hkv, C, Dp] uint8
    ks_ref,  # [L, B, Hkv, P, D] bf16 key scale a page and channel
    kz_ref,  # [L, B, Hkv, P, D] bf16 key zero
    vs_ref,  # [L, B, Hkv, C] bf16 value scale a token
    vz_ref,  # [L, B, Hkv, C] bf16 value zero a token
    pos_ref,  # [L, B, Hkv, C] int32
    o_ref,  # [B, Hkv, S, D, N] f32: out^T
    lse_ref,  # [B, Hkv, S, N] f32
    *refs,  # logits [B, Hkv, G + G % 2, C] f32 (return_logits); then the scratch:
    # q_smem [N, D] bf16; e_smem [64, 16] bf16 (E); k_smem, v_smem [stages, 64, Dp]
    # uint8; ks_smem, kz_smem [stages, 16, D] bf16 (16 pages); vs_smem, vz_smem [stages, 64]
    # bf16; pos_smem [stages, 64] int32; vc_smem [64, D] bf16 (the value codes converted);
    # p_smem [N, 64] bf16 (P'^T); lse_smem [N] f32; ka_smem [64, D] bf16 (the interpreter
    # only: its wgmma reads the keys from there); s_smem [64, N] f32 (return_logits); the
    # barriers (q and E; one per stage)
    scale: float,
    bits: int,
    stages: int,
    num_splits: int,
    return_logits: bool,
    interpret: bool,
):
    logits_ref = refs[0] if return_logits else None
    (q_smem, e_smem, k_smem, v_smem, ks_smem, kz_smem, vs_smem, vz_smem, pos_smem, vc_smem,
     p_smem, lse_smem, *refs) = refs[1 if return_logits else 0 :]  # fmt: skip
    ka_smem = refs.pop(0) if interpret else None
    s_smem = refs.pop(0) if return_logits else None
    rows_g = logits_ref.shape[2] if return_logits else 0  # G rounded up to even
    q_bar, bars = refs
    cap = k_ref.shape[3]
    cols, d = q_ref.shape[2:]
    n_slices, width = 8 // bits, k_ref.shape[4]
    b, h, lay, extent, qpos, first, last, blocks = _split_range(
        layer_ref, extent_ref, qpos_ref, cap, num_splits
    )
    del blocks
    row = plgpu.Layout.WGMMA.reduce(1)  # a vector along the rows

    plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem, q_bar.at[0])
    plgpu.copy_gmem_to_smem(e_ref, e_smem, q_bar.at[0])

    def issue(i, slot, when):
        @pl.when(when)
        def _():
            at = (lay, b, h, pl.ds(i * BLOCK, BLOCK))
            # 16 pages from the block's first: the next block's 8 (zeros past P) are E's zeros
            pg = (lay, b, h, pl.ds(i * PAGES, K_PAD))
            bar = bars.at[slot]
            plgpu.copy_gmem_to_smem(k_ref.at[at], k_smem.at[slot], bar)
            plgpu.copy_gmem_to_smem(v_ref.at[at], v_smem.at[slot], bar)
            plgpu.copy_gmem_to_smem(ks_ref.at[pg], ks_smem.at[slot], bar)
            plgpu.copy_gmem_to_smem(kz_ref.at[pg], kz_smem.at[slot], bar)
            plgpu.copy_gmem_to_smem(vs_ref.at[at], vs_smem.at[slot], bar)
            plgpu.copy_gmem_to_smem(vz_ref.at[at], vz_smem.at[slot], bar)
            plgpu.copy_gmem_to_smem(pos_ref.at[at], pos_smem.at[slot], bar)

    for j in range(stages):
        issue(first + j, j, first + j < last)
    plgpu.barrier_wait(q_bar.at[0])

    def keys_of(slot):
        """The block's keys [64, D] bfloat16, dequantized: each 64-channel half's statistics
        broadcast to its tokens by E·scale, E·zero, then code·scale + zero a slice."""
        kc = k_smem[slot]  # [64, Dp] uint8
        half = 64
        out = []
        for hh in range(d // half):
            chans = pl.ds(hh * half, half)

            def stats(sc_ref, z_ref, chans=chans):
                plgpu.wgmma(sc_ref, e_smem, ks_smem.at[slot, :, chans])
                plgpu.wgmma(z_ref, e_smem, kz_smem.at[slot, :, chans])
                return sc_ref[...], z_ref[...]

            acc = plgpu.ACC((BLOCK, half), jnp.float32)
            sc, z = pl.run_scoped(stats, acc, acc)
            for c in range(n_slices):  # the slices inside this half
                lo = c * width
                if lo // half != hh:
                    continue
                at = slice(lo - hh * half, lo - hh * half + width)
                key = _codes(kc, c, bits) * sc[:, at] + z[:, at]
                out.append(key.astype(jnp.bfloat16))
        return jnp.concatenate(out, axis=1) if len(out) > 1 else out[0]

    def values_of(slot):
        """The block's value codes [64, D] as bfloat16 (exact)."""
        vc = v_smem[slot]
        out = [_codes(vc, c, bits).astype(jnp.bfloat16) for c in range(n_slices)]
        return jnp.concatenate(out, axis=1)

    def step(i, carry):
        acc, m, l, zt = carry
        slot = lax.rem(i - first, stages)
        plgpu.barrier_wait(bars.at[slot])
        keys = keys_of(slot)
        if ka_smem is not None:  # interpreted: the A operand from shared memory
            ka_smem[...] = keys
            plgpu.commit_smem()
            keys = ka_smem

        def qk(s_ref):
            plgpu.wgmma(s_ref, keys, q_smem.T)
            return s_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((BLOCK, cols), jnp.float32))
        vc_smem[...] = values_of(slot)
        pos = plgpu.load(pos_smem.at[slot], layout=row, optimized=True)
        vs = plgpu.load(vs_smem.at[slot], layout=row, optimized=True).astype(jnp.float32)
        vz = plgpu.load(vz_smem.at[slot], layout=row, optimized=True).astype(jnp.float32)
        # Every array of the slot is read (codes, statistics, per-token rows): refill it.
        plgpu.commit_smem()
        issue(i + stages, slot, i + stages < last)
        s = s * scale
        idx = i * BLOCK + lax.broadcasted_iota(jnp.int32, (BLOCK,), 0)
        s = _masked(s, pos, qpos, idx, extent)
        if logits_ref is not None:  # the block's scaled logits, slot-minor [G, 64]
            _logit_rows(s, s_smem, logits_ref.at[b, h, :, pl.ds(i * BLOCK, BLOCK)], rows_g)
        p, m_new, l, corr = _online_softmax(s, m, l)
        p_smem.T[...] = (p * lax.broadcast_in_dim(vs, p.shape, [0])).astype(jnp.bfloat16)
        zt = zt * lax.broadcast_in_dim(corr, zt.shape, [1]) + p * lax.broadcast_in_dim(
            vz, p.shape, [0]
        )
        plgpu.commit_smem()
        acc = _pv_step(acc, corr, vc_smem.T, p_smem.T, d, cols)
        return acc, m_new, l, zt

    acc0, m0, l0 = _init_carry(d, cols)
    acc, m, l, zt = lax.fori_loop(first, last, step, (acc0, m0, l0, l0))
    # Σ p·zero of the value zeros, one per column, added to every channel
    acc = acc + lax.broadcast_in_dim(zt.sum(axis=0), acc.shape, [1])
    _finish(acc, m, l, o_ref, lse_ref, lse_smem, (b, h, lax.axis_index("s")))


@functools.partial(
    jax.jit,
    static_argnames=("bits", "scale", "num_splits", "stages", "return_logits", "interpret"),
)
def decode_attention_pages_mgpu(
    q: Array,
    tier: LowBitTier,
    q_pos: Array,
    *,
    bits: int,
    scale: float,
    num_splits: int | None = None,
    stages: int | None = None,
    return_logits: bool = False,
    interpret: bool = False,
    layer: Array | None = None,
) -> Partials:
    """One decode query per sequence attending a token-major low-bit tier of 8-token pages
    (Mosaic GPU, tokens on M; `pages_mgpu_applies` says which tiers).

    Args:
        q: [B, Hkv, G, D] bfloat16 queries grouped by KV head (G <= 16, D % 64 == 0).
        tier: LowBitTier of 2- or 4-bit codes in pages of 8 tokens, a multiple of 8 pages,
            bfloat16 statistics, one value group.
        q_pos: [B] int32 query positions.
        bits: code width, 2 or 4.
        scale: logit scale.
        num_splits: splits per (sequence, KV head); default fills the chip.
        stages: blocks in flight (TMA copies ahead of the dots); default from the Tuning.
        return_logits: also return the scaled logits of every slot, [B, Hkv, G, P·8] (slots
            at or past the extent undefined, as the other kernels').
        interpret: run in the Mosaic GPU interpreter (CPU tests).
        layer: None, or an int32 scalar: the tier's arrays (all but extent) are then stacks
            [L, ...] of a stacked cache, read at this layer in place; `extent` is the layer's.

    Returns:
        Partials with out [B, Hkv, S, G, D], lse [B, Hkv, S, G] and, with return_logits,
        logits [B, Hkv, G, P·8].
    """
    check_query(q, q_pos)
    if not isinstance(tier, LowBitTier):
        check_lowbit(tier, q, bits)  # raises: names what was given
    fields = ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero", "pos")
    data = tuple(getattr(tier, f) for f in fields)
    view, data, lay = layer_arrays(tier, data, layer)
    check_lowbit(view, q, bits)
    why = pages_mgpu_applies(view, q, bits)
    if why:
        raise ValueError(f"decode attention (Mosaic GPU, 8-token pages): unsupported {why}")
    b, hkv, group, d = q.shape
    pages = view.k.shape[2]
    cap = pages * PAGE_TOKENS
    k, v, ks, kz, vs, vz, pos = data
    tokens = lambda a: a.reshape(*a.shape[:3], cap, *a.shape[5:])  # [.., P, 8, ..] -> [.., C, ..]
    k, v, pos = tokens(k), tokens(v), tokens(pos)
    vs, vz = tokens(vs)[..., 0], tokens(vz)[..., 0]
    tune = tuning_for()
    blocks = cap // BLOCK
    stages = max(1, min(stages or tune.mgpu_pages_stages, blocks))
    splits = num_splits or _num_splits(b, hkv, blocks, tune.mgpu_pages_target_programs)
    cols = 8 if group <= 8 else COLS
    f32 = jnp.float32
    rows = group + group % 2  # the logits' rows read back in whole warpgroups (see _mgpu_tm)
    out_type = [
        jax.ShapeDtypeStruct((b, hkv, splits, d, cols), f32),
        jax.ShapeDtypeStruct((b, hkv, splits, cols), f32),
    ]
    if return_logits:
        out_type.append(jax.ShapeDtypeStruct((b, hkv, rows, cap), f32))
    qp = jnp.pad(q, ((0, 0), (0, 0), (0, cols - group), (0, 0)))
    tok = jnp.arange(BLOCK)[:, None] // PAGE_TOKENS
    e = (tok == jnp.arange(K_PAD)[None, :]).astype(jnp.bfloat16)  # E: each token's page
    dp = k.shape[-1]
    # E's rows are 16 bfloat16s (32 bytes): the statistics, the B operand of its dot, take
    # the same tiling and swizzle, as an A operand in shared memory must.
    tiled_32b = (plgpu.TilingTransform((8, K_PAD)), plgpu.SwizzleTransform(32))
    stats_tile = plgpu.SMEM((stages, K_PAD, d), jnp.bfloat16, transforms=tiled_32b)
    scratch = [
        smem_tile((cols, d), jnp.bfloat16),
        smem_tile((BLOCK, K_PAD), jnp.bfloat16),
        plgpu.SMEM((stages, BLOCK, dp), jnp.uint8),
        plgpu.SMEM((stages, BLOCK, dp), jnp.uint8),
        stats_tile,
        stats_tile,
        plgpu.SMEM((stages, BLOCK), jnp.bfloat16),
        plgpu.SMEM((stages, BLOCK), jnp.bfloat16),
        plgpu.SMEM((stages, BLOCK), jnp.int32),
        smem_tile((BLOCK, d), jnp.bfloat16),
        smem_tile((cols, BLOCK), jnp.bfloat16),
        plgpu.SMEM((cols,), f32),
    ]
    if interpret:
        scratch.append(smem_tile((BLOCK, d), jnp.bfloat16))
    if return_logits:
        scratch.append(plgpu.SMEM((BLOCK, cols), f32))
    scratch += [
        plgpu.Barrier(num_arrivals=2, num_barriers=1),
        plgpu.Barrier(num_arrivals=7, num_barriers=stages),
    ]
    body = functools.partial(
        _kernel, scale=scale, bits=bits, stages=stages, num_splits=splits,
        return_logits=return_logits, interpret=interpret,
    )  # fmt: skip
    name = f"kvjax_decode_int{bits}_pages_mgpu"
    launch = decode_grid(body, out_type, scratch, (b, hkv, splits), name, interpret)
    extent = jnp.minimum(tier.extent, pages) * PAGE_TOKENS
    o, lse, *lg = launch(lay, extent, q_pos, qp, e, k, v, ks, kz, vs, vz, pos)
    out = jnp.swapaxes(o, -1, -2)[..., :group, :]
    logits = None
    if return_logits:
        logits = lg[0] if rows == group else lg[0][:, :, :group]
    return Partials(out, lse[..., :group], logits)
