"""The low-bit decode kernel with tokens on the dots' M axis (`tokens_m`): Pallas through Triton.

The other low-bit kernels (`_triton_lowbit.py`) put the 16-row query tile on M, so every token
tile is the B operand, and a step's dequantized codes and probabilities are exchanged through
shared memory between the warps. Here the logits are computed transposed, s^T [T, Gp] =
K_deq [T, D] · q^T: a step's block_k tokens are the rows of the A operand, each warp owns its
own token rows, the key codes are dequantized in registers in the layout the dot reads them
from (code·scale + zero with each token's page statistics), and q stays fixed across the loop.
The online softmax reduces along axis 0 (tokens); the values follow `_values` (the per-token
value scale on p, Σ p·zero added, the PV dot on raw codes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax.pallas_kernels.decode_attention._triton import dot_f32, split_range, store_rows
from kvjax.pallas_kernels.decode_attention._triton_lowbit import (
    _run_and_store,
    _values,
    chunks,
    unpack_tiles,
)

Array = jax.Array


def _fma_asm(cdt) -> str:
    """PTX of one packed fused multiply-add (a·b + c, one rounding) on two cdt values."""
    ty = "bf16x2" if jnp.dtype(cdt) == jnp.bfloat16 else "f16x2"
    return f"fma.rn.{ty} $0, $1, $2, $3;"


def dequant(codes: Array, scale: Array, zero: Array, asm: bool) -> Array:
    """codes·scale + zero of cdt tiles [T, w] (asm: one packed FMA per two values, compiled GPU
    kernels only; else in float32, rounded once to cdt)."""
    if asm:
        [out] = plgpu.elementwise_inline_asm(
            _fma_asm(codes.dtype), args=[codes, scale, zero], constraints="=r,r,r,r", pack=2,
            result_shape_dtypes=[jax.ShapeDtypeStruct(codes.shape, codes.dtype)],
        )  # fmt: skip
        return out
    f32 = jnp.float32
    return (codes.astype(f32) * scale.astype(f32) + zero.astype(f32)).astype(codes.dtype)


def kernel_tokens_m(
    extent_ref,  # [] int32 one past the last attended page
    qpos_ref,  # [] int32
    q_ref,  # [Gp, D]
    k_ref,  # [N, Dp] uint8 packed key codes, N = P·Tp tokens in page order
    v_ref,  # [N, Dp] uint8 packed value codes
    ks_ref,  # [P, D] key scale per page and channel
    kz_ref,  # [P, D] key zero
    vs_ref,  # [N, NG] value scale per token and channel group
    vz_ref,  # [N, NG] value zero
    pos_ref,  # [N] int32, -1 = not attended
    o_ref,  # [Gp, D] f32 (rows >= G never written)
    lse_ref,  # [Gp] f32
    *logits_ref,  # [Gp, N] f32 (return_logits; rows >= G never written)
    page: int,
    group: int,
    bits: int,
    scale: float,
    block_k: int,
    num_splits: int,
    return_logits: bool,
    asm_unpack: bool = False,
):
    n_tok, _ = k_ref.shape
    pages_total = ks_ref.shape[0]
    gp, d = q_ref.shape
    ng = vs_ref.shape[-1]
    n = 8 // bits
    sub = d // n  # channels per sub-block (= packed bytes per token)
    parts = chunks(d, bits, ng)  # value chunks, one per (sub-block, value group)
    w = min(sub, d // ng)
    cdt = q_ref.dtype
    qpos = qpos_ref[()]
    qk = [q_ref[:, pl.ds(i * sub, sub)] for i in range(n)]  # [Gp, sub], the dots' B operands
    extent = jnp.minimum(extent_ref[()] * page, n_tok)  # in tokens
    first, last = split_range(extent, pl.cdiv(n_tok, block_k), block_k, num_splits)
    js = sorted({j for _, j, _, _ in parts})
    grps = [jnp.int32(grp) for _, _, _, grp in parts]  # (the interpreter wants arrays)
    sub_cols = lax.broadcasted_iota(jnp.int32, (sub,), 0)

    def step(it, carry):
        acc, m, l = carry
        start = pl.multiple_of(it * block_k, block_k)
        rows = pl.ds(start, block_k)
        tok = start + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        inb = tok < extent
        prow = jnp.minimum(tok // page, pages_total - 1)[:, None]  # every token's page
        # Every load of the step is issued before the first use.
        pos = plgpu.load(pos_ref.at[rows], mask=inb, other=-1)
        kp = plgpu.load(k_ref.at[rows, :], mask=inb[:, None], other=0)  # [T, sub]
        vp = {j: plgpu.load(v_ref.at[rows, pl.ds(j, w)], mask=inb[:, None], other=0) for j in js}
        stat = lambda ref, i: plgpu.load(  # [T, sub]: each token's page statistics (a gather)
            ref.at[prow, i * sub + sub_cols[None, :]], mask=inb[:, None], other=0
        ).astype(cdt)
        ks = [stat(ks_ref, i) for i in range(n)]
        kz = [stat(kz_ref, i) for i in range(n)]
        vs = [plgpu.load(vs_ref.at[rows, g], mask=inb, other=0) for g in grps]
        vz = [plgpu.load(vz_ref.at[rows, g], mask=inb, other=0) for g in grps]
        ktiles = unpack_tiles(kp, bits, cdt, asm_unpack)  # [T, sub] per sub-block
        st = jnp.zeros((block_k, gp), jnp.float32)
        for i in range(n):
            kd = dequant(ktiles[i], ks[i], kz[i], asm_unpack)
            st = st + dot_f32(kd, qk[i], trans_b=True)  # [T, Gp]
        st = jnp.where(((pos >= 0) & (pos <= qpos))[:, None], st * scale, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(st, axis=0))
        corr = jnp.exp(m - m_new)
        pt = jnp.exp(st - m_new[None, :])  # [T, Gp]
        l = l * corr + jnp.sum(pt, axis=0)
        p = pt.T  # [Gp, T]
        if return_logits:
            store_rows(logits_ref[0], st.T, group, rows, inb)

        vtiles = {j: unpack_tiles(vp[j], bits, cdt, asm_unpack) for j in js}

        def vcodes(c):
            i, j, _, _ = parts[c]
            return vtiles[j][i]

        return _values(acc, p, corr, vcodes, vs, vz, cdt), m_new, l

    _run_and_store(first, last, step, parts, w, gp, o_ref, lse_ref, group)
