"""Decode attention over the full-precision or the INT8 tier: Pallas lowered through Triton (GPU).

One program per (sequence, KV head, split) attends all G query heads of that KV head (padded to
16 rows for the tensor cores) over the split's share of the blocks before the live extent:
blockwise online softmax, K/V read once, INT8 codes converted in registers with the per-token K
scale applied to the logits and the V scale to the probabilities; with `int8_qk` the INT8 kernel
instead quantizes q per query head once and runs QK as an int8 × int8 → int32 dot, so key codes
are never converted. Splits are combined outside (`combine`). Pallas' Triton lowering is
deprecated since JAX 0.11 (docs/decisions.md says why it is still our first GPU backend).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax.pallas_kernels._words import BYTE_OFFSETS, as_words
from kvjax.pallas_kernels.decode_attention._tiers import FullTier, Int8Tier, Partials
from kvjax.pallas_kernels.decode_attention._tuning import num_splits as _num_splits
from kvjax.pallas_kernels.decode_attention._tuning import tuning_for
from kvjax.pallas_kernels.decode_attention._validate import check_dense, check_query, layer_view

Array = jax.Array
_NEG = -1e30  # running-max floor: exp(-inf - _NEG) = 0 and never inf - inf


def rows_int8(parts: list[Array]) -> tuple[list[Array], Array]:
    """Symmetric int8 of float32 tiles [R, w_j] that together make each row: one scale per row
    over all parts, part_j ≈ scale[:, None] · q8_j with |q8_j| <= 127 (round half up).
    Returns (q8 per part, scale [R])."""
    scale = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(x), axis=1) for x in parts])
    scale = jnp.where(scale > 0, scale / 127.0, 1.0)
    return [jnp.floor(x / scale[:, None] + 0.5).astype(jnp.int8) for x in parts], scale


def dot_f32(a: Array, b: Array, *, trans_b: bool) -> Array:
    """a [M, K] · b ([N, K] if trans_b else [K, N]) in float32 (no TF32 for float32 inputs).

    Tensor-core dots need every dim >= 16; smaller (test-sized) shapes multiply and reduce.
    """
    n_dims = (*a.shape, b.shape[0] if trans_b else b.shape[1])
    if min(n_dims) < 16:
        af, bf = a.astype(jnp.float32), b.astype(jnp.float32)
        if trans_b:
            return jnp.sum(af[:, None, :] * bf[None, :, :], axis=2)
        return jnp.sum(af[:, :, None] * bf[None, :, :], axis=1)
    tf32 = False if a.dtype == jnp.float32 else None
    return plgpu.dot(a, b, trans_b=trans_b, allow_tf32=tf32)


def store_rows(ref, x: Array, group: int, cols=slice(None), col_mask: Array | None = None) -> None:
    """Stores x [Gp, N] into ref [Gp, ...] at `cols`; rows >= group (padding) are masked off,
    so they are never written and cost no bytes."""
    mask = lax.broadcasted_iota(jnp.int32, x.shape, 0) < group
    if col_mask is not None:
        mask = mask & col_mask[None, :]
    plgpu.store(ref.at[:, cols], x, mask=mask)


def split_range(extent: Array, num_blocks_cap: int, block: int, num_splits: int):
    """[first, last) loop steps of this program's split: the live blocks shared evenly."""
    n_blocks = jnp.minimum(pl.cdiv(extent, block), num_blocks_cap)
    per_split = pl.cdiv(n_blocks, num_splits)
    first = pl.program_id(2) * per_split
    return first, jnp.minimum(first + per_split, n_blocks)


def finish(o: Array | list[Array], m: Array, l: Array, o_ref, lse_ref, group: int) -> None:
    """Normalizes the split's accumulators and stores out [G, D] and lse [Gp]; o is [Gp, D] or
    a list of [Gp, w] chunks stored side by side (normalized by one reciprocal)."""
    has = l > 0
    lse_ref[...] = jnp.where(has, m + jnp.log(jnp.where(has, l, 1.0)), -jnp.inf)
    if not isinstance(o, list):
        store_rows(o_ref, o / jnp.where(has, l, 1.0)[:, None], group)
        return
    inv = 1.0 / jnp.where(has, l, 1.0)
    w = o[0].shape[1]
    for c, oc in enumerate(o):
        store_rows(o_ref, oc * inv[:, None], group, pl.ds(c * w, w))


class _Lead:
    """ref[lead] (leading scalar indices) for Triton's lowering, which takes one indexer per
    load: `view.at[ix]` is `ref.at[(*lead, *ix)]`, `view.shape` the trailing axes."""

    def __init__(self, ref, lead: tuple):
        self.ref, self.lead = ref, lead

    @property
    def shape(self) -> tuple[int, ...]:
        return self.ref.shape[len(self.lead) :]

    @property
    def dtype(self):
        return self.ref.dtype

    @property
    def at(self):
        return self

    def __getitem__(self, ix):
        ix = ix if isinstance(ix, tuple) else (ix,)
        return self.ref.at[(*self.lead, *ix)]


def merge_layers(x: Array) -> Array:
    """A stack [L, B, Hkv, ...] as [L·B, Hkv, ...] (a free reshape), for `stacked_rows`."""
    return x.reshape(-1, *x.shape[2:])


def whole_spec(x: Array) -> pl.BlockSpec:
    """The whole array as every program's block (a stack that `stacked_rows` views index)."""
    return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


def stacked_rows(layer_ref, batch: int, *refs):
    """Views of stacked [L·B, Hkv, ...] refs at this program's (layer·B + sequence, KV head)."""
    lead = (layer_ref[()] * batch + pl.program_id(0), pl.program_id(1))
    return [_Lead(r, lead) for r in refs]


def _kernel(
    extent_ref,  # [] int32 one past the last occupied slot of this (sequence, KV head)
    qpos_ref,  # [] int32 position of the query
    q_ref,  # [Gp, D] queries of the KV head's group, rows >= G zero
    k_ref,  # [C, D] keys (float or int8 codes), or [C, D/2] int16 pairs of codes (k_pairs)
    v_ref,  # [C, D] values (float or int8 codes), or [C, D/4] int32 words of 4 codes (v_words)
    pos_ref,  # [C] int32, -1 = empty
    *refs,  # pooled: head_ref [C] int32; INT8: ks_ref, vs_ref [C] f32; then o_ref [Gp, D],
    # lse_ref [Gp], logits_ref [Gp, C]?
    quantized: bool,
    int8_qk: bool,
    v_words: bool,
    scale: float,
    block_k: int,
    num_splits: int,
    group: int,
    return_logits: bool,
    pool_group: int = 0,
    stacked_batch: int = 0,
    k_pairs: bool = False,
    rows: int = 0,
):
    # pool_group > 0: the slots are a pool shared by KV heads (`_triton_pooled.py`), q holds
    # every query head, row r belongs to KV head r // pool_group and sees only that head's slots.
    # stacked_batch = B > 0: the slot arrays are a layer stack [L·B, Hkv, ...] and a last input
    # ref holds the layer to read (a layer scan hands the stack over without slicing it).
    if pool_group:
        head_ref, *refs = refs
    if quantized:
        ks_ref, vs_ref, *refs = refs
    if stacked_batch:
        layer_ref, *refs = refs
        k_ref, v_ref, pos_ref = stacked_rows(layer_ref, stacked_batch, k_ref, v_ref, pos_ref)
        if quantized:
            ks_ref, vs_ref = stacked_rows(layer_ref, stacked_batch, ks_ref, vs_ref)
    o_ref, lse_ref, *logits_ref = refs
    cap = k_ref.shape[0]
    gp, d = q_ref.shape
    qpos = qpos_ref[()]
    cdt = q_ref.dtype if quantized else k_ref.dtype
    # k_pairs: q's channels come ordered [even | odd], each half dotted with one byte of the pairs
    cols = (pl.ds(0, d // 2), pl.ds(d // 2, d // 2)) if k_pairs else (slice(None),)
    if rows > gp:  # q's G rows as given (no pad before the launch): Gp rows, the rest zero
        w = d // len(cols)
        real = lax.broadcasted_iota(jnp.int32, (rows, w), 0) < gp
        halves = tuple(plgpu.load(q_ref.at[pl.ds(0, rows), c], mask=real, other=0) for c in cols)
        gp = rows
    else:
        halves = tuple(q_ref[:, c] for c in cols)
    if int8_qk:  # symmetric per query head: q ≈ q_scale · q8, |q8| <= 127
        qs, q_scale = rows_int8([h.astype(jnp.float32) for h in halves])
    else:
        qs = [h.astype(cdt) for h in halves]
    extent = jnp.minimum(extent_ref[()], cap)
    first, last = split_range(extent, pl.cdiv(cap, block_k), block_k, num_splits)

    def step(i, carry):
        o, m, l = carry
        start = pl.multiple_of(i * block_k, block_k)
        rows = pl.ds(start, block_k)
        inb = start + jnp.arange(block_k, dtype=jnp.int32) < extent  # never load past it
        pos = plgpu.load(pos_ref.at[rows], mask=inb, other=-1)
        k = plgpu.load(k_ref.at[rows, :], mask=inb[:, None], other=0)
        # k_pairs: channel 2c in the low byte of pair c, 2c + 1 in the high one (sign-extended)
        if k_pairs:
            eight = jnp.int16(8)
            ks = (
                lax.shift_right_arithmetic(k << eight, eight),
                lax.shift_right_arithmetic(k, eight),
            )
        else:
            ks = (k,)
        pairs = list(zip(qs, ks, strict=True))
        if int8_qk:  # int32 products of codes, exact in float32 (|s| < 127² · D < 2^24)
            s = sum(dot_f32(a, b.astype(jnp.int8), trans_b=True) for a, b in pairs)
            s = s.astype(jnp.float32) * q_scale[:, None]
        else:
            s = sum(dot_f32(a, b.astype(cdt), trans_b=True) for a, b in pairs)  # [Gp, bk]
        if quantized:
            s = s * (plgpu.load(ks_ref.at[rows], mask=inb, other=0.0) * scale)[None, :]
        else:
            s = s * scale
        seen = ((pos >= 0) & (pos <= qpos))[None, :]
        if pool_group:  # the slot's owner against each row's KV head (padding rows own none)
            owner = plgpu.load(head_ref.at[rows], mask=inb, other=-1)
            rows_i = lax.broadcasted_iota(jnp.int32, (gp, block_k), 0)
            row_head = lax.div(rows_i, jnp.int32(pool_group))  # >= 0: truncation = floor
            seen = seen & (owner[None, :] == row_head)
        s = jnp.where(seen, s, -jnp.inf)
        if return_logits:
            store_rows(logits_ref[0], s, group, rows, inb)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        corr = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])  # [Gp, bk]
        l = l * corr + jnp.sum(p, axis=1)
        v = plgpu.load(v_ref.at[rows, :], mask=inb[:, None], other=0)
        if quantized:
            p = p * plgpu.load(vs_ref.at[rows], mask=inb, other=0.0)[None, :]
        if v_words:
            pc = p.astype(cdt)  # byte b of every word: channels 4c + b, sign-extended in registers
            o = [
                ob * corr[:, None]
                + dot_f32(pc, lax.shift_right_arithmetic(v << (24 - 8 * b), 24).astype(cdt),
                          trans_b=False)
                for b, ob in enumerate(o)
            ]  # fmt: skip
        else:
            o = o * corr[:, None] + dot_f32(p.astype(cdt), v.astype(cdt), trans_b=False)
        return o, m_new, l

    dv = v_ref.shape[1]  # D, or D/4 words
    acc = [jnp.zeros((gp, dv), jnp.float32) for _ in range(4)] if v_words else None
    init = (
        acc or jnp.zeros((gp, d), jnp.float32),
        jnp.full((gp,), _NEG, jnp.float32),
        jnp.zeros((gp,), jnp.float32),
    )
    o, m, l = lax.fori_loop(first, last, step, init)
    finish(o, m, l, o_ref, lse_ref, group)  # v_words: byte-major [4, D/4], reordered outside


def padded_rows(group: int) -> int:
    """Gp: the query rows the kernels' dots take, max(16, next power of 2 of G)."""
    return max(16, pl.next_power_of_2(group))


def pad_group(q: Array) -> Array:
    """[B, Hkv, G, D] → [B, Hkv, Gp, D] (`padded_rows`), zero rows."""
    g = q.shape[2]
    return jnp.pad(q, ((0, 0), (0, 0), (0, padded_rows(g) - g), (0, 0)))


def head_spec(*block) -> pl.BlockSpec:
    """A block of one (sequence, KV head): leading two axes squeezed, the rest whole."""
    return pl.BlockSpec((None, None, *block), lambda b, h, s: (b, h) + (0,) * len(block))


def split_out_shapes(
    q: Array, group: int, splits: int, slots: int, return_logits: bool, rows: int | None = None
):
    """(out_shape, out_specs) of the kernels' outputs for a grid (B, Hkv, S); `rows`: Gp when
    q itself is not padded (default: q's own rows).

    Outputs keep the Gp padded query rows (only the G real ones are ever written) so a tile is
    stored with one masked store; `partials` slices them off. The allocation is Gp/G times the
    written bytes (the traffic is not).
    """
    del group
    b, hkv, gp, d = q.shape
    gp = rows or gp
    shapes = [
        jax.ShapeDtypeStruct((b, hkv, splits, gp, d), jnp.float32),
        jax.ShapeDtypeStruct((b, hkv, splits, gp), jnp.float32),
    ]
    specs = [
        pl.BlockSpec((None, None, None, gp, d), lambda i, j, s: (i, j, s, 0, 0)),
        pl.BlockSpec((None, None, None, gp), lambda i, j, s: (i, j, s, 0)),
    ]
    if return_logits:
        shapes.append(jax.ShapeDtypeStruct((b, hkv, gp, slots), jnp.float32))
        specs.append(head_spec(gp, slots))
    return shapes, specs


def partials(outs, group: int, return_logits: bool, padded: bool = False) -> Partials:
    """The kernels' padded outputs as Partials of the G real query rows (`padded`: out and
    lse keep the Gp rows, the padding ones never written, for `combine_triton`)."""
    logits = outs[2][:, :, :group] if return_logits else None
    if padded:
        return Partials(outs[0], outs[1], logits)
    return Partials(outs[0][:, :, :, :group], outs[1][..., :group], logits)


def launch(
    kernel,
    arrays: list,
    specs: list,
    qp: Array,
    *,
    group: int,
    splits: int,
    slots: int,
    return_logits: bool,
    warps: int,
    stages: int,
    interpret: bool,
    name: str,
    padded: bool = False,
    rows: int | None = None,
) -> Partials:
    """Runs `kernel` over the grid (B, Hkv, splits) with the split outputs of padded queries
    qp [B, Hkv, Gp, D] (and [Gp, slots] logits when asked) and returns its Partials."""
    out_shape, out_specs = split_out_shapes(qp, group, splits, slots, return_logits, rows)
    outs = pl.pallas_call(
        kernel,
        grid=(qp.shape[0], qp.shape[1], splits),
        in_specs=specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name=name,
    )(*arrays)
    return partials(outs, group, return_logits, padded)


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "block_k",
        "num_splits",
        "num_warps",
        "num_stages",
        "return_logits",
        "int8_qk",
        "v_words",
        "k_pairs",
        "interpret",
        "padded",
    ),
)
def decode_attention_triton(
    q: Array,
    tier: FullTier | Int8Tier,
    q_pos: Array,
    layer: Array | None = None,
    *,
    scale: float,
    block_k: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    return_logits: bool = False,
    int8_qk: bool | None = None,
    v_words: bool | None = None,
    k_pairs: bool | None = None,
    interpret: bool = False,
    padded: bool = False,
) -> Partials:
    """One decode query per sequence attending one full-precision or INT8 tier.

    Args:
        q: [B, Hkv, G, D] queries (after RoPE) grouped by KV head, in the compute dtype.
        tier: FullTier or Int8Tier of the layer.
        q_pos: [B] int32 query positions (slots with pos > q_pos are masked).
        scale: logit scale.
        block_k: slots per loop step (power of 2); default from the device's Tuning.
        num_splits: splits S per (sequence, KV head); default fills the chip.
        num_warps, num_stages: Triton launch knobs; default from the device's Tuning.
        return_logits: also return every read slot's scaled logits (for the attention mass).
        int8_qk: INT8 tier only: quantize q per query head to int8 and run QK on the tensor
            cores' int8 path (adds q's rounding, ≤ max|q|/254 per element, to the logits);
            default: the device's Tuning.int8_qk for a bfloat16 q (whose own rounding is of
            that size), off for float16/float32 q, which keep their precision.
        v_words: INT8 tier only: read value codes as int32 words of 4 channels and split the
            bytes in registers (4 value dots of D/4 channels), so no code is loaded from shared
            memory one byte at a time; default from the device's Tuning, and always for
            value codes of 2^31 bytes or more (see k_pairs).
        k_pairs: INT8 tier only: read key codes as int16 pairs of channels (2 key dots of D/2
            channels). Default: for key codes of 2^31 bytes or more (a layer stack of them),
            which Pallas' Triton lowering would index with overflowing 32-bit offsets (it
            widens them only past 2^32 bytes); the pairs' element offsets stay below 2^31.
        interpret: run the kernel in the Pallas interpreter (CPU tests).
        layer: None, or a traced int32 scalar: the tier's k, v, pos (and scales) are then a
            stack [L, B, Hkv, ...] of L layers (extent stays this layer's [B, Hkv]) and the
            kernel reads layer `layer` in place, where slicing it out would copy it (a layer
            scan over a stacked cache). Not checked against L: the caller's loop index.
        padded: out and lse keep the kernel's Gp >= G query rows (rows >= G never written):
            what `combine_triton` reads without a copy of the G rows first.

    Returns:
        Partials with out [B, Hkv, S, G, D], lse [B, Hkv, S, G] (Gp rows if padded), logits
        [B, Hkv, G, C] or None.
    """
    check_query(q, q_pos)
    _check_tier(tier, layer, q)
    tune = tuning_for()
    quantized = isinstance(tier, Int8Tier)
    if int8_qk and not quantized:
        raise ValueError("int8_qk applies to an Int8Tier only (a FullTier has no int8 keys)")
    if int8_qk is None:
        int8_qk = tune.int8_qk and q.dtype == jnp.bfloat16
    int8_qk = quantized and bool(int8_qk)
    if v_words and not quantized:
        raise ValueError("v_words applies to an Int8Tier only (a FullTier has no int8 values)")
    v_words = quantized and (tune.int8_v_words if v_words is None else bool(v_words))
    block_k = block_k or tune.block_k
    b, hkv, group, _ = q.shape
    cap = tier.pos.shape[-1]
    target = tune.int8_target_programs if quantized else tune.target_programs
    splits = num_splits or _num_splits(b, hkv, pl.cdiv(cap, block_k), target, tune.split_min_blocks)
    rows = padded_rows(group)
    # A power-of-2 G is read as given, its Gp rows by a masked load (no pad launched first).
    qp = q if group & (group - 1) == 0 and rows > group else pad_group(q)
    if k_pairs and not quantized:
        raise ValueError("k_pairs applies to an Int8Tier only (a FullTier has no int8 keys)")
    k_pairs = quantized and (tier.k.size >= BYTE_OFFSETS if k_pairs is None else bool(k_pairs))
    v_words = v_words or (quantized and tier.v.size >= BYTE_OFFSETS)
    k, v = tier.k, tier.v
    for name, on, a, n in (("k_pairs", k_pairs, k, 2), ("v_words", v_words, v, 4)):
        if on and a.shape[-1] % n:
            raise ValueError(f"{name} needs a head dim divisible by {n}, got {a.shape[-1]}")
    if k_pairs:  # [C, D] int8 → [C, D/2] int16 (a bitcast), q's channels reordered to match
        k = as_words(k, 2)
        qp = jnp.concatenate([qp[..., 0::2], qp[..., 1::2]], axis=-1)
    if v_words:  # [C, D] int8 → [C, D/4] int32 (a bitcast, no copy)
        v = as_words(v, 4)
    arrays = [tier.extent, q_pos, qp, k, v, tier.pos]
    specs = [
        head_spec(),
        pl.BlockSpec((None,), lambda i, j, s: (i,)),
        head_spec(*qp.shape[2:]),
        head_spec(*k.shape[2:]),
        head_spec(*v.shape[2:]),
        head_spec(cap),
    ]
    if quantized:
        arrays += [tier.k_scale, tier.v_scale]
        specs += [head_spec(cap), head_spec(cap)]
    if layer is not None:  # [L, B, Hkv, ...] → [L·B, Hkv, ...] (free), read whole by the views
        for i in range(3, len(arrays)):
            arrays[i] = merge_layers(arrays[i])
            specs[i] = whole_spec(arrays[i])
        arrays.append(jnp.asarray(layer, jnp.int32))
        specs.append(pl.BlockSpec((), lambda *_: ()))
    kernel = functools.partial(
        _kernel,
        quantized=quantized,
        int8_qk=int8_qk,
        v_words=v_words,
        k_pairs=k_pairs,
        rows=rows,
        scale=scale,
        block_k=block_k,
        num_splits=splits,
        group=group,
        return_logits=return_logits,
        stacked_batch=b if layer is not None else 0,
    )
    res = launch(
        kernel,
        arrays,
        specs,
        qp,
        group=group,
        splits=splits,
        slots=cap,
        return_logits=return_logits,
        warps=num_warps or tune.num_warps,
        stages=num_stages or tune.num_stages,
        interpret=interpret,
        name="kvjax_decode_int8" if quantized else "kvjax_decode_full",
        padded=padded,
        rows=rows,
    )
    if v_words:  # byte-major channels [4, D/4] → channel order 4c + b
        b_, h_, s_, g_, d_ = res.out.shape
        out = res.out.reshape(b_, h_, s_, g_, 4, d_ // 4).swapaxes(-1, -2).reshape(res.out.shape)
        res = res._replace(out=out)
    return res


def _check_tier(tier, layer, q) -> None:
    """`check_dense` of the tier against q; with `layer`, of one layer of the stack."""
    check_dense(tier if layer is None else layer_view(tier, layer), q)
