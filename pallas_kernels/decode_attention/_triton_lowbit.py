"""Decode attention over the packed low-bit tier (2/4/8-bit pages): Pallas through Triton (GPU).

Codes are unpacked in registers with one shift and one mask per sub-block (kvjax.quant.pack's
layout: byte j holds channel j + i·D/n of sub-block i at bit offset i·bits). Keys are
dequantized in registers (code·scale + zero with the token's page statistics) before the QK dot;
for values the per-token scale multiplies the probabilities and the zero adds Σ p·zero to the
output, so the PV dot runs on raw codes. A loop step covers block_k tokens (several pages), so
the loads of a step are large enough to keep HBM busy and the online-softmax rescale is paid
once per block, not once per page.

`stack_pages` (the H200/H100 default since it was timed, docs/benchmarks.md) runs
`_kernel_stacked` instead, which puts a step's pages on the padding rows of the query tile and
folds each page's key statistics into its q row.

With `layer=` the tier's arrays are a layer stack (a layer scan's stacked cache) and whichever
kernel runs reads the layer in place (`_in_place`), as the dense Triton kernels do.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax.pallas_kernels._words import BYTE_OFFSETS
from kvjax.pallas_kernels.decode_attention._tiers import LowBitTier, Partials
from kvjax.pallas_kernels.decode_attention._triton import (
    dot_f32,
    finish,
    head_spec,
    launch,
    merge_layers,
    pad_group,
    rows_int8,
    split_range,
    stacked_rows,
    store_rows,
    whole_spec,
)
from kvjax.pallas_kernels.decode_attention._tuning import num_splits as _num_splits
from kvjax.pallas_kernels.decode_attention._tuning import tuning_for
from kvjax.pallas_kernels.decode_attention._validate import (
    check_lowbit,
    check_query,
    layer_view,
)

Array = jax.Array
_NEG = -1e30


def chunks(d: int, bits: int, num_groups: int) -> list[tuple[int, int, int, int]]:
    """(sub-block i, byte offset, first channel, value group) of every w-channel chunk, in
    channel order (chunk c starts at channel c·w).

    A chunk is w = min(D/n, D/NG) bytes of a packed row shifted by i·bits: channels
    [i·D/n + byte, +w), all inside one value group.
    """
    n = 8 // bits
    sub = d // n
    w = min(sub, d // num_groups)
    vg = d // num_groups
    return [(i, j, i * sub + j, (i * sub + j) // vg) for i in range(n) for j in range(0, sub, w)]


# Magic-number conversion: a code c OR-ed into the mantissa of MAGIC (the float whose ulp is 1)
# gives MAGIC + c exactly; one packed FMA then subtracts MAGIC from two values at once.
# (magic bits, 1.0, -magic) as 16-bit patterns, and the PTX packed type, per compute dtype.
_MAGIC = {
    jnp.dtype(jnp.bfloat16): (0x4300, 0x3F80, 0xC300, "bf16x2"),
    jnp.dtype(jnp.float16): (0x6400, 0x3C00, 0xE400, "f16x2"),
}


def unpack_asm(bits: int, i: int, cdt) -> str:
    """PTX turning one 32-bit register of 4 packed bytes ($2) into sub-block i's 4 codes as two
    cdt pairs ($0: codes of bytes 0, 1; $1: of bytes 2, 3).

    Two PRMTs spread the bytes to the low bytes of the 16-bit halves; then per output register a
    shift (sub-blocks after the first), one LOP3 ((x & mask) | magic) and one packed FMA
    (-magic): 6–8 instructions for 4 codes, where the jnp conversion spends a shift, a mask, an
    I2F and a pack per code. (One call per sub-block: JAX 0.11's lowering of this primitive
    returns one result only.)"""
    magic, one, neg, ty = _MAGIC[jnp.dtype(cdt)]
    pair = lambda x: f"0x{x:04X}{x:04X}"
    lines = [
        "{",
        ".reg .b32 t0, t1, one, neg, zero;",
        f"mov.b32 one, {pair(one)};",
        f"mov.b32 neg, {pair(neg)};",
        "mov.b32 zero, 0;",
        "prmt.b32 t0, $2, zero, 0x4140;",  # bytes 0, 1 → low bytes of the two halves
        "prmt.b32 t1, $2, zero, 0x4342;",  # bytes 2, 3
    ]
    if i:
        lines += [f"shr.b32 t0, t0, {i * bits};", f"shr.b32 t1, t1, {i * bits};"]
    for r, src in ((0, "t0"), (1, "t1")):  # LUT 0xEA = (a & b) | c
        lines.append(f"lop3.b32 ${r}, {src}, {pair((1 << bits) - 1)}, {pair(magic)}, 0xEA;")
        lines.append(f"fma.rn.{ty} ${r}, ${r}, one, neg;")
    lines.append("}")
    return "\n".join(lines)


def unpack_tiles(packed: Array, bits: int, cdt, asm: bool) -> list[Array]:
    """Every sub-block's codes of a packed uint8 tile [T, W] as cdt tiles [T, W] (sub-block i:
    (byte >> i·bits) & mask). asm: with `unpack_asm` for a bfloat16/float16 cdt, `unpack_int8_asm`
    for int8 (codes < 2^bits <= 16, held exactly) — compiled GPU kernels only, W % 4 == 0, bits
    2 or 4 — else with jnp shifts and a conversion."""
    n, mask = 8 // bits, (1 << bits) - 1
    if not asm:
        return [((packed >> (i * bits)) & mask).astype(cdt) for i in range(n)]
    if jnp.dtype(cdt) == jnp.int8:  # 4 codes: 1 register out
        program, constraints = (lambda i: unpack_int8_asm(bits, i)), "=r,r"
    else:  # 4 codes: 2 registers out
        program, constraints = (lambda i: unpack_asm(bits, i, cdt)), "=r,=r,r"
    out = jax.ShapeDtypeStruct(packed.shape, cdt)
    return [
        plgpu.elementwise_inline_asm(
            program(i), args=[packed], constraints=constraints, pack=4, result_shape_dtypes=[out],
        )[0]
        for i in range(n)
    ]  # fmt: skip


def unpack_int8_asm(bits: int, i: int) -> str:
    """PTX turning one 32-bit register of 4 packed bytes ($1) into sub-block i's 4 codes as 4
    int8 ($0): one shift (sub-blocks after the first) and one AND for 4 codes."""
    mask = (1 << bits) - 1
    word = f"0x{mask:02X}{mask:02X}{mask:02X}{mask:02X}"
    shift = [f"shr.b32 t, $1, {i * bits};"] if i else ["mov.b32 t, $1;"]
    return "\n".join(["{", ".reg .b32 t;", *shift, f"and.b32 $0, t, {word};", "}"])


def asm_unpack_applies(bits: int, cdt, widths) -> bool:
    """Whether `unpack_asm` can convert these codes: 2/4-bit codes into bfloat16/float16 tiles
    whose widths (packed bytes) are multiples of 4."""
    return bits in (2, 4) and jnp.dtype(cdt) in _MAGIC and all(w % 4 == 0 for w in widths)


def _values(acc, p, corr, vcodes, vs, vz, cdt):
    """acc·corr + p·V of every value chunk: vcodes(c) [T, w] chunk c's codes converted to the
    compute dtype cdt, vs/vz [T] its group's per-token statistics. The scale multiplies p and
    Σ p·zero is added, so the dot runs on the raw codes."""
    f32 = jnp.float32
    new = []
    for c, (a, vsc, vzc) in enumerate(zip(acc, vs, vz, strict=True)):
        ps = (p * vsc.astype(f32)[None, :]).astype(cdt)
        pv = dot_f32(ps, vcodes(c), trans_b=False)
        zero = jnp.sum(p * vzc.astype(f32)[None, :], axis=1)
        new.append(a * corr[:, None] + pv + zero[:, None])
    return new


def _run_and_store(first, last, step, parts, w: int, gp: int, o_ref, lse_ref, group: int):
    """Runs the online-softmax loop over [first, last) from empty accumulators (one [Gp, w] per
    channel chunk; chunk c holds channels [c·w, (c+1)·w)) and stores the normalized chunks and
    the lse."""
    init = (
        [jnp.zeros((gp, w), jnp.float32) for _ in parts],
        jnp.full((gp,), _NEG, jnp.float32),
        jnp.zeros((gp,), jnp.float32),
    )
    acc, m, l = lax.fori_loop(first, last, step, init)
    finish(acc, m, l, o_ref, lse_ref, group)


def _kernel(
    extent_ref,  # [] int32 one past the last attended page
    qpos_ref,  # [] int32
    q_ref,  # [Gp, D]
    k_ref,  # [P, Tp, Dp] uint8 packed key codes
    v_ref,  # [P, Tp, Dp] uint8 packed value codes
    ks_ref,  # [P, D] key scale per page and channel
    kz_ref,  # [P, D] key zero
    vs_ref,  # [N, NG] value scale per token and channel group, N = P·Tp in page order
    vz_ref,  # [N, NG] value zero
    pos_ref,  # [N] int32, -1 = not attended
    o_ref,  # [Gp, D] f32 (rows >= G never written)
    lse_ref,  # [Gp] f32
    *logits_ref,  # [Gp, N] f32 (return_logits; rows >= G never written)
    bits: int,
    scale: float,
    block_k: int,
    num_splits: int,
    group: int,
    return_logits: bool,
):
    pages, page, _ = k_ref.shape
    n_tok = pages * page
    npg = block_k // page  # pages per loop step
    gp, d = q_ref.shape
    ng = vs_ref.shape[-1]
    mask = (1 << bits) - 1
    parts = chunks(d, bits, ng)
    w = min(d * bits // 8, d // ng)  # channels per chunk
    cdt = q_ref.dtype
    qpos = qpos_ref[()]
    q = [q_ref[:, pl.ds(c0, w)] for _, _, c0, _ in parts]  # [Gp, w] each
    extent = jnp.minimum(extent_ref[()] * page, n_tok)  # in tokens
    first, last = split_range(extent, pl.cdiv(n_tok, block_k), block_k, num_splits)
    js = sorted({j for _, j, _, _ in parts})

    def codes(packed: Array, i: int) -> Array:
        return (packed >> (i * bits)) & mask  # [npg, Tp, w] uint8

    def step(it, carry):
        acc, m, l = carry
        start = pl.multiple_of(it * block_k, block_k)
        rows = pl.ds(start, block_k)
        tok = start + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        inb = tok < extent  # never load past the live extent
        pgs = pl.ds(it * npg, npg)
        pin = it * npg + lax.broadcasted_iota(jnp.int32, (npg,), 0) < pl.cdiv(extent, page)
        pin3 = pin[:, None, None]
        # Every load of the block is issued before the first use.
        pos = plgpu.load(pos_ref.at[rows], mask=inb, other=-1)
        kp = {j: plgpu.load(k_ref.at[pgs, :, pl.ds(j, w)], mask=pin3, other=0) for j in js}
        vp = {j: plgpu.load(v_ref.at[pgs, :, pl.ds(j, w)], mask=pin3, other=0) for j in js}
        stat = lambda ref, c0: plgpu.load(ref.at[pgs, pl.ds(c0, w)], mask=pin[:, None], other=0)
        ks = [stat(ks_ref, c0) for _, _, c0, _ in parts]  # [npg, w]
        kz = [stat(kz_ref, c0) for _, _, c0, _ in parts]
        grps = [jnp.int32(grp) for _, _, _, grp in parts]  # (the interpreter wants arrays)
        vs = [plgpu.load(vs_ref.at[rows, g], mask=inb, other=0) for g in grps]
        vz = [plgpu.load(vz_ref.at[rows, g], mask=inb, other=0) for g in grps]
        s = jnp.zeros((gp, block_k), jnp.float32)
        for qc, ksc, kzc, (i, j, _, _) in zip(q, ks, kz, parts, strict=True):
            # The key chunk, dequantized in registers with its page's statistics, then the
            # block's pages side by side as block_k rows.
            kd = codes(kp[j], i).astype(jnp.float32) * ksc.astype(jnp.float32)[:, None, :]
            kd = (kd + kzc.astype(jnp.float32)[:, None, :]).astype(cdt)
            s = s + dot_f32(qc, kd.reshape(block_k, w), trans_b=True)
        s = s * scale
        s = jnp.where(((pos >= 0) & (pos <= qpos))[None, :], s, -jnp.inf)
        if return_logits:
            store_rows(logits_ref[0], s, group, rows, inb)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        corr = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])  # [Gp, T]
        l = l * corr + jnp.sum(p, axis=1)

        def vcodes(c):  # [block_k, w]: the step's pages side by side
            i, j, _, _ = parts[c]
            return codes(vp[j], i).astype(cdt).reshape(block_k, w)

        return _values(acc, p, corr, vcodes, vs, vz, cdt), m_new, l

    _run_and_store(first, last, step, parts, w, gp, o_ref, lse_ref, group)


class Stacked(NamedTuple):
    """What the stacked kernels (`_kernel_stacked`, `kernel_tokens_m`) derive once from their
    refs: sizes, the value chunks, each query row's page j, the q sub-blocks [Rp, sub] (float32),
    the live extent in tokens and this program's loop range."""

    npg: int
    rp: int
    n: int
    sub: int
    parts: list
    w: int
    pages_total: int
    qpos: Array
    row_page: Array
    qk: list
    extent: Array
    n_pages: Array
    first: Array
    last: Array
    js: list
    grps: list
    col_page: Array
    sub_cols: Array
    block_k: int


def stacked_setup(
    extent_ref, qpos_ref, q_ref, k_ref, ks_ref, vs_ref, page, group, bits, block_k, num_splits
) -> Stacked:
    """`Stacked` of a program's refs (see `_kernel_stacked` for their shapes)."""
    n_tok, _ = k_ref.shape
    rp, d = q_ref.shape
    ng = vs_ref.shape[-1]
    n = 8 // bits
    sub = d // n  # channels per sub-block (= packed bytes per token)
    parts = chunks(d, bits, ng)  # value chunks, one per (sub-block, value group)
    extent = jnp.minimum(extent_ref[()] * page, n_tok)  # in tokens
    first, last = split_range(extent, pl.cdiv(n_tok, block_k), block_k, num_splits)
    return Stacked(
        npg=block_k // page,  # pages per loop step
        rp=rp,
        n=n,
        sub=sub,
        parts=parts,
        w=min(sub, d // ng),
        pages_total=ks_ref.shape[0],
        qpos=qpos_ref[()],
        row_page=lax.broadcasted_iota(jnp.int32, (rp,), 0) // group,  # j of every row
        qk=[q_ref[:, pl.ds(i * sub, sub)].astype(jnp.float32) for i in range(n)],  # [Rp, sub]
        extent=extent,
        n_pages=pl.cdiv(extent, page),
        first=first,
        last=last,
        js=sorted({j for _, j, _, _ in parts}),
        grps=[jnp.int32(grp) for _, _, _, grp in parts],  # (the interpreter wants arrays)
        col_page=lax.broadcasted_iota(jnp.int32, (block_k,), 0) // page,  # page of every token
        sub_cols=lax.broadcasted_iota(jnp.int32, (sub,), 0),
        block_k=block_k,
    )


def stacked_loads(g: Stacked, it, pos_ref, k_ref, v_ref, ks_ref, kz_ref, vs_ref):
    """Step it's loads, all issued before their first use: (rows, inb [T] in the live extent,
    pos [T], key codes [T, sub], value codes {byte offset j: [T, w]}, key scales and zeros of
    each row's page [Rp, sub] per sub-block (float32), value scales [T] per value chunk)."""
    start = pl.multiple_of(it * g.block_k, g.block_k)
    rows = pl.ds(start, g.block_k)
    inb = start + lax.broadcasted_iota(jnp.int32, (g.block_k,), 0) < g.extent
    prow = it * g.npg + g.row_page  # page of every query row in this step
    pin = (g.row_page < g.npg) & (prow < g.n_pages)
    prow = jnp.minimum(prow, g.pages_total - 1)
    pos = plgpu.load(pos_ref.at[rows], mask=inb, other=-1)
    kp = plgpu.load(k_ref.at[rows, :], mask=inb[:, None], other=0)  # [block_k, sub]
    vp = {j: plgpu.load(v_ref.at[rows, pl.ds(j, g.w)], mask=inb[:, None], other=0) for j in g.js}
    stat = lambda ref, i: plgpu.load(  # [Rp, sub]: each row's page statistics (a gather)
        ref.at[prow[:, None], i * g.sub + g.sub_cols[None, :]], mask=pin[:, None], other=0
    ).astype(jnp.float32)
    ks = [stat(ks_ref, i) for i in range(g.n)]
    kz = [stat(kz_ref, i) for i in range(g.n)]
    vs = [plgpu.load(vs_ref.at[rows, grp], mask=inb, other=0) for grp in g.grps]
    return rows, inb, pos, kp, vp, ks, kz, vs


def _kernel_stacked(
    extent_ref,  # [] int32 one past the last attended page
    qpos_ref,  # [] int32
    q_ref,  # [Rp, D] the G query rows repeated once per page of a step (row r: page r // G)
    k_ref,  # [N, Dp] uint8 packed key codes, N = P·Tp tokens in page order
    v_ref,  # [N, Dp] uint8 packed value codes
    ks_ref,  # [P, D] key scale per page and channel
    kz_ref,  # [P, D] key zero
    vs_ref,  # [N, NG] value scale per token and channel group
    vz_ref,  # [N, NG] value zero
    pos_ref,  # [N] int32, -1 = not attended
    o_ref,  # [Rp, D] f32 (rows >= npg·G never written)
    lse_ref,  # [Rp] f32
    *logits_ref,  # [Rp, N] f32 (return_logits; row r valid on its own page's tokens only)
    page: int,
    group: int,
    bits: int,
    scale: float,
    block_k: int,
    num_splits: int,
    return_logits: bool,
    asm_unpack: bool = False,
    int8_qk: bool = False,
):
    """The low-bit kernel with a step's pages stacked on the query rows.

    Row r = j·G + g of the (otherwise zero-padded) query tile is query head g attending page j
    of each step only, so every row is an independent online softmax over its own tokens and the
    rows are merged later like splits. Each row's page statistics fold into its q row
    (q⊙scale, and q·zero added to the logits): the QK dots run on raw codes straight from the
    flat code tile, with no per-code scaling and no [pages, Tp, w] relayout, in tensor-core rows
    that padding would otherwise waste.
    """
    g = stacked_setup(extent_ref, qpos_ref, q_ref, k_ref, ks_ref, vs_ref, page, group, bits,
                      block_k, num_splits)  # fmt: skip
    n, parts, w, rp = g.n, g.parts, g.w, g.rp
    cdt, qpos, row_page, qk, col_page = q_ref.dtype, g.qpos, g.row_page, g.qk, g.col_page

    def step(it, carry):
        acc, m, l = carry
        ld = stacked_loads(g, it, pos_ref, k_ref, v_ref, ks_ref, kz_ref, vs_ref)
        rows, inb, pos, kp, vp, ks, kz, vs = ld
        vz = [plgpu.load(vz_ref.at[rows, grp], mask=inb, other=0) for grp in g.grps]
        s = jnp.zeros((rp, block_k), jnp.float32)
        zq = sum(jnp.sum(qk[i] * kz[i], axis=1) for i in range(n))  # each row's q·zero
        qs = [qk[i] * ks[i] for i in range(n)]  # each row's page key scales on q
        if int8_qk:  # q⊙scale per row as int8 (|q8| <= 127), the codes as int8: s8 dots
            q8, q_scale = rows_int8(qs)
            ktiles = unpack_tiles(kp, bits, jnp.int8, asm_unpack)  # [block_k, sub] each
            for i in range(n):  # int32 sums, exact in float32 (127 · 15 · D < 2^24)
                s = s + dot_f32(q8[i], ktiles[i], trans_b=True).astype(jnp.float32)
            s = s * q_scale[:, None]
        else:
            ktiles = unpack_tiles(kp, bits, cdt, asm_unpack)  # [block_k, sub] per sub-block
            for i in range(n):
                s = s + dot_f32(qs[i].astype(cdt), ktiles[i], trans_b=True)
        s = (s + zq[:, None]) * scale
        own = col_page[None, :] == row_page[:, None]  # a row attends its own page only
        s = jnp.where(own & ((pos >= 0) & (pos <= qpos))[None, :], s, -jnp.inf)
        if return_logits:
            store_rows(logits_ref[0], s, g.npg * group, rows, inb)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        corr = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])  # [Rp, T]
        l = l * corr + jnp.sum(p, axis=1)

        vtiles = {j: unpack_tiles(vp[j], bits, cdt, asm_unpack) for j in g.js}

        def vcodes(c):
            i, j, _, _ = parts[c]
            return vtiles[j][i]

        return _values(acc, p, corr, vcodes, vs, vz, cdt), m_new, l

    _run_and_store(g.first, g.last, step, parts, w, rp, o_ref, lse_ref, g.npg * group)


def _in_place(*refs, body, batch: int):
    """`body` (any of the three kernels) over a layer stack: its seven slot refs (k, v, the four
    statistics, pos) are whole [L·B, Hkv, ...] stacks and the input ref after them holds the
    layer; the body gets them as views at (layer·B + sequence, KV head), so it reads that layer
    of the stack and nothing is sliced out of it."""
    head, slots, (layer_ref, *outs) = refs[:3], refs[3:10], refs[10:]
    body(*head, *stacked_rows(layer_ref, batch, *slots), *outs)


@functools.partial(
    jax.jit,
    static_argnames=(
        "bits",
        "scale",
        "block_k",
        "num_splits",
        "num_warps",
        "num_stages",
        "return_logits",
        "stack_pages",
        "asm_unpack",
        "tokens_m",
        "int8_qk",
        "interpret",
    ),
)
def decode_attention_lowbit_triton(
    q: Array,
    tier: LowBitTier,
    q_pos: Array,
    layer: Array | None = None,
    *,
    bits: int,
    scale: float,
    block_k: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    return_logits: bool = False,
    stack_pages: bool | None = None,
    asm_unpack: bool | None = None,
    tokens_m: bool | None = None,
    int8_qk: bool | None = None,
    interpret: bool = False,
) -> Partials:
    """One decode query per sequence attending the packed low-bit tier, block_k tokens per step.

    A step loads block_k/Tp whole pages (codes as [pages, Tp, w] tiles, their [pages, w] key
    statistics) and lays the pages side by side as block_k rows for the dots.

    Args:
        q: [B, Hkv, G, D] queries grouped by KV head, in the compute dtype.
        tier: the LowBitTier (extent counted in pages).
        q_pos: [B] int32 query positions.
        bits: code width, 2, 4 or 8.
        scale: logit scale.
        block_k: tokens per loop step, a power of 2 (default: the device's lowbit_block_k;
            at least one page).
        num_splits: splits S per (sequence, KV head); default fills the chip.
        num_warps, num_stages: Triton launch knobs; default from the device's Tuning.
        return_logits: also return the scaled logits of every read slot.
        stack_pages: run `_kernel_stacked` (a step's pages on the padded query rows, page
            statistics folded into q) instead of dequantizing keys in registers; default from
            the device's Tuning when no logits are returned, else off. Its default block_k is
            the most pages (≤ 2) whose G rows each fit the 16-row tile.
        asm_unpack: the stacked kernel converts codes with inline PTX (`unpack_asm`) instead of
            jnp shifts and conversions; default from the device's Tuning. Ignored where it does
            not apply: interpreted, unstacked, 8-bit codes, float32 queries (`asm_unpack_applies`).
        tokens_m: run `_triton_lowbit_tm.kernel_tokens_m` instead: the stacked kernel's query
            rows with the QK dot transposed (tokens on its M axis, the key codes its A operand);
            default from the device's Tuning when no logits are returned, else off; 2- and
            4-bit codes only (the default skips 8-bit ones). Excludes stack_pages=True; default
            block_k as stacked.
        int8_qk: the stacked kernel's QK on the tensor cores' int8 path: each query row's
            q⊙(page key scale) quantized to int8 per row (adds its rounding, ≤ max/254 per
            element, to the logits, as the INT8 tier's int8_qk), the 2/4-bit key codes unpacked
            to int8 (one shift and one AND per 4 codes with asm_unpack) instead of converted to
            the compute dtype. Stacked kernel, 2/4-bit codes only; default from the device's
            Tuning (off until timed).
        interpret: run in the Pallas interpreter (CPU tests).
        layer: None, or a traced int32 scalar: the tier's k, v, statistics and pos are then a
            stack [L, B, Hkv, ...] of L layers (extent stays this layer's [B, Hkv]) and the
            kernel reads layer `layer` in place, where slicing it out would copy it (a layer
            scan over a stacked cache). Not checked against L: the caller's loop index. The
            whole stack is indexed, so its codes must not be 2-4 GiB (`overflowing_codes`).

    Returns:
        Partials; logits are [B, Hkv, G, P·Tp].
    """
    check_query(q, q_pos)
    if not isinstance(tier, LowBitTier):
        check_lowbit(tier, q, bits)  # raises: names what was given
    view = tier if layer is None else layer_view(tier, layer)
    check_lowbit(view, q, bits)
    tune = tuning_for()
    b, hkv, group, d = q.shape
    pages, tp, dp = view.k.shape[2:]
    if tp & (tp - 1):
        raise ValueError(f"the Triton low-bit kernel needs a power-of-2 page size, got {tp}")
    name = overflowing_codes(tier)  # a stack: the whole stack's bytes are indexed
    if name:
        where, fix = "", "split the batch or the heads over calls"
        if layer is not None:
            where, fix = " in the layer stack", "read the layer's slice"
        raise ValueError(
            f"the Triton low-bit kernel cannot index LowBitTier.{name}: "
            f"{getattr(tier, name).size} bytes of codes{where} (2-4 GiB) overflow the 32-bit "
            f"offsets Pallas' Triton lowering uses for arrays up to 2^32 bytes; {fix}"
        )
    if layer is not None:  # [L, B, Hkv, ...] → [L·B, Hkv, ...] (free), read whole by the views
        tier = tier._replace(
            **{f: merge_layers(a) for f, a in tier._asdict().items() if f != "extent"}
        )
    # The stacked kernel writes a padded logit row per page of a step and the slots' rows are
    # then gathered: with logits it ran 2.5x slower inside a decode step (2026-12-01 trace).
    # tokens_m writes its logits as the stacked kernel does: by default only without logits.
    default_tm = tune.lowbit_tokens_m and not return_logits and bits < 8
    tm = default_tm if tokens_m is None else bool(tokens_m)
    if tm and stack_pages:
        raise ValueError("tokens_m and stack_pages are two different kernels: set one of them")
    if tm and bits == 8:
        raise ValueError("tokens_m needs 2- or 4-bit codes, got 8 (the stacked kernel takes them)")
    default_stack = tune.lowbit_stack_pages and not return_logits and not tm
    stack = default_stack if stack_pages is None else bool(stack_pages)
    if int8_qk and not stack:
        raise ValueError("int8_qk is a knob of the stacked low-bit kernel: set stack_pages=True")
    if int8_qk and bits == 8:
        raise ValueError("int8_qk needs 2- or 4-bit codes, got 8")
    # By default only for a bfloat16 q, whose own rounding is of the int8 rounding's size.
    on = stack and bits in tune.lowbit_int8_qk_bits and q.dtype == jnp.bfloat16
    i8 = on if int8_qk is None else bool(int8_qk)
    if (stack or tm) and block_k is None:
        block_k = stacked_block_k(tp, group, tune.lowbit_stacked_pages)
    block_k = max(block_k or tune.lowbit_block_k, tp)
    if block_k & (block_k - 1):
        raise ValueError(f"block_k must be a power of 2, got {block_k}")
    n_tok = pages * tp
    splits = num_splits or _num_splits(b, hkv, pl.cdiv(n_tok, block_k), tune.target_programs)
    # [P, Tp, ...] → [P·Tp, ...], free (the leading axis is B, or L·B for a stack)
    flat = lambda x: x.reshape(x.shape[0], hkv, n_tok, *x.shape[4:])
    npg = block_k // tp
    sub = d * bits // 8  # packed key bytes per token; value chunks as `chunks` cuts them
    widths = [sub, min(sub, d // tier.v_scale.shape[-1])]
    asm = tune.lowbit_asm_unpack if asm_unpack is None else bool(asm_unpack)
    asm = asm and not interpret and asm_unpack_applies(bits, q.dtype, widths)
    if stack or tm:  # the G rows once per page of a step
        from kvjax.pallas_kernels.decode_attention._triton_lowbit_tm import kernel_tokens_m

        qp = pad_group(jnp.tile(q, (1, 1, npg, 1)))
        codes = (flat(tier.k), flat(tier.v))
        kern = kernel_tokens_m if tm else _kernel_stacked
        extra = {} if tm else dict(int8_qk=i8)
        kernel = functools.partial(kern, page=tp, group=group, asm_unpack=asm, **extra)
    else:
        qp = pad_group(q)
        codes = (tier.k, tier.v)
        kernel = functools.partial(_kernel, group=group)
    arrays = [tier.extent, q_pos, qp, *codes, tier.k_scale, tier.k_zero]
    arrays += [flat(tier.v_scale), flat(tier.v_zero), flat(tier.pos)]
    specs = [head_spec(), pl.BlockSpec((None,), lambda i, j, s: (i,)), head_spec(*qp.shape[2:])]
    kernel = functools.partial(
        kernel,
        bits=bits,
        scale=scale,
        block_k=block_k,
        num_splits=splits,
        return_logits=return_logits,
    )
    if layer is None:
        specs += [head_spec(*x.shape[2:]) for x in arrays[3:]]
    else:  # the stacks whole, viewed at the layer; the layer as the last input
        specs += [whole_spec(x) for x in arrays[3:]]
        arrays.append(jnp.asarray(layer, jnp.int32))
        specs.append(pl.BlockSpec((), lambda *_: ()))
        kernel = functools.partial(_in_place, body=kernel, batch=b)
    res = launch(
        kernel,
        arrays,
        specs,
        qp,
        group=npg * group if stack or tm else group,
        splits=splits,
        slots=n_tok,
        return_logits=return_logits,
        warps=num_warps or tune.num_warps,
        stages=num_stages or tune.lowbit_num_stages,
        interpret=interpret,
        name=f"kvjax_decode_int{bits}",
    )
    return _unstack(res, npg, group, tp) if stack or tm else res


def overflowing_codes(tier: LowBitTier) -> str | None:
    """ "k" or "v" where that array of 1-byte codes (one layer's, or a whole layer stack) has
    2^31 to 2^32 bytes, which Pallas' Triton lowering indexes with 32-bit offsets that overflow
    (`kvjax.pallas_kernels._words`; it widens them only past 2^32 bytes); else None."""
    for name in ("k", "v"):
        if BYTE_OFFSETS <= getattr(tier, name).size <= 2 * BYTE_OFFSETS:
            return name
    return None


def stacked_block_k(page: int, group: int, max_pages: int) -> int:
    """The stacked kernel's default step: the most pages (a power of 2, at most `max_pages`,
    the device's `Tuning.lowbit_stacked_pages`) whose G query rows each fit the 16-row tile."""
    return page * min(max_pages, 1 << (max(1, 16 // group).bit_length() - 1))


def _unstack(res: Partials, npg: int, group: int, page: int) -> Partials:
    """Stacked rows (page j of a step, head g) → Partials of G heads: each page row is a split
    of its own, and a slot's logits are those of its page's row."""
    b, hkv, splits, _, d = res.out.shape
    out = res.out.reshape(b, hkv, splits * npg, group, d)
    lse = res.lse.reshape(b, hkv, splits * npg, group)
    logits = None
    if res.logits is not None:
        n = res.logits.shape[-1]
        rows = res.logits.reshape(b, hkv, npg, group, n)
        j = (jnp.arange(n, dtype=jnp.int32) // page) % npg  # the row block of every slot
        idx = jnp.broadcast_to(j[None, None, None, None, :], (b, hkv, 1, group, n))
        logits = jnp.take_along_axis(rows, idx, axis=2)[:, :, 0]
    return Partials(out, lse, logits)
