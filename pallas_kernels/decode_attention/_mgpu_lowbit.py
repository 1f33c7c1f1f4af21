"""Decode attention over the low-bit (INT4/INT2) tier: Pallas Mosaic GPU (Hopper, `plgpu`).

Tokens on the wgmma M axis. One CTA (one warpgroup) per (sequence, KV head, split) walks its
split's 64-token pages of a `ChannelMajorLowBitTier` (`to_channel_major`). For each page:

- QK: S [64 tokens, N] = K·q^T. The key codes [64 tokens, D·bits/8] come from shared memory
  into registers; each code slice (one AND with its bit mask, read as int8: `_slice`) is
  converted to bfloat16 and dequantized with the page's kernel-ready per-channel statistics;
  the slices, concatenated, are the A operand of one wgmma against q^T (the G query heads
  zero-padded to N = 8 columns, 16 when G > 8; in shared memory once per call). No query row
  is padded to 64 and no code goes back to shared memory.
- Online softmax along the token axis: the max is the page's one cross-warp reduction; the
  denominator stays a [64, N] tile summed after the loop.
- PV: out^T [D, N] = V^T·P'. The channel-major value codes of a 64-channel half [64, 64
  tokens] are the A operand with no arithmetic but the mask and the conversion: each token's
  value scale multiplies its probability (P', stored transposed to shared memory: the loop's
  only stored tile) and its zero adds up as Σ_t p·zero in a [64, N] tile per value group.

Every byte of a page (codes, the statistics stacked beside them, positions) streams by TMA
`stages` pages ahead. Needs a bfloat16 q, D a multiple of 64, G ≤ 16, 64-token pages and value
groups of ≥ 64 channels. Measured and why it is built so: docs/lab/2026-12-03-mgpu-lowbit.md.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kvjax.pallas_kernels.decode_attention._channel_major import PAGE
from kvjax.pallas_kernels.decode_attention._mgpu import decode_grid, layer_arrays, smem_tile
from kvjax.pallas_kernels.decode_attention._tiers import ChannelMajorLowBitTier, Partials
from kvjax.pallas_kernels.decode_attention._tuning import num_splits as _num_splits
from kvjax.pallas_kernels.decode_attention._tuning import tuning_for
from kvjax.pallas_kernels.decode_attention._validate import (
    check_channel_major,
    check_query,
)
from kvjax.quant._words_layout import WORD_BASE, word_factor, word_source_of
from kvjax.quant._words_layout import word_place as _word_place

Array = jax.Array
COLS = 16  # most query heads per KV head (the dots' N; 8 when G <= 8)
_NEG = -1e30


def _slice(packed: Array, c: int, bits: int) -> Array:
    """Code slice c of packed bytes as bfloat16 where it lies: 2^(c·bits)·code, minus 2^7 on the
    sign-flipped top slice. One AND and the int8 → bfloat16 conversion, no shift (8-bit shifts
    do not lower); `kernel_stats` puts the power of two into the scale."""
    mask = ((1 << bits) - 1) << (c * bits)
    return (packed & jnp.uint8(mask)).astype(jnp.int8).astype(jnp.bfloat16)


INT4_LOADS = ("upcast2x", "wgmma", "auto")  # how `_native` loads int4 codes (a tuning knob)


def _load_int4(ref, load: str) -> Array:
    """An int4 tile of shared memory in registers, in the layout `load` names (`_native`).
    Loaded once for all the code slices a nibble holds (2 bits: two), so that no slice loads
    the tile again after a dot (a dot's memory effects keep the compiler from merging loads)."""
    if load == "auto":
        return ref[...]
    lay = plgpu.Layout.WGMMA_UPCAST_2X if load == "upcast2x" else plgpu.Layout.WGMMA
    return plgpu.load(ref, layout=lay, optimized=True)


def _native(x: Array, load: str, bits: int, c: int) -> Array:
    """An int4 tile (`_load_int4(ref, load)`) as bfloat16 in the wgmma A layout, converted by
    Mosaic GPU's int4 → bfloat16 path (a byte permute, a mask-or and a bfloat16 subtract for
    two values). `load`: "upcast2x" loads four codes a thread-vector (WGMMA_UPCAST_2X, the
    layout Mosaic GPU keeps for narrow operands of a dot) and moves the bfloat16 values to the
    wgmma layout after the conversion; "wgmma" loads in the wgmma layout itself (two codes a
    vector); "auto" leaves the layout to Mosaic GPU's inference. (WGMMA_UPCAST_4X, eight codes
    a vector, does not load from these tiles in JAX 0.11.2.) At 2 bits a nibble holds two code
    slices: slice c is one mask of it (`to_channel_major(native=True)`)."""
    if bits == 2:  # code slice c of the nibble, where it lies (NIBBLE_SIGN: top slice linear)
        mask = _nibble_mask(bits, c)
        x = x & jnp.int4(mask - 16 if mask >= 8 else mask)
    x = x.astype(jnp.bfloat16)
    return plgpu.layout_cast(x, plgpu.Layout.WGMMA) if load == "upcast2x" else x


def _nibble_mask(bits: int, c: int) -> int:
    """The bits of a stored nibble that code slice c holds: all four at 4 bits (where callers'
    c names a value half's rows, not a slice), slice c's two at 2 bits."""
    return 0xF if bits == 4 else ((1 << bits) - 1) << (c * bits)


OFFSET = 136  # what `_offset_codes` adds to a code: the exponent 0x43 (128) and the XOR's 8


def _lop3_offset(x: Array, mask: int) -> Array:
    """int4 codes [M, K] (wgmma layout) → bfloat16 (n & mask) ^ 8 + 128 = code + OFFSET, with
    one byte permute and one LOP3 a pair of codes (Mosaic GPU's own conversion also subtracts
    the bias, a third instruction; the offset is taken out through the statistics instead).
    GPU only: the interpreter cannot run inline Mosaic GPU code (`_offset_codes` emulates it)."""
    # Inline Mosaic GPU needs MLIR's LLVM dialect, which jax.extend does not export.
    import numpy as np
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, vector
    from jax.experimental.mosaic import gpu as mgpu

    mask32 = mask | mask << 16

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA,),
        return_type=plgpu.ShapeDtypeStruct(x.shape, jnp.bfloat16, layout=plgpu.Layout.WGMMA),
    )
    def convert(_ctx, arr):
        i8, i32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32)
        pair = ir.VectorType.get((2,), ir.BF16Type.get())
        out = np.empty_like(arr.registers)
        for idx, reg in np.ndenumerate(arr.registers):
            src = getattr(reg.owner, "opview", None)
            if (
                isinstance(src, vector.ExtractStridedSliceOp)
                and mgpu.utils.bitwidth(src.source.type) == 32
            ):  # a pair sliced from a loaded 32-bit word: permute its byte out of the word
                word, part = mgpu.utils.bitcast(src.source, i32), src.offsets[0].value // 2
            else:
                word, part = arith.extui(i32, mgpu.utils.bitcast(reg, i8)), 0
            high = arith.shrui(word, mgpu.utils.c(4, i32))  # the byte's high nibble, low
            res = llvm.inline_asm(
                i32,
                [word, high],
                "{ .reg .b32 s; "
                f"prmt.b32 s, $1, $2, 0xF{part + 4}F{part}; "
                f"lop3.b32 $0, s, {mask32:#010x}, 0x43084308, 0x6a; }}",  # (s & m) ^ c
                "=r,r,r",
            )
            out[idx] = mgpu.utils.bitcast(res, pair)
        return mgpu.FragmentedArray(_registers=out, _layout=arr.layout, _is_signed=None)

    return convert(x)


def _offset_load(interpret: bool) -> str:
    """How `_offset_codes` wants its tile loaded: the wgmma layout (its inline PTX works on
    those registers), or the interpreter's own."""
    return "auto" if interpret else "wgmma"


def _offset_codes(x: Array, bits: int, c: int, interpret: bool) -> Array:
    """Code slice c of an int4 tile (`_load_int4(ref, _offset_load(interpret))`) as bfloat16
    code + OFFSET (the code as `_native` reads it: signed at 4 bits, the slice where it lies at
    2 bits): exact in bfloat16 (128 ... 143)."""
    if interpret:
        return _native(x, "auto", bits, c) + jnp.bfloat16(OFFSET)
    return _lop3_offset(x, _nibble_mask(bits, c))


def _load_words(ref, interpret: bool) -> Array:
    """A page's words-layout tile [W, 128] uint32 in registers: each thread's four words of a
    128-bit load in the strided layout (`word_source`); the whole tile when interpreted."""
    if interpret:
        return ref[...]
    return plgpu.load(ref, layout=plgpu.Layout.WG_STRIDED(ref.shape, vec_size=4), optimized=True)


def _word_codes(
    x: Array,
    bits: int,
    k: int,
    part: int,
    parts: int,
    interpret: bool,
    lop3: bool = True,
    cols: tuple[int, int] | None = None,
    subnormal: bool = False,
) -> Array:
    """A [64, k] wgmma A operand, bfloat16 128 + code·2^pos, from tile `part` of `parts` in a
    words-layout tile loaded by `_load_words` (`to_channel_major(words=True)`): one AND-OR a
    register (`lop3`: written as one inline LOP3; else as an AND and an OR, which ptxas emits
    as two), and one shift a word and window. The interpreter gathers the same values.
    `cols`: only the tile's columns [c0, c1) (multiples of 8), a [64, c1 - c0] operand.
    `subnormal`: no 128, one AND a register: the code bits alone, read as bfloat16, are the
    subnormal code·2^pos·2^-133 (exact; the tensor cores keep subnormal inputs); interpreted,
    code·2^pos itself (`subnormal_kb`)."""
    c0, c1 = cols or (0, k)
    if interpret:  # (index arrays from iotas: a kernel may close over no array constant)
        rows, cols = (lax.broadcasted_iota(jnp.int32, (64, c1 - c0), a) for a in (0, 1))
        cols = cols + c0
        flat, bit = word_source_of(bits, k, parts, part, rows, cols)
        codes = (x.reshape(-1)[flat] >> bit.astype(jnp.uint32)) & jnp.uint32((1 << bits) - 1)
        pos = _word_place(bits, k, rows, cols)[3]
        vals = (codes << pos.astype(jnp.uint32)).astype(jnp.float32).astype(jnp.bfloat16)
        return vals if subnormal else vals + jnp.bfloat16(WORD_BASE)
    import numpy as np
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, vector
    from jax.experimental.mosaic import gpu as mgpu

    per = k * bits // 64  # words a thread per tile

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WG_STRIDED(x.shape, vec_size=4),),
        return_type=plgpu.ShapeDtypeStruct((64, c1 - c0), jnp.bfloat16, layout=plgpu.Layout.WGMMA),
    )
    def convert(_ctx, arr):
        i32 = ir.IntegerType.get_signless(32)
        pair = ir.VectorType.get((2,), ir.BF16Type.get())
        shape = mgpu.WGMMA_LAYOUT.registers_shape((64, c1 - c0))
        assert shape == (1, (c1 - c0) // 8, 1, 1, 2, 1, 1, 1, 1), shape
        out = np.empty(shape, dtype=object)
        windows = {}  # (word, window) -> the word shifted to it

        def window(jj: int, sh: int):
            if (jj, sh) not in windows:
                w = vector.extract(arr.registers[jj // 4], [], [jj % 4])
                windows[jj, sh] = arith.shrui(w, mgpu.utils.c(4 * sh, i32)) if sh else w
            return windows[jj, sh]

        for k8 in range(c0 // 8, c1 // 8):
            for r2 in range(2):  # register (k8, r2): row 8·r2 and column 8·k8 of warp 0, lane 0
                _, j, sh, pos = (int(x) for x in _word_place(bits, k, 8 * r2, 8 * k8))
                mask = (((1 << bits) - 1) << pos) * 0x10001  # both half-words
                src = window(part * per + j, sh)
                if subnormal:  # the code bits alone: a subnormal bfloat16 pair
                    v = arith.andi(src, mgpu.utils.c(mask, i32))
                elif lop3:  # (w & mask) | 0x43004300 as one LOP3 (ptxas made it two)
                    v = llvm.inline_asm(
                        i32, [src], f"lop3.b32 $0, $1, {mask:#010x}, 0x43004300, 0xea;", "=r,r"
                    )
                else:
                    v = arith.andi(src, mgpu.utils.c(mask, i32))
                    v = arith.ori(v, mgpu.utils.c(0x43004300, i32))  # bfloat16 128.0, twice
                out[0, k8 - c0 // 8, 0, 0, r2, 0, 0, 0, 0] = mgpu.utils.bitcast(v, pair)
        return mgpu.FragmentedArray(_registers=out, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)

    return convert(x)


SUB_SHIFT = 64  # under `subnormal`, S and the output are computed at 2^-SUB_SHIFT of their size


def subnormal_kb(interpret: bool) -> float:
    """kb of the words' subnormal codes: an A operand is code·2^pos·e (e = 2^-133, the
    bfloat16 subnormals' unit; interpreted, 1: the interpreter's CPU dots flush subnormals, so
    it multiplies normal codes instead), q^T and each probability are multiplied by kb, and
    e·kb = 2^-SUB_SHIFT either way: S and out^T come out of the dots at 2^-SUB_SHIFT of their
    size (float32 keeps that), their B operands at kb times theirs (bfloat16 keeps 2^69)."""
    e = 1.0 if interpret else 2.0**-133
    return 2.0**-SUB_SHIFT / e


def _code_offset(offset: bool, words: bool, subnormal: bool = False) -> float:
    """What each code's operand adds to it: 136 (int4_offset), 128 (words, unless read as
    subnormals), else nothing."""
    if offset:
        return float(OFFSET)
    return WORD_BASE if words and not subnormal else 0.0


BIAS_BOX = 256  # most pages one TMA copy of the key biases takes (a TMA box's largest side)
BIAS_SMEM = 16384  # most bytes of key biases a split holds in shared memory


def bias_pages(steps: int, splits: int, pp: int) -> int:
    """The most pages one split reads (its key biases copied at once, `bias_outside`): the
    splits' even share of the steps, in pages."""
    return -(-steps // splits) * pp


def key_bias(qt: Array, k_stats: Array, off: float) -> Array:
    """Each page's key bias for the folded keys, [B, Hkv, P, N] float32: Σ_c qt·zero less
    off·Σ_c bf16(qt·scale) (the offset codes' share of the B operand as the kernel rounds it),
    what `fold` sums in the loop otherwise. qt [B, Hkv, D, N] float32 (q^T, over the words'
    powers of two); k_stats [B, Hkv, P, 2, D] bfloat16 kernel-ready (scale, zero).

    Without an offset, one bfloat16 dot with float32 results: qt is a bfloat16 q times powers
    of two, so exact in bfloat16, and each product exact in float32 (float32 operands would
    take XLA's six-pass HIGHEST-precision dot, or a rounding one)."""
    if not off:
        qb = qt.astype(jnp.bfloat16)
        return jnp.einsum(
            "bhdn,bhpd->bhpn", qb, k_stats[:, :, :, 1], preferred_element_type=jnp.float32
        )
    scale = k_stats[:, :, :, 0].astype(jnp.float32)  # [B, Hkv, P, D]
    zero = k_stats[:, :, :, 1].astype(jnp.float32)
    hi = lax.Precision.HIGHEST
    bias = jnp.einsum("bhdn,bhpd->bhpn", qt, zero, precision=hi)
    # The offset codes' share, bfloat16-rounded as the kernel stores it: through its bits,
    # which XLA's excess precision (a float32 → bfloat16 → float32 round trip elided) cannot skip
    qs = (qt[:, :, None] * scale[..., None]).astype(jnp.bfloat16)
    bits = lax.bitcast_convert_type(qs, jnp.uint16).astype(jnp.uint32) << 16
    bias = bias - off * lax.bitcast_convert_type(bits, jnp.float32).sum(axis=3)
    return bias


def mgpu_lowbit_applies(tier: ChannelMajorLowBitTier, q: Array) -> str | None:
    """Why the Mosaic GPU low-bit kernel cannot run this (validated) tier (None if it can)."""
    tp, d = tier.pos.shape[3], q.shape[3]
    ng = tier.v_stats.shape[4]
    if q.dtype != jnp.bfloat16:
        return f"q dtype {q.dtype} (needs bfloat16)"
    if tp != PAGE:
        return f"{tp}-token pages (needs {PAGE})"
    if d % 64:
        return f"head dim {d} (needs a multiple of 64)"
    if (d // ng) % 64:
        return f"value groups of {d // ng} channels (needs a multiple of 64)"
    if q.shape[2] > COLS:
        return f"{q.shape[2]} query heads per KV head (at most {COLS})"
    if tier.k.dtype == jnp.int4 and tier.k.shape[-1] * 2 == d and (d != 128 or ng != 2):
        return f"2-bit int4 codes with D={d} and {ng} value groups (need D=128, 2 groups)"
    return None


def _kernel(
    layer_ref,  # [1] int32: the layer of the stacked arrays below (0 for one layer)
    extent_ref,  # [B, Hkv] int32
    qpos_ref,  # [B] int32
    q_ref,  # [B, Hkv, N, D] bf16: the G query heads, rows >= G zero
    qt_ref,  # fold_keys: [B, Hkv, D, N] f32, q^T (read once into registers); else unused
    k_ref,  # [L, B, Hkv, P, 64, D·bits/8] uint8 (L layers: a stacked cache's, or 1)
    v_ref,  # [L, B, Hkv, P, D, 64·bits/8] uint8
    ks_ref,  # [L, B, Hkv, P, 2, D] bf16 kernel-ready key statistics
    vs_ref,  # [L, B, Hkv, P, 2, NG, 64] bf16 kernel-ready value statistics
    pos_ref,  # [L, B, Hkv, P, 64] int32
    bias_ref,  # bias_outside: [B, Hkv, P + MP, N] f32, each page's key bias (`key_bias`; MP
    # pages of zeros past the end, so a split's one copy of MP pages stays inside); else unused
    o_ref,  # [B, Hkv, S, D, N] f32: out^T
    lse_ref,  # [B, Hkv, S, N] f32
    *refs,  # logits [B, Hkv, P, 64, N] f32 (return_logits; pages >= extent never written),
    # then the scratch, pp = pages_per_step: q_smem [N, D] bf16; k_smem [stages, pp, 64,
    # D·bits/8] uint8; v_smem [stages, pp, D, 64·bits/8] uint8; ks_smem [stages, pp, 2, D]
    # bf16; vs_smem [stages, pp, 2, NG, 64] bf16; pos_smem [stages, pp, 64] int32; p_smem
    # [NG, pp, N, 64] bf16 (P^T times each value group's scales, K-major for the dot);
    # lse_smem [N] f32; interpreted, the A-operand tiles in shared memory; then the barriers
    bits: int,
    scale: float,
    stages: int,
    num_splits: int,
    interpret: bool,
    native: bool = False,
    int4_load: str = "upcast2x",
    return_logits: bool = False,
    pages_per_step: int = 1,
    fold_keys: bool = False,
    offset: bool = False,
    one_barrier: bool = False,
    words: bool = False,
    overlap: bool = False,
    lop3: bool = True,
    bias_outside: bool = False,
    tc_bias: bool = False,
    qk_split: bool = False,
    subnormal: bool = False,
):
    logits_ref = refs[0] if return_logits else None
    q_smem, k_smem, v_smem, ks_smem, vs_smem, pos_smem, p_smem, lse_smem, *stage = refs[
        1 if return_logits else 0 :
    ]
    if fold_keys:  # the B operand (q⊙scale)^T of each page of a step
        qs_smem, *stage = stage
    if bias_outside:  # [MP, N] f32: the split's pages' key biases, copied once before its loop
        bias_smem, *stage = stage
    if tc_bias:  # [N, D] bf16: q^T as the zero rows' B operand (q over the words' powers of two)
        qz_smem, *stage = stage
    # native: int4 codes (`to_channel_major(native=True)`), converted by Mosaic GPU's int4 →
    # bfloat16 path (permute, mask-or, subtract: no conversion instruction); 4/bits slices a
    # nibble.
    if interpret:
        ka_smem, va_smem, *bars = stage
    else:
        ka_smem = va_smem = None
        bars = stage
    q_bar, *bars = bars
    if bias_outside:  # the split's key biases: one barrier, an arrival a copy
        bias_bar, *bars = bars
    if one_barrier:  # every copy of a stage arrives on one barrier (5 arrivals)
        (page_bar,) = bars
        k_bar = v_bar = ks_bar = vs_bar = pos_bar = page_bar
    else:
        k_bar, v_bar, ks_bar, vs_bar, pos_bar = bars
    load = _offset_load(interpret) if offset else int4_load  # how int4 tiles load
    off = _code_offset(offset, words, subnormal)
    # subnormal: the dots give S and out^T at 2^-SUB_SHIFT, the bias (from q^T·kb) at kb times
    # its size, and each probability carries kb (its exponent shifted by log kb)
    kb = subnormal_kb(interpret) if subnormal else 1.0
    log_kb = math.log(kb) if subnormal else 0.0
    b, h, split = lax.axis_index("b"), lax.axis_index("h"), lax.axis_index("s")
    lay = layer_ref[0]
    pages_cap = k_ref.shape[3]
    cols, d = q_ref.shape[2:]
    n = 1 if words else (4 if native else 8) // bits  # code slices a nibble (native) or byte
    w = d // n  # channels per key code slice
    ng = vs_ref.shape[5]
    halves = d // 64
    grp = [(r * 64) // (d // ng) for r in range(halves)]  # value group of each 64-channel half
    extent = jnp.minimum(extent_ref[b, h], pages_cap)
    qpos = qpos_ref[b]
    pp = pages_per_step  # pages a loop step reads (one TMA copy of each array for all of them)
    steps = lax.div(extent + pp - 1, pp)
    per = lax.div(steps + num_splits - 1, num_splits)
    first = split * per  # in steps of pp pages
    last = jnp.minimum(first + per, steps)
    col = plgpu.Layout.WGMMA.reduce(0)  # a vector along the columns of a [64, N] tile
    row = plgpu.Layout.WGMMA.reduce(1)  # a vector along the rows

    plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem, q_bar.at[0])
    if fold_keys:  # q^T [D, N] in registers for the whole loop (N·D/128 floats a thread)
        qt = plgpu.load(qt_ref.at[b, h], layout=plgpu.Layout.WGMMA, optimized=False)
    if tc_bias:  # exact in bfloat16: q is, and the words' factors are powers of two
        qz_smem.T[...] = qt.astype(jnp.bfloat16)
        plgpu.commit_smem()
        # -off in every element: its dot against (q⊙scale)^T is -off·Σ_c bf16(q⊙scale)
        minus_off = plgpu.layout_cast(jnp.full((PAGE, d), -off, jnp.bfloat16), plgpu.Layout.WGMMA)

    def start(i):
        """The first page step i copies: i·pp, moved back to stay inside the P pages when P is
        not a multiple of pp (its pages before i·pp are then the last step's, not attended)."""
        return jnp.minimum(i * pp, pages_cap - pp)

    def issue(i, slot, when):
        @pl.when(when)
        def _():
            at = (lay, b, h, pl.ds(start(i), pp))
            plgpu.copy_gmem_to_smem(k_ref.at[at], k_smem.at[slot], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[at], v_smem.at[slot], v_bar.at[slot])
            plgpu.copy_gmem_to_smem(ks_ref.at[at], ks_smem.at[slot], ks_bar.at[slot])
            plgpu.copy_gmem_to_smem(vs_ref.at[at], vs_smem.at[slot], vs_bar.at[slot])
            plgpu.copy_gmem_to_smem(pos_ref.at[at], pos_smem.at[slot], pos_bar.at[slot])

    base = start(first)  # the split's first page (its biases from here)
    if bias_outside:  # every page's bias of the split at once, in boxes of BIAS_BOX pages
        mp = bias_smem.shape[0]
        for c0 in range(0, mp, BIAS_BOX):
            n_c = min(BIAS_BOX, mp - c0)
            plgpu.copy_gmem_to_smem(
                bias_ref.at[b, h, pl.ds(base + c0, n_c)], bias_smem.at[pl.ds(c0, n_c)],
                bias_bar.at[0],
            )  # fmt: skip
    for j in range(stages):
        issue(first + j, j, first + j < last)
    plgpu.barrier_wait(q_bar.at[0])
    if bias_outside:
        plgpu.barrier_wait(bias_bar.at[0])

    def operand(x, stage_ref):
        """A [64, K] bfloat16 tile as a wgmma A operand: registers, or shared memory under the
        interpreter (whose wgmma reads both operands from there)."""
        if not interpret:
            return x
        stage_ref[...] = x
        plgpu.commit_smem()
        return stage_ref

    def wait_all(slot):
        """Every copy of a stage has landed (one barrier, or one a copy)."""
        for bar in (pos_bar,) if one_barrier else (pos_bar, ks_bar, k_bar, vs_bar, v_bar):
            plgpu.barrier_wait(bar.at[slot])

    def fold(slot, j, i):
        """Page j's key statistics on q: (q⊙scale)^T [D, N] stored as the QK dot's B
        operand, and each column's Σ_c q·zero (less the offset codes' share of the stored,
        rounded q⊙scale) as a float32 [N]: S = codes·(q⊙scale)^T + bias."""
        rowv = plgpu.Layout.WGMMA.reduce(1)
        st = [
            lax.broadcast_in_dim(
                plgpu.load(ks_smem.at[slot, j, t], layout=rowv, optimized=True).astype(jnp.float32),
                qt.shape,
                [0],
            )
            for t in range(1 if bias_outside or tc_bias else 2)
        ]
        qs = (qt * st[0]).astype(jnp.bfloat16)
        qs_smem.at[j].T[...] = qs
        if tc_bias:  # the bias comes from the QK dots themselves (`tc_bias_dots`)
            return None
        if bias_outside:  # computed before the launch (`key_bias`): no sum across warps
            at = jnp.minimum(start(i) - base + j, bias_smem.shape[0] - 1)  # (in range on a
            # last overlapped turn, which reads no page)
            return plgpu.load(bias_smem.at[at], layout=col, optimized=True)
        return (qt * st[1] - off * qs.astype(jnp.float32)).sum(axis=0)

    def tc_bias_dots(slot, j, s_ref):
        """The key bias of page j added to S by two more dots into s_ref: the constant -off
        tile against (q⊙scale)^T (the offset codes' share, -off·Σ_c bf16(q⊙scale), exact) and
        the page's zero row in every row of A against q^T (Σ_c q·zero): no sum across the
        warpgroup's warps, and each product exact in float32."""
        if off:
            plgpu.wgmma(s_ref, operand(minus_off, ka_smem), qs_smem.at[j].T)
        zero = plgpu.load(ks_smem.at[slot, j, 1], layout=col, optimized=True)
        rows = lax.broadcast_in_dim(zero, (PAGE, d), [1])  # [64 tokens, D], each row the zeros
        plgpu.wgmma(s_ref, operand(rows, ka_smem), qz_smem.T)

    def key_slice(kc, c):
        """Key code slice c of a page's loaded codes as bfloat16, as the layout reads it."""
        if offset:  # code + OFFSET: a permute and one LOP3 a pair
            return _offset_codes(kc, bits, c, interpret)
        if native:
            return _native(kc, int4_load, bits, c)
        return _slice(kc, c, bits)

    def qk_issue(slot, j, s_ref, s_ref2=None):
        """Issue page j's QK dot S [64 tokens, N] into s_ref (after `fold` with fold_keys);
        with s_ref2 (qk_split), channels [0, D/2) into s_ref and [D/2, D) into s_ref2: two
        independent chains of dots, S their sum; with tc_bias, the key bias's dots too."""
        code_dots(slot, j, s_ref, s_ref2)
        if tc_bias:  # (tc_bias implies fold_keys)
            tc_bias_dots(slot, j, s_ref)

    def code_dots(slot, j, s_ref, s_ref2):
        """The key codes' dots of `qk_issue`."""
        if s_ref2 is not None:
            half = d // 2
            if words:
                kc = _load_words(k_smem.at[slot, j], interpret)
                for acc_ref, c0 in ((s_ref, 0), (s_ref2, half)):
                    keys = _word_codes(
                        kc, bits, d, 0, 1, interpret, lop3, (c0, c0 + half), subnormal
                    )
                    qs_half = qs_smem.at[j, :, pl.ds(c0, half)].T
                    plgpu.wgmma(acc_ref, operand(keys, va_smem), qs_half)
                return
            kc = _load_int4(k_smem.at[slot, j], load) if native else k_smem[slot, j]
            for c, acc_ref in enumerate((s_ref, s_ref2)):  # n = 2 slices: one half each
                code = key_slice(kc, c)
                qs_half = qs_smem.at[j, :, pl.ds(c * half, half)].T
                plgpu.wgmma(acc_ref, operand(code, va_smem), qs_half)
            return
        if words:  # one 128-bit load a thread, then one AND-OR a register
            kc = _load_words(k_smem.at[slot, j], interpret)
            keys = _word_codes(kc, bits, d, 0, 1, interpret, lop3, None, subnormal)  # [64, D]
            plgpu.wgmma(s_ref, operand(keys, ka_smem), qs_smem.at[j].T)
            return
        # [64 tokens, D·bits/8] uint8 in registers (native: the [64, D·bits/4] int4 tile)
        kc = _load_int4(k_smem.at[slot, j], load) if native else k_smem[slot, j]
        keys = []
        for c in range(n):  # slice c: channels c·w ... (c+1)·w
            code = key_slice(kc, c)
            if fold_keys:  # the statistics are on q: the codes are the operand
                keys.append(code)
                continue
            # Statistics loaded at their use: a whole page's at once would hold
            # registers that cap the CTAs per multiprocessor.
            st = [
                plgpu.load(ks_smem.at[slot, j, t, pl.ds(c * w, w)], layout=col, optimized=True)
                for t in range(2)
            ]
            kd = code * lax.broadcast_in_dim(st[0], code.shape, [1])
            keys.append(kd + lax.broadcast_in_dim(st[1], code.shape, [1]))
        keys = jnp.concatenate(keys, axis=1) if n > 1 else keys[0]  # [64 tokens, D]
        if fold_keys:
            plgpu.wgmma(s_ref, operand(keys, ka_smem), qs_smem.at[j].T)
        else:
            plgpu.wgmma(s_ref, operand(keys, ka_smem), q_smem.T)

    def pv_issue(slot, o_refs, tiles):
        """Issue the PV dots out^T [64 channels, N] of every 64-channel half r into o_refs[r],
        over the step's pages in `slot` and P' in p_smem. `tiles`: the int4 / words tiles
        already loaded (page, first row) -> tile, so that each is loaded once a page."""
        for r, o_ref_ in enumerate(o_refs):
            for j in range(pp):
                if words:  # the page's value tile, both halves: loaded once
                    if j not in tiles:
                        tiles[j] = _load_words(v_smem.at[slot, j], interpret)
                    codes = _word_codes(
                        tiles[j], bits, 64, r, halves, interpret, lop3, None, subnormal
                    )
                elif native:  # [64 channels, 64 tokens] int4 (2 bits: half r = nibble slice r)
                    row0 = r * 64 if bits == 4 else 0
                    if (j, row0) not in tiles:
                        vref = v_smem.at[slot, j, pl.ds(row0, 64)]
                        tiles[j, row0] = _load_int4(vref, load)
                    if offset:
                        codes = _offset_codes(tiles[j, row0], bits, r, interpret)
                    else:
                        codes = _native(tiles[j, row0], int4_load, bits, r)
                else:
                    vc = v_smem[slot, j, pl.ds(r * 64, 64)]  # [64 channels, 64·bits/8]
                    codes = [_slice(vc, c, bits) for c in range(n)]  # tokens c·64/n …
                    codes = jnp.concatenate(codes, axis=1) if n > 1 else codes[0]
                plgpu.wgmma(o_ref_, operand(codes, va_smem), p_smem.at[grp[r], j].T)

    def softmax(i, slot, ss, biases, m, l, zt, valid=None):
        """The online softmax of step i's pages (their S in `ss`): masks, logits, the running
        max (the step's one cross-warp reduction), the denominator and the value zeros' tiles,
        and P' (times each token's value scale) stored to p_smem for the PV dots. `valid`: a
        scalar, False on the overlapped loop's last turn, which reads no page (its statistics
        are not loaded data). Returns (m_new, corr, l, zt)."""
        ss, keep = list(ss), []
        for j in range(pp):
            s = ss[j]
            # The logits: with folded keys, each column's share of the zeros (and of the codes'
            # offset) added (with tc_bias the dots added it); under subnormal S comes at
            # 2^-SUB_SHIFT and the bias at kb times its size, each scaled back with the logits.
            if subnormal:
                s = s * (scale * 2.0**SUB_SHIFT) + lax.broadcast_in_dim(
                    biases[j] * (scale / kb), s.shape, [1]
                )
            else:
                if fold_keys and biases[j] is not None:
                    s = s + lax.broadcast_in_dim(biases[j], s.shape, [1])
                s = s * scale
            pos = plgpu.load(pos_smem.at[slot, j], layout=row, optimized=True)
            if valid is not None:  # a vector of `valid` in the rows' layout
                keep.append((pos == pos) & valid)
            page = start(i) + j
            own = page >= i * pp  # not the step before's (a moved-back last step)
            if valid is not None:
                own = own & valid
            # A step's pages past the extent (an odd extent) are not attended either.
            seen = (pos >= 0) & (pos <= qpos) & own & (page < extent)
            s = jnp.where(lax.broadcast_in_dim(seen, s.shape, [0]), s, -jnp.inf)
            if logits_ref is not None:  # the page's scaled logits, [64 tokens, N]

                @pl.when(own)
                def _(s=s, page=page):
                    logits_ref[b, h, page] = s

            ss[j] = s
        top = functools.reduce(jnp.maximum, ss)  # the step's one cross-warp reduction
        m_new = jnp.maximum(m, top.max(axis=0))
        corr = lax.broadcast_in_dim(jnp.exp(m - m_new), top.shape, [1])
        m_exp = m_new - log_kb if subnormal else m_new  # subnormal: p·kb (P' is the B operand)
        ps = [jnp.exp(s - lax.broadcast_in_dim(m_exp, s.shape, [1])) for s in ss]
        # The denominator and the value zeros' share stay [64, N] tiles, their rows summed
        # once after the loop.
        l = functools.reduce(jnp.add, ps, l * corr)
        if not one_barrier and valid is None:
            plgpu.barrier_wait(vs_bar.at[slot])
        new_zt = []
        for g in range(ng):
            z = zt[g] * corr
            for j, p in enumerate(ps):
                vst = [
                    plgpu.load(vs_smem.at[slot, j, t, g], layout=row, optimized=True)
                    for t in range(2)
                ]
                if valid is not None:  # no page: statistics may be anything, even NaN
                    vst = [jnp.where(keep[j], x, jnp.zeros_like(x)) for x in vst]
                vst = [lax.broadcast_in_dim(x.astype(jnp.float32), p.shape, [0]) for x in vst]
                # A token's value scale multiplies its probability: value codes need no FMA.
                p_scaled = (p * vst[0]).astype(jnp.bfloat16)  # P', the dot's B operand
                p_smem.at[g, j].T[...] = p_scaled
                z = z + p * vst[1]
                if off:  # the dot reads code + off: take off·P' (as stored) back out
                    z = z - off * p_scaled.astype(jnp.float32)
            new_zt.append(z)
        plgpu.commit_smem()
        return m_new, corr, l, tuple(new_zt)

    def step(i, carry):
        acc, zt, m, l = carry
        slot = lax.rem(i - first, stages)
        for bar in (pos_bar,) if one_barrier else (pos_bar, ks_bar, k_bar):
            plgpu.barrier_wait(bar.at[slot])
        biases = [fold(slot, j, i) for j in range(pp)] if fold_keys else None
        if fold_keys:
            plgpu.commit_smem()

        def qk(*s_refs):
            for j, s_ref in enumerate(s_refs[:pp]):  # page j of the step
                qk_issue(slot, j, s_ref, s_refs[pp + j] if qk_split else None)
            out = tuple(s_ref[...] for s_ref in s_refs[:pp])
            if qk_split:  # S: the two halves' dots summed
                out = tuple(a + s_refs[pp + j][...] for j, a in enumerate(out))
            return out

        accs = [plgpu.ACC((PAGE, cols), jnp.float32) for _ in range(pp * (2 if qk_split else 1))]
        ss = pl.run_scoped(qk, *accs)
        m_new, corr, l, new_zt = softmax(i, slot, ss, biases, m, l, zt)
        if not one_barrier:
            plgpu.barrier_wait(v_bar.at[slot])

        def pv(*o_refs):
            pv_issue(slot, o_refs, {})
            return tuple(o[...] for o in o_refs)

        parts = pl.run_scoped(pv, *[plgpu.ACC((64, cols), jnp.float32) for _ in range(halves)])
        # The pages are read (into registers, and by the dots): refill their slot.
        plgpu.commit_smem()
        issue(i + stages, slot, i + stages < last)
        new = tuple(a * corr + part for a, part in zip(acc, parts, strict=True))
        return new, new_zt, m_new, l

    def step_overlap(i, carry):
        """Turn i of the overlapped loop (i = first ... last): the PV dots of page i - 1 (P'
        of the turn before; zero on the first turn) and the QK dot of page i issued together
        and waited for once, then page i's softmax. The last turn reads no page: its scores
        are all masked, so it only finishes page last - 1's PV."""
        acc, zt, m, l, corr_prev = carry
        valid = i < last
        slot = lax.rem(i - first, stages)
        prev = lax.rem(i - first + stages - 1, stages)  # page i - 1's slot

        @pl.when(valid)
        def _():
            wait_all(slot)

        biases = [fold(slot, 0, i)] if fold_keys else None
        if fold_keys:
            plgpu.commit_smem()

        def both(o_refs, s_ref):
            pv_issue(prev, o_refs, {})  # in flight while the key codes convert
            qk_issue(slot, 0, s_ref)
            return tuple(o[...] for o in o_refs), s_ref[...]

        o_accs = tuple(plgpu.ACC((64, cols), jnp.float32) for _ in range(halves))
        parts, s = pl.run_scoped(
            lambda *r: both(r[:-1], r[-1]), *o_accs, plgpu.ACC((PAGE, cols), jnp.float32)
        )
        acc = tuple(a * corr_prev + part for a, part in zip(acc, parts, strict=True))
        # page i - 1's codes are read: refill its slot (none before the first page)
        plgpu.commit_smem()
        issue(i - 1 + stages, prev, (i > first) & (i - 1 + stages < last))
        m_new, corr, l, new_zt = softmax(i, slot, [s], biases, m, l, zt, valid=valid)
        return acc, new_zt, m_new, l, corr

    zeros = plgpu.layout_cast(jnp.zeros((64, cols), jnp.float32), plgpu.Layout.WGMMA)
    init = (
        tuple(zeros for _ in range(halves)),
        tuple(zeros for _ in range(ng)),
        plgpu.layout_cast(jnp.full((cols,), _NEG, jnp.float32), col),
        zeros,
    )
    if overlap:
        nothing = plgpu.layout_cast(jnp.zeros((64, cols), jnp.bfloat16), plgpu.Layout.WGMMA)
        for g in range(ng):  # P' zero: the first turn's PV adds nothing
            p_smem.at[g, 0].T[...] = nothing
        plgpu.commit_smem()
        one = plgpu.layout_cast(jnp.ones((64, cols), jnp.float32), plgpu.Layout.WGMMA)
        acc, zt, m, l, _ = lax.fori_loop(first, last + 1, step_overlap, (*init, one))
    else:
        acc, zt, m, l = lax.fori_loop(first, last, step, init)
    l = l.sum(axis=0)
    has = l > 0
    safe = lax.broadcast_in_dim(jnp.where(has, l, 1.0), (64, cols), [1])
    lse = m + jnp.log(jnp.where(has, l, 1.0)) - log_kb  # (l carries kb under subnormal)
    lse_smem[...] = jnp.where(has, lse, -jnp.inf)
    zsum = [lax.broadcast_in_dim(z.sum(axis=0), (64, cols), [1]) for z in zt]
    for r, a in enumerate(acc):
        if subnormal:  # out^T came at e·kb (the dots), the zeros' tile at kb: a / e
            a = a * 2.0**SUB_SHIFT * kb  # (1/e as two factors: 2^133 is no float32)
        o_ref[b, h, split, pl.ds(r * 64, 64)] = (a + zsum[grp[r]]) / safe
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, split])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(
    jax.jit,
    static_argnames=(
        "bits",
        "scale",
        "num_splits",
        "stages",
        "int4_load",
        "return_logits",
        "pages_per_step",
        "fold_keys",
        "int4_offset",
        "one_barrier",
        "lean_barriers",
        "overlap",
        "words_lop3",
        "bias_outside",
        "tc_bias",
        "qk_split",
        "subnormal",
        "interpret",
    ),
)
def decode_attention_lowbit_mgpu(
    q: Array,
    tier: ChannelMajorLowBitTier,
    q_pos: Array,
    *,
    bits: int,
    scale: float,
    num_splits: int | None = None,
    stages: int | None = None,
    int4_load: str = "upcast2x",
    return_logits: bool = False,
    pages_per_step: int | None = None,
    fold_keys: bool | None = None,
    int4_offset: bool | None = None,
    one_barrier: bool | None = None,
    lean_barriers: bool | None = None,
    overlap: bool | None = None,
    words_lop3: bool | None = None,
    bias_outside: bool | None = None,
    tc_bias: bool | None = None,
    qk_split: bool | None = None,
    subnormal: bool | None = None,
    interpret: bool = False,
    layer: Array | None = None,
) -> Partials:
    """One decode query per sequence attending one low-bit tier (Mosaic GPU, tokens on M).

    Args:
        q: [B, Hkv, G, D] bfloat16 queries grouped by KV head (G <= 16, D % 64 == 0).
        tier: ChannelMajorLowBitTier of `bits`-bit codes in 64-token pages: packed bytes, or
            int4 codes (`to_channel_major(native=True)`; 2 bits: D = 128, 2 value groups),
            converted by Mosaic GPU's int4 → bfloat16 path.
        q_pos: [B] int32 query positions.
        bits: 2 or 4.
        scale: logit scale.
        num_splits: splits per (sequence, KV head); default: enough for the device's
            Tuning.mgpu_lowbit_target_programs CTAs.
        stages: pages in flight (TMA copies ahead of the dots); default from the Tuning.
        int4_load: how int4 codes load into registers, one of INT4_LOADS (`_native`).
        return_logits: also return the scaled logits of every slot (for the policies that rank
            by attention mass): each page's [64, N] tile stored as the page is read.
        pages_per_step: pages a loop step reads, 1 or 2 (one TMA copy of each array, one
            barrier wait, one softmax reduction and one rescale for both; with an odd P the last
            step copies the last two pages and attends only its own). Default: the device's
            Tuning.mgpu_lowbit_pages (at most P).
        fold_keys: put each page's key statistics on q instead of on the codes: the page's
            (q⊙scale)^T is stored as the QK dot's B operand and each column's Σ_c q·zero is
            added to S as a float32 bias (S = codes·(q⊙scale)^T + bias), so the key codes need
            no arithmetic but their conversion. Default: whether the device's
            Tuning.mgpu_lowbit_fold_keys names these bits.
        int4_offset: int4 codes (`native`) convert to bfloat16 as code + 136 (one permute and
            one LOP3 a pair of codes, no subtract) and the offset comes back out through the
            folded key statistics and the value zeros' tile. Needs int4 codes and fold_keys.
            Default: whether the device's Tuning.mgpu_lowbit_int4_offset names these bits,
            where those hold.
        one_barrier: a stage's five TMA copies (codes, statistics, positions) arrive on one
            barrier, waited on once a page, instead of one barrier each. Default: whether the
            device's Tuning.mgpu_lowbit_one_barrier names these bits.
        lean_barriers: launch without the warpgroup barriers Pallas adds around every
            shared-memory store and before every TMA copy (`unsafe_no_auto_barriers`). Safe
            here: each tile the loop stores (q⊙scale, P') is read only by the dots after the
            step's `commit_smem` (a fence and a barrier), and rewritten only after those dots
            were waited for; a stage is refilled only after the `commit_smem` that follows
            every register load of it. Default: whether the device's
            Tuning.mgpu_lowbit_lean_barriers names these bits.
        overlap: issue each page's QK dot together with the previous page's PV dots and wait
            for them once (one loop turn more, whose PV finishes the last page): the previous
            page's value codes and P' stay in shared memory for one more turn, so the slot
            of a page is refilled a turn later. Needs one page a step and at least 2 stages.
            Default: whether the device's Tuning.mgpu_lowbit_overlap names these bits.
        words_lop3: the words layout's code conversion, (word & mask) | bfloat16 128, as one
            inline LOP3 a register (else an AND and an OR, which ptxas emits as two LOP3s; the
            same values). Default: the device's Tuning.mgpu_lowbit_words_lop3.
        bias_outside: with fold_keys, each page's key bias (Σ_c q·zero, less the offset codes'
            share of the rounded q⊙scale) is computed by XLA before the launch (`key_bias`,
            reading the key statistics once more) and a split's biases copied to shared
            memory once, before its loop, instead of summed across the warpgroup's warps in
            the loop (a split's pages × N × 4 bytes must fit 16 KiB). Default: whether the
            device's Tuning.mgpu_lowbit_bias_outside names these bits.
        tc_bias: with fold_keys, each page's key bias is added to S by the tensor cores, in the
            QK dot's accumulator: a constant -offset A tile against the stored (q⊙scale)^T
            (the offset codes' share, exact: the codes' offset is a bfloat16 integer) and the
            page's zero row repeated in every A row against q^T (stored once a call), instead
            of the float32 sum across the warpgroup's warps. Not with bias_outside. Default:
            whether the device's Tuning.mgpu_lowbit_tc_bias names these bits.
        qk_split: with fold_keys, each page's QK dot as two independent chains of dots (key
            channels [0, D/2) and [D/2, D) into two accumulators, S their sum) instead of one
            chain of D/16 dependent dots, halving the wait before the softmax. Needs D = 128
            (two 64-channel halves; the words layout, or two code slices a byte or nibble) and
            no overlap. Default: whether the device's Tuning.mgpu_lowbit_qk_split names these
            bits, where it applies.
        subnormal: the words layout's codes become the dots' A operand by one AND a register
            (no OR of bfloat16 128): the code bits alone are a subnormal bfloat16,
            code·2^pos·2^-133, exact, and the tensor cores keep subnormal inputs. No offset
            then: the key bias is the zeros' share alone, the value zeros' tile needs no
            offset taken out. q^T and each probability carry 2^69 (their exponents: q^T before
            the launch, p by its max), so the dots give S and out^T at 2^-64 of their size,
            scaled back with the logit scale and at the end. Needs the words layout; not with
            tc_bias. Default: whether the device's Tuning.mgpu_lowbit_subnormal names these
            bits, for the words layout.
        interpret: run in the Mosaic GPU interpreter (CPU tests).
        layer: None, or an int32 scalar: the tier's code, statistics and position arrays are
            then stacks [L, ...] of a stacked cache, read at this layer in place (no slice of
            the stack is copied); `extent` is the layer's own [B, Hkv].

    Returns:
        Partials with out [B, Hkv, S, G, D], lse [B, Hkv, S, G] and, with return_logits,
        logits [B, Hkv, G, P·64] (-inf where a slot is not visible; pages at or past the
        extent are not read, their logits undefined, as the other kernels' unread slots).
    """
    check_query(q, q_pos)
    if not isinstance(tier, ChannelMajorLowBitTier):
        check_channel_major(tier, q, bits)  # raises: names what was given
    data = (tier.k, tier.v, tier.k_stats, tier.v_stats, tier.pos)
    view, data, lay = layer_arrays(tier, data, layer)
    check_channel_major(view, q, bits)
    why = mgpu_lowbit_applies(view, q)
    if why:
        raise ValueError(f"decode attention (Mosaic GPU low-bit): unsupported {why}")
    if int4_load not in INT4_LOADS:
        raise ValueError(f"int4_load must be one of {INT4_LOADS}, got {int4_load!r}")
    b, hkv, group, d = q.shape
    pages = view.k.shape[2]
    tune = tuning_for()
    if pages_per_step is None:
        pp = min(tune.mgpu_lowbit_pages, pages)
    elif pages_per_step not in (1, 2):
        raise ValueError(f"pages_per_step must be 1 or 2, got {pages_per_step!r}")
    elif pages < pages_per_step:
        raise ValueError(f"pages_per_step={pages_per_step} needs as many pages, got {pages}")
    else:
        pp = pages_per_step
    steps = -(-pages // pp)
    words = view.k.dtype == jnp.uint32  # to_channel_major(words=True)
    if words and fold_keys is False:
        raise ValueError(
            "decode attention (Mosaic GPU low-bit): the words layout needs fold_keys (its codes"
            " convert to 128 + code·2^pos, the powers of two divided out of q), got fold_keys=False"
        )
    fold = bits in tune.mgpu_lowbit_fold_keys if fold_keys is None else bool(fold_keys)
    fold = fold or words
    one_barrier = bits in tune.mgpu_lowbit_one_barrier if one_barrier is None else bool(one_barrier)
    lean = bits in tune.mgpu_lowbit_lean_barriers if lean_barriers is None else bool(lean_barriers)
    native = view.k.dtype == jnp.int4
    if int4_offset is None:
        offset = bits in tune.mgpu_lowbit_int4_offset and native and fold
    elif int4_offset and not (native and fold):
        raise ValueError(
            "decode attention (Mosaic GPU low-bit): int4_offset=True needs int4 codes"
            " (to_channel_major(native=True)) and fold_keys"
            f" (got {view.k.dtype} codes, fold_keys={fold})"
        )
    else:
        offset = bool(int4_offset)
    stages = max(1, min(stages or tune.mgpu_stages, steps))
    overlap = bits in tune.mgpu_lowbit_overlap if overlap is None else bool(overlap)
    if overlap and pp != 1:
        raise ValueError(
            f"decode attention (Mosaic GPU low-bit): overlap needs pages_per_step=1, got {pp}"
        )
    if overlap:  # page i - 1's slot is refilled after turn i: two stages at least
        stages = max(stages, 2)
    outside = bits in tune.mgpu_lowbit_bias_outside if bias_outside is None else bias_outside
    if outside and not fold:
        raise ValueError(
            "decode attention (Mosaic GPU low-bit): bias_outside=True needs fold_keys (the bias"
            " is the folded keys' zeros on q)"
        )
    if tc_bias is None:  # a Tuning's choice applies where it can
        tc = bits in tune.mgpu_lowbit_tc_bias and fold and not outside
    else:
        tc = bool(tc_bias)
    if tc and not fold:
        raise ValueError(
            "decode attention (Mosaic GPU low-bit): tc_bias=True needs fold_keys (the bias is "
            "the folded keys' zeros on q)"
        )
    if tc and outside:
        raise ValueError(
            "decode attention (Mosaic GPU low-bit): tc_bias=True and bias_outside=True are two "
            "ways to the same key bias: pick one"
        )
    n_slices = 1 if words else (4 if native else 8) // bits
    split_ok = fold and not overlap and d == 128 and (words or n_slices == 2)
    default_split = bits in tune.mgpu_lowbit_qk_split and split_ok  # where it applies
    qsplit = default_split if qk_split is None else bool(qk_split)
    if qsplit and not split_ok:
        raise ValueError(
            "decode attention (Mosaic GPU low-bit): qk_split=True needs fold_keys, no overlap, "
            "D=128 and the words layout or two code slices a stored byte/nibble (got "
            f"fold_keys={fold}, overlap={overlap}, D={d}, {view.k.dtype} codes at {bits} bits)"
        )
    if subnormal is None:
        sub = words and bits in tune.mgpu_lowbit_subnormal and not tc
    else:
        sub = bool(subnormal)
    if sub and not words:
        raise ValueError(
            "decode attention (Mosaic GPU low-bit): subnormal=True needs the words layout "
            f"(to_channel_major(words=True)), got {view.k.dtype} codes"
        )
    if sub and tc:
        raise ValueError(
            "decode attention (Mosaic GPU low-bit): subnormal=True and tc_bias=True: the key "
            "bias's dots would add it to S at another scale; pick one"
        )
    splits = num_splits or _num_splits(b, hkv, steps, tune.mgpu_lowbit_target_programs)
    cols = 8 if group <= 8 else COLS
    mp = bias_pages(steps, splits, pp)  # a split's most pages: its biases in shared memory
    if outside and mp * cols * 4 > BIAS_SMEM:
        raise ValueError(
            f"decode attention (Mosaic GPU low-bit): bias_outside=True holds a split's key "
            f"biases in shared memory, {mp} pages x {cols} columns x 4 bytes > {BIAS_SMEM}: "
            "use more splits (num_splits) or bias_outside=False"
        )
    qp = jnp.pad(q, ((0, 0), (0, 0), (0, cols - group), (0, 0)))  # [B, Hkv, N, D]
    # fold_keys: q^T in float32 for the per-page products; else a placeholder never read
    qt = jnp.swapaxes(qp, -1, -2).astype(jnp.float32) if fold else jnp.zeros((1,), jnp.float32)
    if words:  # each key channel's power of two (`word_factor`) divided out of q, exactly
        qt = qt / jnp.asarray(word_factor(bits, d))[None, None, :, None]
    if sub:  # q^T at kb times its size (a power of two: exact)
        qt = qt * subnormal_kb(interpret)
    if outside:
        off = _code_offset(offset, words, sub)
        k_stats = tier.k_stats if layer is None else jnp.take(tier.k_stats, layer, axis=0)
        # MP pages of zeros past the end: a split's one copy of MP pages from its first page
        # stays inside the array (the pages past its own are never read)
        bias = jnp.pad(key_bias(qt, k_stats, off), ((0, 0), (0, 0), (0, mp), (0, 0)))
    else:
        bias = jnp.zeros((1,), jnp.float32)  # a placeholder never read
    f32 = jnp.float32
    out_type = [
        jax.ShapeDtypeStruct((b, hkv, splits, d, cols), f32),
        jax.ShapeDtypeStruct((b, hkv, splits, cols), f32),
    ]
    if return_logits:
        out_type.append(jax.ShapeDtypeStruct((b, hkv, pages, PAGE, cols), f32))
    ng = view.v_stats.shape[4]
    if words:  # [W, 128] uint32 a page, keys and values alike
        codes = [plgpu.SMEM((stages, pp, *view.k.shape[3:]), jnp.uint32)] * 2
    elif native:  # int4 tiles laid out for the loads the int4 → bfloat16 conversion takes
        codes = [
            smem_tile((stages, pp, PAGE, d * bits // 4), jnp.int4),
            smem_tile((stages, pp, d * bits // 4, PAGE), jnp.int4),
        ]
    else:
        kbytes, vbytes = view.k.shape[-1], view.v.shape[-1]
        codes = [
            plgpu.SMEM((stages, pp, PAGE, kbytes), jnp.uint8),
            plgpu.SMEM((stages, pp, d, vbytes), jnp.uint8),
        ]
    scratch = [
        smem_tile((cols, d), jnp.bfloat16),
        *codes,
        plgpu.SMEM((stages, pp, 2, d), jnp.bfloat16),
        plgpu.SMEM((stages, pp, 2, ng, PAGE), jnp.bfloat16),
        plgpu.SMEM((stages, pp, PAGE), jnp.int32),
        smem_tile((ng, pp, cols, PAGE), jnp.bfloat16),
        plgpu.SMEM((cols,), f32),
    ]
    if fold:  # (q⊙scale) of each page of a step, K-major as q_smem
        scratch += [smem_tile((pp, cols, d), jnp.bfloat16)]
    if outside:  # the split's pages' biases, copied once before its loop
        scratch += [plgpu.SMEM((mp, cols), f32)]
    if tc:  # q^T (over the words' powers of two) as bfloat16, K-major as q_smem
        scratch += [smem_tile((cols, d), jnp.bfloat16)]
    if interpret:
        scratch += [smem_tile((PAGE, d), jnp.bfloat16), smem_tile((64, PAGE), jnp.bfloat16)]
    scratch += [plgpu.Barrier(num_barriers=1)]
    if outside:  # the biases' copies (one a BIAS_BOX pages) arrive on one barrier
        scratch += [plgpu.Barrier(num_arrivals=-(-mp // BIAS_BOX), num_barriers=1)]
    copies = 5  # TMA copies a stage
    if one_barrier:
        scratch += [plgpu.Barrier(num_arrivals=copies, num_barriers=stages)]
    else:
        scratch += [plgpu.Barrier(num_barriers=stages)] * copies
    body = functools.partial(
        _kernel,
        bits=bits,
        scale=scale,
        stages=stages,
        num_splits=splits,
        interpret=interpret,
        native=native,
        int4_load=int4_load,
        return_logits=return_logits,
        pages_per_step=pp,
        fold_keys=fold,
        offset=offset,
        one_barrier=one_barrier,
        words=words,
        overlap=overlap,
        lop3=tune.mgpu_lowbit_words_lop3 if words_lop3 is None else bool(words_lop3),
        bias_outside=bool(outside),
        tc_bias=tc,
        qk_split=qsplit,
        subnormal=sub,
    )
    launch = decode_grid(
        body,
        out_type,
        scratch,
        (b, hkv, splits),
        f"kvjax_decode_int{bits}_mgpu",
        interpret,
        auto_barriers=not lean,
    )
    o, lse, *lg = launch(lay, tier.extent, q_pos, qp, qt, *data, bias)
    out = jnp.swapaxes(o, -1, -2)[..., :group, :]
    logits = None
    if return_logits:  # [B, Hkv, P, 64, N] -> [B, Hkv, G, P·64]
        logits = jnp.moveaxis(lg[0][..., :group], -1, 2).reshape(b, hkv, group, pages * PAGE)
    return Partials(out, lse[..., :group], logits)
