"""Decode attention over a pooled full-precision tier (head-adaptive budgets, `adakv`): Pallas
lowered through Triton (GPU), the Pallas interpreter on CPU.

A pool holds one layer's slots for all its KV heads, each slot carrying the KV head that owns it
(`PooledTier`). One program per (sequence, split) reads its share of the pool's live blocks ONCE
and scores them against every query head of the sequence (all Hkv·G rows, padded to 16 for the
tensor cores); a row sees only the slots its KV head owns (the owner id is loaded with the
positions). The bytes read are the live pool's K/V plus 8 bytes a slot (position and owner), as
the per-head kernel reads its slots' K/V plus 4; the logits cost Hkv times the per-head FLOPs,
which a memory-bound decode step hides (docs/decisions.md, "a pool through one kernel").
The kernel body is `_triton._kernel` with `pool_group` = G.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl

from kvjax.pallas_kernels.decode_attention import _triton as tr
from kvjax.pallas_kernels.decode_attention._tiers import Partials, PooledTier
from kvjax.pallas_kernels.decode_attention._tuning import num_splits as _num_splits
from kvjax.pallas_kernels.decode_attention._tuning import tuning_for
from kvjax.pallas_kernels.decode_attention._validate import check_pooled, check_query

Array = jax.Array


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "block_k",
        "num_splits",
        "num_warps",
        "num_stages",
        "return_logits",
        "interpret",
    ),
)
def decode_attention_pooled_triton(
    q: Array,
    tier: PooledTier,
    q_pos: Array,
    *,
    scale: float,
    block_k: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    return_logits: bool = False,
    interpret: bool = False,
) -> Partials:
    """One decode query per sequence attending a pooled tier, each KV head its own slots.

    Args:
        q: [B, Hkv, G, D] queries (after RoPE) grouped by KV head, in the compute dtype.
        tier: PooledTier of the layer (Hkv = q's KV heads; owner ids outside [0, Hkv) match
            no query head).
        q_pos: [B] int32 query positions (slots with pos > q_pos are masked).
        scale: logit scale.
        block_k: pool slots per loop step (power of 2); default from the device's Tuning.
        num_splits: splits S per sequence; default fills the chip.
        num_warps, num_stages: Triton launch knobs; default from the device's Tuning.
        return_logits: also return every read slot's scaled logits (for the attention mass).
        interpret: run the kernel in the Pallas interpreter (CPU tests).

    Returns:
        Partials with out [B, Hkv, S, G, D], lse [B, Hkv, S, G] (each split's attention of each
        query head over its own KV head's slots in that split) and logits [B, Hkv, G, P]
        (-inf on the slots other KV heads own; arbitrary past the extent) or None.
    """
    b, hkv, group, d = check_query(q, q_pos)
    check_pooled(tier, q)
    tune = tuning_for()
    block_k = block_k or tune.block_k
    cap = tier.pos.shape[-1]
    splits = num_splits or _num_splits(b, 1, pl.cdiv(cap, block_k), tune.target_programs)
    rows = hkv * group
    qp = tr.pad_group(q.reshape(b, 1, rows, d))  # [B, 1, Rp, D]: every query head a row
    arrays = [tier.extent, q_pos, qp, tier.k, tier.v, tier.pos, tier.head]
    specs = [
        tr.head_spec(),
        pl.BlockSpec((None,), lambda i, j, s: (i,)),
        tr.head_spec(*qp.shape[2:]),
        tr.head_spec(*tier.k.shape[2:]),
        tr.head_spec(*tier.v.shape[2:]),
        tr.head_spec(cap),
        tr.head_spec(cap),
    ]
    kernel = functools.partial(
        tr._kernel,
        quantized=False,
        int8_qk=False,
        v_words=False,
        scale=scale,
        block_k=block_k,
        num_splits=splits,
        group=rows,
        return_logits=return_logits,
        pool_group=group,
    )
    res = tr.launch(
        kernel,
        arrays,
        specs,
        qp,
        group=rows,
        splits=splits,
        slots=cap,
        return_logits=return_logits,
        warps=num_warps or tune.num_warps,
        stages=num_stages or tune.num_stages,
        interpret=interpret,
        name="kvjax_decode_pooled",
    )
    # [B, 1, S, Hkv·G, ...] → [B, Hkv, S, G, ...]: rows r = h·G + g.
    out = res.out.reshape(b, splits, hkv, group, d).transpose(0, 2, 1, 3, 4)
    lse = res.lse.reshape(b, splits, hkv, group).transpose(0, 2, 1, 3)
    logits = res.logits.reshape(b, hkv, group, cap) if return_logits else None
    return Partials(out, lse, logits)
