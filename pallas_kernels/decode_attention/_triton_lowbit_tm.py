"""The low-bit decode kernel with tokens on the QK dot's M axis (`tokens_m`): Pallas via Triton.

The stacked kernel (`_triton_lowbit._kernel_stacked`) computes the logits as s [Rp, T] =
q_s · K^T with the key codes as the dot's B operand. Here they are computed transposed, s^T
[T, Rp] = K [T, D] · q_s^T: a step's block_k tokens are the rows of the A operand, which Hopper's
wgmma reads from registers, so the unpacked codes go from their shared-memory stage straight
into the dot with no relayout, and each warp owns its own token rows. The query tile is the
stacked kernel's (row r = page r // G of a step, head r % G, its page's key statistics folded
into q) and its partials are unstacked the same way. The online softmax reduces along axis 0.
Values follow `_values` (per-token value scale on p, the PV dot on raw codes), except that the
Σ p·zero of every value group is one more small dot per step, p · zero-tile [T, NGp] into a
[Rp, NGp] accumulator, added to the output chunks once after the loop instead of one reduction
per group and step. Compiled, codes are converted two at a time (`unpack_pair_asm`), the pair
of consecutive operand elements a thread holds, so no bytes are repacked into words first.
Offline SASS counts: docs/lab/2026-12-01-lowbit-lean-loop.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax.pallas_kernels.decode_attention._triton import dot_f32, finish, store_rows
from kvjax.pallas_kernels.decode_attention._triton_lowbit import (
    _MAGIC,
    _NEG,
    stacked_loads,
    stacked_setup,
    unpack_tiles,
)

Array = jax.Array


def kernel_tokens_m(
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
):
    g = stacked_setup(extent_ref, qpos_ref, q_ref, k_ref, ks_ref, vs_ref, page, group, bits,
                      block_k, num_splits)  # fmt: skip
    parts, w, rp, npg = g.parts, g.w, g.rp, g.npg
    qpos, row_page, qk, col_page = g.qpos, g.row_page, g.qk, g.col_page
    ng = vs_ref.shape[-1]
    ngp = max(16, pl.next_power_of_2(ng))  # zero-tile columns (the dot wants >= 16)
    cdt = q_ref.dtype
    f32 = jnp.float32
    zcols = lax.broadcasted_iota(jnp.int32, (ngp,), 0)

    def step(it, carry):
        acc, zacc, m, l = carry
        ld = stacked_loads(g, it, pos_ref, k_ref, v_ref, ks_ref, kz_ref, vs_ref)
        rows, inb, pos, kp, vp, ks, kz, vs = ld
        start = pl.multiple_of(it * block_k, block_k)
        zt = plgpu.load(  # [T, NGp] every group's value zeros, zero-padded columns
            vz_ref.at[start + lax.broadcasted_iota(jnp.int32, (block_k,), 0)[:, None],
                      jnp.minimum(zcols, ng - 1)[None, :]],
            mask=inb[:, None] & (zcols < ng)[None, :], other=0,
        )  # fmt: skip
        st = jnp.zeros((block_k, rp), f32)
        zq = jnp.zeros((rp,), f32)
        for i, kt in enumerate(unpack_pairs(kp, bits, cdt, asm_unpack)):  # [T, sub] each
            zq = zq + jnp.sum(qk[i] * kz[i], axis=1)  # each row's q·zero
            st = st + dot_f32(kt, (qk[i] * ks[i]).astype(cdt), trans_b=True)  # [T, Rp]
        own = col_page[:, None] == row_page[None, :]  # a row attends its own page only
        seen = own & ((pos >= 0) & (pos <= qpos))[:, None]
        st = jnp.where(seen, (st + zq[None, :]) * scale, -jnp.inf)
        if return_logits:
            store_rows(logits_ref[0], st.T, npg * group, rows, inb)
        m_new = jnp.maximum(m, jnp.max(st, axis=0))
        corr = jnp.exp(m - m_new)
        pt = jnp.exp(st - m_new[None, :])  # [T, Rp]
        l = l * corr + jnp.sum(pt, axis=0)
        p = pt.T  # [Rp, T]
        zacc = zacc * corr[:, None] + dot_f32(p.astype(cdt), zt.astype(cdt), trans_b=False)
        vtiles = {j: unpack_pairs(vp[j], bits, cdt, asm_unpack) for j in g.js}
        new = []
        for a, vsc, (i, j, _, _) in zip(acc, vs, parts, strict=True):
            ps = (p * vsc.astype(f32)[None, :]).astype(cdt)
            new.append(a * corr[:, None] + dot_f32(ps, vtiles[j][i], trans_b=False))
        return new, zacc, m_new, l

    init = (
        [jnp.zeros((rp, w), f32) for _ in parts],
        jnp.zeros((rp, ngp), f32),
        jnp.full((rp,), _NEG, f32),
        jnp.zeros((rp,), f32),
    )
    acc, zacc, m, l = lax.fori_loop(g.first, g.last, step, init)
    # Σ p·zero of chunk c's group, once: column grp of the zero accumulator.
    col = lambda grp: jnp.sum(jnp.where((zcols == grp)[None, :], zacc, 0.0), axis=1)
    acc = [a + col(grp)[:, None] for a, (_, _, _, grp) in zip(acc, parts, strict=True)]
    finish(acc, m, l, o_ref, lse_ref, npg * group)


def unpack_pair_asm(bits: int, i: int, cdt) -> str:
    """PTX turning one 16-bit register of 2 packed bytes ($1) into sub-block i's 2 codes as one
    cdt pair ($0): a PRMT spreads the bytes to the halves, then a shift (sub-blocks after the
    first), one LOP3 ((x & mask) | magic) and one packed FMA (-magic). The pair is what one
    thread holds of a dot operand (2 consecutive elements), so no bytes are repacked first."""
    magic, one, neg, ty = _MAGIC[jnp.dtype(cdt)]
    pair = lambda x: f"0x{x:04X}{x:04X}"
    lines = [
        "{",
        ".reg .b32 t, zero, one, neg;",
        "mov.b32 zero, 0;",
        f"mov.b32 one, {pair(one)};",
        f"mov.b32 neg, {pair(neg)};",
        "cvt.u32.u16 t, $1;",
        "prmt.b32 t, t, zero, 0x4140;",
    ]
    if i:
        lines.append(f"shr.b32 t, t, {i * bits};")
    lines.append(f"lop3.b32 $0, t, {pair((1 << bits) - 1)}, {pair(magic)}, 0xEA;")
    lines.append(f"fma.rn.{ty} $0, $0, one, neg;")
    lines.append("}")
    return "\n".join(lines)


def unpack_pairs(packed: Array, bits: int, cdt, asm: bool) -> list[Array]:
    """`unpack_tiles` with `unpack_pair_asm` (2 codes per call) where asm applies."""
    if not asm:
        return unpack_tiles(packed, bits, cdt, False)
    out = jax.ShapeDtypeStruct(packed.shape, cdt)
    return [
        plgpu.elementwise_inline_asm(
            unpack_pair_asm(bits, i, cdt), args=[packed], constraints="=r,h", pack=2,
            result_shape_dtypes=[out],
        )[0]
        for i in range(8 // bits)
    ]  # fmt: skip
