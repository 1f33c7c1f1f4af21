"""Low-bit pages as 32-bit words in the order of the Mosaic GPU decode kernel's dot registers
(the "words" layout), and back.

Thread t of the kernel's warpgroup finds the codes of its wgmma A fragment in words it reads
with one 128-bit load each, and turns a pair of them into the two bfloat16 values of a register
with one AND-OR (a LOP3) and, for every other pair, a shift: the code lies in the low mantissa
bits of bfloat16 128.0 (0x4300), so the value is 128 + code·2^pos, pos the code's place in its
half-word. The kernel takes the 128 back out through the statistics and the power of two through
kernel-ready statistics: key zeros times 2^pos of their channel (the kernel divides q by it),
value scales divided by 2^pos of their token. Both are exact (powers of two), so the codes and
statistics are those of `quantize_per_channel` / `quantize_per_token` and the bound stays
|x − dequantized| ≤ scale / 2.

Shapes, for a page of T = 64 tokens and D channels at `bits` ∈ {2, 4} (D·bits a multiple of
256, D a multiple of 64, value groups of a multiple of 64 channels):

    k:       [..., D·bits/64, 128] uint32   key codes, one [64 tokens, D] A tile
    v:       [..., D·bits/64, 128] uint32   value codes, D/64 A tiles [64 channels, 64 tokens]
    k_stats: [..., 2, D] bfloat16           (scale, zero·2^pos) per channel
    v_stats: [..., 2, NG, T] bfloat16       (scale·2^-pos, zero) per value group and token
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.quant._checks import as_float, check_out_dtype
from kvjax.quant._kernel_layout import quantize_offset
from kvjax.quant._lowbit import STAT_DTYPE

Array = jax.Array

WORD_BASE = 128.0  # what the words layout's conversion adds to a code: bfloat16 0x4300
WORDS_PAGE = 64  # tokens a page: the rows of a warpgroup dot
WORDS_BITS = (2, 4)


def word_place(bits: int, k: int, rows=None, cols=None) -> tuple:
    """Where each code of a [64, k] wgmma A tile lies in the words layout: (thread, the
    thread's word j, shift window sh, place pos), each [64, k] (numpy; or of the given row and
    column index arrays, numpy or jnp alike).

    Register (k8, r2) of thread t = 32·warp + lane holds row 16·warp + 8·r2 + lane // 4 and
    columns 8·k8 + 2·(lane % 4) + e, e = 0, 1 (the wgmma fragment). Its pair of codes sits in
    word j at bits 4·sh + pos (e = 0) and 16 + 4·sh + pos (e = 1): 2 bits: four k8 a word, the
    rows' two halves r2 in neighbouring windows, pos = 2·(k8 mod 2); 4 bits: two k8 a word,
    pos = 0. A window holds one pair (4 bits) or two (2 bits) within the 7 mantissa bits."""
    if rows is None:
        rows, cols = np.meshgrid(np.arange(64), np.arange(k), indexing="ij")
    warp, r2 = rows // 16, (rows % 16) // 8
    lane = (rows % 8) * 4 + (cols % 8) // 2
    k8 = cols // 8
    if bits == 2:
        j, a = k8 // 4, k8 % 4
        sh, pos = 2 * (a // 2) + r2, 2 * (a % 2)
    else:
        j, a = k8 // 2, k8 % 2
        sh, pos = 2 * a + r2, a * 0
    return warp * 32 + lane, j, sh, pos


def word_source_of(bits: int, k: int, parts: int, part, rows, cols) -> tuple:
    """(flat word index, bit) of the codes at `rows`, `cols` of tile `part` (index arrays,
    numpy or jnp): `word_source` for given indices, so that a kernel can compute it."""
    thread, j, sh, pos = word_place(bits, k, rows, cols)
    jj = part * (k * bits // 64) + j
    return ((jj // 4) * 128 + thread) * 4 + jj % 4, 4 * sh + pos + 16 * (cols % 2)


def word_factor(bits: int, k: int) -> np.ndarray:
    """[k] float32: the power of two 2^pos that the words layout's conversion multiplies the
    codes of each column of a [64, k] A tile by (`word_place`)."""
    return np.exp2(word_place(bits, k)[3][0]).astype(np.float32)


def word_source(bits: int, k: int, parts: int) -> tuple[np.ndarray, np.ndarray]:
    """(flat word index [parts, 64, k], bit [parts, 64, k]) of each code of `parts` [64, k] A
    tiles in the words array [W, 128] of W = parts·k·bits/64 words a thread, flattened: the
    thread's word J lies at ((J // 4)·128 + thread)·4 + J % 4, so that one 128-bit load in
    Mosaic GPU's strided layout (WG_STRIDED, 4 words a thread) reads four of its words."""
    part, rows, cols = np.meshgrid(np.arange(parts), np.arange(64), np.arange(k), indexing="ij")
    return word_source_of(bits, k, parts, part, rows, cols)


def _digits(bits: int, k: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The mixed-radix digits of a [64, k] tile's row and column that `word_place` reads: rows
    (warp 4, r2 2, r8 8); columns (j, then the k8 digits a word holds, c4 4, e 2), j the
    thread's word in the tile (2 bits: four k8 a word, digits a1, a0; 4 bits: two, digit a)."""
    per = k * bits // 64
    cols = (per, 2, 2, 4, 2) if bits == 2 else (per, 2, 4, 2)
    return (4, 2, 8), cols


def pack_words(tiles: Array, bits: int) -> Array:
    """Codes of `parts` [64, k] A tiles [..., parts, 64, k] (unsigned, < 2^bits) → the words
    layout [..., W, 128] uint32 (`word_source`), by reshapes, one transpose and a shift-sum
    (`word_place`'s placement is a permutation of the indices' digits).

    Word (J, thread) of the flat order ((J // 4)·128 + thread)·4 + J % 4 is [W, 128] element
    [4·(J // 4) + warp, 16·r8 + 4·c4 + J % 4]; its 32/bits slots hold, low bits first, the
    codes of digits (e, a1, r2, a0) at 2 bits and (e, a, r2) at 4 bits."""
    parts, _, k = tiles.shape[-3:]
    lead = tiles.shape[:-3]
    (nw, nr2, nr8), cols = _digits(bits, k)
    x = tiles.astype(jnp.uint32).reshape(*lead, parts, nw, nr2, nr8, *cols)
    n = len(lead)
    p_, w_, r2_, r8_ = n, n + 1, n + 2, n + 3
    if bits == 2:
        j_, a1_, a0_, c4_, e_ = range(n + 4, n + 9)
        slots = (e_, a1_, r2_, a0_)
    else:
        j_, a_, c4_, e_ = range(n + 4, n + 8)
        slots = (e_, a_, r2_)
    x = jnp.transpose(x, (*range(n), p_, j_, w_, r8_, c4_, *slots))
    jj = parts * cols[0]  # the thread's words over all tiles: J = part·per + j
    x = x.reshape(*lead, jj // 4, 4, nw, nr8, 4, 32 // bits)  # J → (J // 4, J % 4)
    x = jnp.moveaxis(x, n + 1, n + 4)  # [.., J // 4, warp, r8, c4, J % 4, slot]
    shifts = jnp.arange(0, 32, bits, dtype=jnp.uint32).reshape((1,) * (x.ndim - 1) + (-1,))
    words = jnp.sum(x << shifts, axis=-1, dtype=jnp.uint32)  # disjoint bits: sum = OR
    return words.reshape(*lead, jj, 128)


def unpack_words(words: Array, bits: int, parts: int, k: int) -> Array:
    """`pack_words`' inverse: the words layout [..., W, 128] → the codes of its `parts` [64, k]
    A tiles [..., parts, 64, k] uint8."""
    lead = words.shape[:-2]
    n = len(lead)
    (nw, nr2, nr8), cols = _digits(bits, k)
    jj = parts * cols[0]
    x = words.reshape(*lead, jj // 4, nw, nr8, 4, 4)  # [.., J // 4, warp, r8, c4, J % 4]
    shifts = jnp.arange(0, 32, bits, dtype=jnp.uint32).reshape((1,) * x.ndim + (-1,))
    x = (x[..., None] >> shifts) & jnp.uint32((1 << bits) - 1)  # [.., slot]
    x = jnp.moveaxis(x, n + 4, n + 1)  # [.., J // 4, J % 4, warp, r8, c4, slot]
    sl = (2, 2, 2, 2) if bits == 2 else (2, 2, 2)  # (e, a1, r2, a0) or (e, a, r2)
    x = x.reshape(*lead, parts, cols[0], nw, nr8, 4, *sl)
    p_, j_, w_, r8_, c4_ = range(n, n + 5)
    if bits == 2:
        e_, a1_, r2_, a0_ = range(n + 5, n + 9)
        order = (p_, w_, r2_, r8_, j_, a1_, a0_, c4_, e_)
    else:
        e_, a_, r2_ = range(n + 5, n + 8)
        order = (p_, w_, r2_, r8_, j_, a_, c4_, e_)
    x = jnp.transpose(x, (*range(n), *order))
    return x.astype(jnp.uint8).reshape(*lead, parts, 64, k)


def check_words_layout(head_dim: int, bits: int, value_groups: int) -> None:
    """A ValueError unless the words layout holds D = head_dim at `bits` with that many value
    groups: bits 2 or 4, D·bits a multiple of 256 (whole 128-bit loads a thread), D a multiple of
    64 and value groups of a multiple of 64 channels."""
    if bits not in WORDS_BITS:
        raise ValueError(f"the words layout holds {WORDS_BITS}-bit codes, got bits={bits}")
    if (head_dim * bits) % 256 or head_dim % 64:
        raise ValueError(
            f"the words layout needs head_dim·bits a multiple of 256 and head_dim a multiple "
            f"of 64, got head_dim={head_dim} at {bits} bits"
        )
    if value_groups <= 0 or head_dim % value_groups or (head_dim // value_groups) % 64:
        raise ValueError(
            f"the words layout needs value groups of a multiple of 64 channels, got head_dim="
            f"{head_dim} in {value_groups} value groups"
        )


def quantize_words_pages(
    xk: Array, xv: Array, bits: int, value_groups: int
) -> tuple[Array, Array, Array, Array]:
    """Pages of keys and values [..., 64, D] → (k, v, k_stats, v_stats) in the words layout
    (module docstring): keys per channel over the page's 64 tokens, values per token over
    `value_groups` groups of channels, by `kvjax.quant`'s rule (`quantize_offset`, offset 0)."""
    xk, xv = as_float(xk, "xk"), as_float(xv, "xv")
    if xk.ndim < 2 or xk.shape != xv.shape or xk.shape[-2] != WORDS_PAGE:
        raise ValueError(
            f"xk and xv must be [..., {WORDS_PAGE}, D] alike, got {xk.shape} and {xv.shape}"
        )
    d = xk.shape[-1]
    check_words_layout(d, bits, value_groups)
    kc, ks, kz = quantize_offset(xk, bits, -2, 0)  # [.., T, D], [.., 1, D]
    grouped = xv.reshape(*xv.shape[:-1], value_groups, d // value_groups)
    vc, vs, vz = quantize_offset(grouped, bits, -1, 0)  # [.., T, NG, D/NG], [.., T, NG, 1]
    vc = jnp.swapaxes(vc.reshape(xv.shape), -1, -2)  # [.., D, T]
    vt = vc.reshape(*vc.shape[:-2], d // 64, 64, WORDS_PAGE)  # 64-channel A tiles
    lead = (1,) * (xk.ndim - 2)
    kf = jnp.asarray(word_factor(bits, d)).reshape(*lead, d)  # per key channel
    vf = jnp.asarray(word_factor(bits, WORDS_PAGE)).reshape(*lead, 1, WORDS_PAGE)  # per token
    f32 = jnp.float32
    k_stats = jnp.stack([ks[..., 0, :].astype(f32), kz[..., 0, :].astype(f32) * kf], axis=-2)
    vsc = jnp.swapaxes(vs[..., 0].astype(f32), -1, -2)  # [.., NG, T]
    vze = jnp.swapaxes(vz[..., 0].astype(f32), -1, -2)
    v_stats = jnp.stack([vsc / vf, vze], axis=-3)  # [.., 2, NG, T]
    return (
        pack_words(kc[..., None, :, :], bits),
        pack_words(vt, bits),
        k_stats.astype(STAT_DTYPE),
        v_stats.astype(STAT_DTYPE),
    )


def dequantize_words_pages(
    k: Array, v: Array, k_stats: Array, v_stats: Array, bits: int, dtype: Any = jnp.float32
) -> tuple[Array, Array]:
    """Inverse of `quantize_words_pages`: keys and values [..., 64, D] `dtype`, computed in
    float32 (code·scale + zero, the powers of two taken back out of the statistics exactly)."""
    if k.dtype != jnp.uint32 or v.dtype != jnp.uint32:
        raise ValueError(f"words-layout codes must be uint32, got {k.dtype} and {v.dtype}")
    d = k_stats.shape[-1]
    f32 = jnp.float32
    kc = unpack_words(k, bits, 1, d)[..., 0, :, :].astype(f32)  # [.., T, D]
    lead = (1,) * (k_stats.ndim - 2)
    kf = jnp.asarray(word_factor(bits, d)).reshape(*lead, 1, d)
    ks = k_stats.astype(f32)
    xk = kc * ks[..., :1, :] + (ks[..., 1:, :] / kf)
    vt = unpack_words(v, bits, d // 64, WORDS_PAGE).astype(f32)  # [.., D/64, 64 ch, T]
    vc = jnp.swapaxes(vt.reshape(*vt.shape[:-3], d, WORDS_PAGE), -1, -2)  # [.., T, D]
    ng = v_stats.shape[-2]
    vf = jnp.asarray(word_factor(bits, WORDS_PAGE)).reshape(*lead, WORDS_PAGE, 1)
    vs = jnp.swapaxes(v_stats.astype(f32), -1, -2)  # [.., 2, T, NG]
    scale, zero = vs[..., 0, :, :] * vf, vs[..., 1, :, :]
    grouped = vc.reshape(*vc.shape[:-1], ng, d // ng)
    xv = grouped * scale[..., None] + zero[..., None]
    out = check_out_dtype(dtype)
    return xk.astype(out), xv.reshape(vc.shape).astype(out)
