"""The arrays a decode-attention kernel reads: one tuple per storage tier, plus its partial results.

Kernels know no cache class: these tuples name the arrays (and their shapes) that kvjax's cache
holds per layer, so `kvjax.attention` can hand a layer's tiers over without the kernels importing
kvjax. Axis letters: B batch, Hkv KV heads, G query heads per KV head, D head dim, C slots,
P low-bit pages, Tp tokens per page, Dp = D·bits/8 packed bytes, NG value groups, S splits.
"""

from __future__ import annotations

from typing import NamedTuple

import jax

Array = jax.Array


class FullTier(NamedTuple):
    """Full-precision slots.

    Attributes:
        k: [B, Hkv, C, D] keys after RoPE (bfloat16, float16 or float32).
        v: [B, Hkv, C, D] values, same dtype.
        pos: [B, Hkv, C] int32 original positions; -1 marks an empty slot (anywhere).
        extent: [B, Hkv] int32, one past the last occupied slot; nothing at or after it is read.
    """

    k: Array
    v: Array
    pos: Array
    extent: Array


class PooledTier(NamedTuple):
    """Full-precision slots of ONE pool shared by a layer's KV heads (head-adaptive budgets):
    each slot carries the KV head that owns it; a query head sees only its KV head's slots.

    Attributes:
        k: [B, 1, P, D] keys after RoPE (bfloat16, float16 or float32).
        v: [B, 1, P, D] values, same dtype.
        pos: [B, 1, P] int32 original positions; -1 marks an empty slot (anywhere).
        head: [B, 1, P] int32 KV head owning each slot.
        extent: [B, 1] int32, one past the last occupied slot of the pool.
    """

    k: Array
    v: Array
    pos: Array
    head: Array
    extent: Array


class Int8Tier(NamedTuple):
    """Symmetric INT8 slots with one float32 scale per token and KV head.

    Attributes:
        k: [B, Hkv, C, D] int8 key codes (key = k · k_scale).
        v: [B, Hkv, C, D] int8 value codes.
        k_scale: [B, Hkv, C] float32.
        v_scale: [B, Hkv, C] float32.
        pos: [B, Hkv, C] int32, -1 = empty.
        extent: [B, Hkv] int32, one past the last occupied slot.
    """

    k: Array
    v: Array
    k_scale: Array
    v_scale: Array
    pos: Array
    extent: Array


class LowBitTier(NamedTuple):
    """Pages of Tp tokens of packed 2/4/8-bit codes (kvjax.quant.pack layout), KIVI style.

    Attributes:
        k: [B, Hkv, P, Tp, Dp] uint8 packed key codes.
        v: [B, Hkv, P, Tp, Dp] uint8 packed value codes.
        k_scale, k_zero: [B, Hkv, P, D] float (kvjax stores bfloat16), per page and channel
            (key = code·scale + zero); kernels read them in their dtype and compute in float32.
        v_scale, v_zero: [B, Hkv, P, Tp, NG] float (bfloat16 in kvjax), per token and group of
            D/NG channels.
        pos: [B, Hkv, P, Tp] int32, -1 = not attended (a held page can be dormant).
        extent: [B, Hkv] int32, one past the last page with an attended token.
    """

    k: Array
    v: Array
    k_scale: Array
    k_zero: Array
    v_scale: Array
    v_zero: Array
    pos: Array
    extent: Array


class ChannelMajorLowBitTier(NamedTuple):
    """The low-bit tier in the Mosaic GPU kernel's layout (`to_channel_major`): pages of
    Tp = 64 tokens, values packed along the page's tokens (channel-major), every byte XOR
    0x80 (the top code slice sign-flipped), statistics kernel-ready and stacked so that a page
    streams as five copies.

    Attributes:
        k: [B, Hkv, P, Tp, D·bits/8] uint8: key codes packed along D (`kvjax.quant.pack`), ^0x80.
        v: [B, Hkv, P, D, Tp·bits/8] uint8: value codes packed along the page's tokens: byte j
            of channel d holds tokens j + i·Tp·bits/8 at bits i·bits; ^0x80.
        k_stats: [B, Hkv, P, 2, D] bfloat16 per page and channel: (scale·2^-(c·bits),
            zero + [c top]·2^(bits-1)·scale), c the code slice of the channel.
        v_stats: [B, Hkv, P, 2, NG, Tp] bfloat16 per token and group of D/NG channels, the
            same two with c the code slice of the token.
        pos: [B, Hkv, P, Tp] int32, -1 = not attended.
        extent: [B, Hkv] int32, one past the last page with an attended token.

    With `to_channel_major(native=True)`, k is [B, Hkv, P, Tp, D·bits/4] and v
    [B, Hkv, P, D·bits/4, Tp] `int4` arrays, 4/bits code slices a nibble, every nibble XOR 8
    (statistics as above, per nibble slice): Mosaic GPU converts int4 registers to bfloat16
    without a conversion instruction.
    """

    k: Array
    v: Array
    k_stats: Array
    v_stats: Array
    pos: Array
    extent: Array


class Partials(NamedTuple):
    """What one tier's kernel returns: attention restricted to each split of that tier.

    Attributes:
        out: [B, Hkv, S, G, D] float32, softmax-weighted values of the split (0 if it saw nothing).
        lse: [B, Hkv, S, G] float32 log-sum-exp of the split's scaled logits (-inf if nothing).
        logits: [B, Hkv, G, C] float32 scaled logits of every slot the kernel read (only with
            return_logits; slots past the extent or masked hold arbitrary values — mask by pos),
            or None. For the low-bit tier C = P·Tp in page order.
    """

    out: Array
    lse: Array
    logits: Array | None
