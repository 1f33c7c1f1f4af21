"""The KV cache: one immutable, fixed-shape pytree of slots per KV head.

Every layer owns its own buffers (a tuple entry per layer) so that a decode step reads each
layer's live bytes once and updates them in place inside the jitted loop; nothing ever changes
shape, and positions are original token positions (keys are stored after RoPE).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.quant import (
    STAT_DTYPE,
    check_kernel_layout,
    check_words_layout,
    dequantize_kernel_pages,
    dequantize_per_channel,
    dequantize_per_token,
    dequantize_words_pages,
    pack,
    quantize_kernel_pages,
    quantize_keys_values,
    quantize_words_pages,
    unpack,
)

Array = jax.Array

EMPTY = -1  # `pos` of an unoccupied slot
LOWBIT_LAYOUTS = ("token", "kernel", "words")
KERNEL_LAYOUTS = ("kernel", "words")  # those held by `KernelLowBitTier`, in 64-token pages
KERNEL_PAGE = 64  # tokens per page of the kernel layout: the rows of a warpgroup dot


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheSpec:
    """Static shape of a cache.

    Attributes:
        batch: B.
        num_kv_heads: Hkv.
        head_dim: D.
        capacities: C per layer (a tuple of L ints; pyramidal policies give layers different C).
        dtype: storage dtype of the full-precision tier.
        int8_capacities: slots of the INT8 tier per layer (None: no INT8 tier).
        lowbit_pages: pages of the low-bit tier per layer (None: no low-bit tier).
        lowbit_page_size: G, tokens per low-bit page (keys share per-channel statistics).
        lowbit_bits: code width of the low-bit tier.
        lowbit_value_group: channels per value scale/zero group.
        lowbit_layout: "token" (`LowBitTier`: packed bytes, token-major; every backend's
            kernels) or "kernel" (`KernelLowBitTier`: int4 codes, values channel-major,
            kernel-ready statistics; the Mosaic GPU low-bit kernel reads it as stored; 64-token
            pages, 2 or 4 bits, `kvjax.quant.check_kernel_layout`) or "words"
            (`KernelLowBitTier` with uint32 codes in the order of that kernel's dot registers,
            `kvjax.quant.quantize_words_pages`: fewer instructions a page for the kernel; 64-token
            pages, 2 or 4 bits, `kvjax.quant.check_words_layout`).
        pooled: each layer's full-precision slots form ONE pool of Hkv·C slots shared by its
            KV heads, each slot carrying its head (head-adaptive budgets, `adakv`); C is then
            the mean slots per KV head.
    """

    batch: int
    num_kv_heads: int
    head_dim: int
    capacities: tuple[int, ...]
    dtype: Any = jnp.float32
    int8_capacities: tuple[int, ...] | None = None
    lowbit_pages: tuple[int, ...] | None = None
    lowbit_page_size: int = 32
    lowbit_bits: int = 2
    lowbit_value_group: int = 32
    lowbit_layout: str = "token"
    pooled: bool = False

    def __post_init__(self) -> None:
        if self.batch <= 0 or self.num_kv_heads <= 0 or self.head_dim <= 0:
            raise ValueError(
                f"CacheSpec dims must be > 0, got batch={self.batch}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
            )
        if not self.capacities or min(self.capacities) <= 0:
            raise ValueError(
                f"CacheSpec.capacities must be non-empty and > 0, got {self.capacities}"
            )
        if self.int8_capacities is not None and (
            len(self.int8_capacities) != len(self.capacities) or min(self.int8_capacities) <= 0
        ):
            raise ValueError(
                f"CacheSpec.int8_capacities must give one capacity > 0 per layer, "
                f"got {self.int8_capacities}"
            )
        if self.lowbit_layout not in LOWBIT_LAYOUTS:
            raise ValueError(
                f"CacheSpec.lowbit_layout must be one of {LOWBIT_LAYOUTS}, "
                f"got {self.lowbit_layout!r}"
            )
        if self.lowbit_pages is not None and self.lowbit_layout in KERNEL_LAYOUTS:
            if self.lowbit_page_size != KERNEL_PAGE:
                raise ValueError(
                    f"CacheSpec.lowbit_layout {self.lowbit_layout!r} needs {KERNEL_PAGE}-token "
                    "pages, "
                    f"got lowbit_page_size={self.lowbit_page_size}"
                )
            if self.head_dim % self.lowbit_value_group:
                raise ValueError(
                    f"lowbit_value_group {self.lowbit_value_group} must divide head_dim "
                    f"{self.head_dim}"
                )
            check = check_words_layout if self.lowbit_layout == "words" else check_kernel_layout
            check(self.head_dim, self.lowbit_bits, self.head_dim // self.lowbit_value_group)
        if self.pooled and (self.int8_capacities is not None or self.lowbit_pages is not None):
            raise ValueError("CacheSpec.pooled holds full-precision slots only (no INT8/low-bit)")

    @property
    def num_layers(self) -> int:
        return len(self.capacities)

    @property
    def slot_bytes(self) -> int:
        """Bytes of K and V data in one full-precision slot of one KV head."""
        return 2 * self.head_dim * np.dtype(self.dtype).itemsize


@struct.dataclass
class Int8Tier:
    """Slots stored as symmetric INT8, one scale per token and KV head (written once).

    Attributes:
        k: [B, Hkv, Cq, D] int8 key codes (keys after RoPE).
        v: [B, Hkv, Cq, D] int8 value codes.
        k_scale: [B, Hkv, Cq] float32 (key = k * k_scale).
        v_scale: [B, Hkv, Cq] float32.
        pos: [B, Hkv, Cq] int32 original positions; EMPTY if free.
        score: [B, Hkv, Cq] float32 policy score.
    """

    k: Array
    v: Array
    k_scale: Array
    v_scale: Array
    pos: Array
    score: Array

    @property
    def capacity(self) -> int:
        return self.pos.shape[-1]

    def live_slots(self) -> Array:
        """[B, Hkv] int32 occupied slots."""
        return jnp.sum(self.pos >= 0, axis=-1, dtype=jnp.int32)

    def slot_bytes(self) -> int:
        """K/V bytes of one slot of one KV head: codes plus their scales."""
        return (self.k.shape[-1] + self.v.shape[-1]) * 1 + 2 * self.k_scale.dtype.itemsize


def lowbit_page_bytes(
    head_dim: int, page_size: int, bits: int, value_group: int, stat_bytes: int | None = None
) -> int:
    """K/V bytes of one low-bit page of one KV head: packed K and V codes, per-channel key
    scale/zero (one per page) and per-token value scale/zero per channel group, the statistics in
    `kvjax.quant.STAT_DTYPE` (bfloat16, 2 bytes each; `stat_bytes` overrides).

    E.g. D 128, G 32, 4 bits, value group 32: codes 2·32·64 = 4096, key statistics 2·128·2 = 512,
    value statistics 2·32·4·2 = 512: 5120 bytes, 160 per token (192 with float32 statistics).
    """
    s = np.dtype(STAT_DTYPE).itemsize if stat_bytes is None else stat_bytes
    codes = 2 * page_size * head_dim * bits // 8
    stats = 2 * head_dim * s + 2 * page_size * (head_dim // value_group) * s
    return codes + stats


class _Pages:
    """What both low-bit tiers share: pages of `pos.shape[-1]` tokens, `held` pages in use, the
    bytes of a page from the statistics' shapes (`_stats`: D, value groups, a statistics
    array)."""

    pos: Array
    held: Array
    bits: int

    def _stats(self) -> tuple[int, int, Array]:
        raise NotImplementedError

    @property
    def page_size(self) -> int:
        return self.pos.shape[-1]

    def live_pages(self) -> Array:
        """[B, Hkv] int32 pages in use (attended or dormant)."""
        return jnp.sum(self.held, axis=-1, dtype=jnp.int32)

    def page_bytes(self) -> int:
        """K/V bytes of one page of one KV head: codes plus all their scales and zeros (int4
        arrays hold two codes a byte, as packed bytes do)."""
        d, ng, stat = self._stats()
        return lowbit_page_bytes(d, self.page_size, self.bits, d // ng, stat.dtype.itemsize)


@struct.dataclass
class LowBitTier(_Pages):
    """Pages of G tokens stored as packed low-bit codes, KIVI style (written once per page):
    keys quantized per channel over the page's tokens, values per token over channel groups.

    Attributes:
        k: [B, Hkv, P, G, D·bits/8] uint8 packed key codes (see kvjax.quant.pack).
        v: [B, Hkv, P, G, D·bits/8] uint8 packed value codes.
        k_scale, k_zero: [B, Hkv, P, D] bfloat16 (`STAT_DTYPE`) per page and channel.
        v_scale, v_zero: [B, Hkv, P, G, D / value_group] bfloat16 per token and channel group.
        pos: [B, Hkv, P, G] int32 original positions; EMPTY where the page is not attended.
        score: [B, Hkv, P] float32 per-page policy score.
        held: [B, Hkv, P] bool, the page holds codes (memory in use). A held page whose `pos`
            are EMPTY is dormant: kept (e.g. QEvict's write-once ledger) but not attended.
        bits: code width (2, 4 or 8), static.
    """

    k: Array
    v: Array
    k_scale: Array
    k_zero: Array
    v_scale: Array
    v_zero: Array
    pos: Array
    score: Array
    held: Array
    bits: int = struct.field(pytree_node=False, default=2)

    def _stats(self) -> tuple[int, int, Array]:
        return self.k_scale.shape[-1], self.v_scale.shape[-1], self.k_scale

    def read(self, page: Array, dtype: Any) -> tuple[Array, Array]:
        """Pages `page` [B, Hkv, m] (clipped into [0, P)) dequantized: keys and values
        [B, Hkv, m, G, D] `dtype`."""
        at = _page_at(page, self.k.ndim)  # (the statistics have at most as many axes)
        k = dequantize_per_channel(
            unpack(at(self.k), self.bits), at(self.k_scale), at(self.k_zero), dtype
        )
        v = dequantize_per_token(
            unpack(at(self.v), self.bits), at(self.v_scale), at(self.v_zero), dtype
        )
        return k, v

    def dequantize(self, dtype: Any) -> tuple[Array, Array]:
        """Every page dequantized: keys and values [B, Hkv, P, G, D] `dtype`."""
        k = dequantize_per_channel(unpack(self.k, self.bits), self.k_scale, self.k_zero, dtype)
        v = dequantize_per_token(unpack(self.v, self.bits), self.v_scale, self.v_zero, dtype)
        return k, v

    def write(self, page: Array, xk: Array, xv: Array) -> LowBitTier:
        """Keys and values [B, Hkv, m, G, D] quantized into pages `page` [B, Hkv, m] (an index
        ≥ P is dropped: nothing written); positions, scores and `held` are the caller's."""
        (kc, ks, kz), (vc, vs, vz) = quantize_keys_values(
            xk, xv, self.bits, xv.shape[-1] // self.v_scale.shape[-1]
        )
        put = _page_put(page)
        return self.replace(
            k=put(self.k, pack(kc, self.bits)),
            v=put(self.v, pack(vc, self.bits)),
            k_scale=put(self.k_scale, ks),
            k_zero=put(self.k_zero, kz),
            v_scale=put(self.v_scale, vs),
            v_zero=put(self.v_zero, vz),
        )


def _page_at(page: Array, rank: int):
    """`a` → a[b, h, page[b, h, j]] for every page array a [B, Hkv, P, ...] of up to `rank`
    axes (page clipped into [0, P): in-range indices need no bounds mask, a smaller kernel
    for each gather and for the dequantization fused after it). Each is gathered viewed with
    `rank` axes (size-1 axes after P, a free reshape), so that the gathers of all the tier's
    arrays share one index computation, one kernel to compile instead of one per rank."""

    def at(a):
        x = a.reshape(*a.shape[:3], *(1,) * (rank - a.ndim), *a.shape[3:])
        idx = page.reshape(page.shape + (1,) * (rank - 3))
        return jnp.take_along_axis(x, idx, axis=2, mode="clip").reshape(*page.shape, *a.shape[3:])

    return at


def _page_put(page: Array):
    """(a, x) → a with a[b, h, page[b, h, j]] = x[b, h, j] (indices ≥ P dropped)."""
    b, h = page.shape[:2]
    bi = jnp.arange(b)[:, None, None]
    hi = jnp.arange(h)[None, :, None]
    return lambda a, x: a.at[bi, hi, page].set(x.astype(a.dtype), mode="drop")


@struct.dataclass
class KernelLowBitTier(_Pages):
    """The low-bit pages in the Mosaic GPU decode kernel's layout (`CacheSpec.lowbit_layout`
    "kernel"; `kvjax.quant.quantize_kernel_pages`): the kernel reads them as stored, with no
    conversion per step. Same tokens, statistics and bytes as `LowBitTier`; each group is
    quantized around the code offset the kernel's signed int4 read implies, so the bound is
    the same |x − dequantized| ≤ scale / 2. With uint32 codes it holds the "words" layout
    (`kvjax.quant.quantize_words_pages`: the codes in the order of the kernel's dot registers,
    quantized by `LowBitTier`'s own rule; the same bound and bytes).

    Attributes:
        k: [B, Hkv, P, G, D·bits/4] int4 key codes (G = 64 tokens a page); words: [B, Hkv, P,
            D·bits/64, 128] uint32.
        v: [B, Hkv, P, D·bits/4, G] int4 value codes, channel-major; words: as k.
        k_stats: [B, Hkv, P, 2, D] bfloat16 (scale·2^-(slice·bits), zero) per channel; words:
            (scale, zero·2^pos).
        v_stats: [B, Hkv, P, 2, NG, G] bfloat16 the same per value group and token; words:
            (scale·2^-pos, zero).
        pos, score, held, bits: as `LowBitTier`.
    """

    k: Array
    v: Array
    k_stats: Array
    v_stats: Array
    pos: Array
    score: Array
    held: Array
    bits: int = struct.field(pytree_node=False, default=2)

    def _stats(self) -> tuple[int, int, Array]:
        return self.k_stats.shape[-1], self.v_stats.shape[-2], self.k_stats

    def read(self, page: Array, dtype: Any) -> tuple[Array, Array]:
        """Pages `page` [B, Hkv, m] (clipped into [0, P)) dequantized: keys and values
        [B, Hkv, m, G, D] `dtype`."""
        at = _page_at(page, max(self.k.ndim, self.v_stats.ndim))
        dequantize = self._codec()[1]
        return dequantize(
            at(self.k), at(self.v), at(self.k_stats), at(self.v_stats), self.bits, dtype
        )

    @property
    def words(self) -> bool:
        """Whether the codes are in the words layout (uint32) rather than int4 codes."""
        return self.k.dtype == jnp.uint32

    def _codec(self) -> tuple[Any, Any]:
        """(quantize, dequantize) of this tier's layout."""
        if self.words:
            return quantize_words_pages, dequantize_words_pages
        return quantize_kernel_pages, dequantize_kernel_pages

    def dequantize(self, dtype: Any) -> tuple[Array, Array]:
        """Every page dequantized: keys and values [B, Hkv, P, G, D] `dtype`."""
        return self._codec()[1](self.k, self.v, self.k_stats, self.v_stats, self.bits, dtype)

    def write(self, page: Array, xk: Array, xv: Array) -> KernelLowBitTier:
        """As `LowBitTier.write`, in this layout."""
        k, v, ks, vs = self._codec()[0](xk, xv, self.bits, self.v_stats.shape[-2])
        put = _page_put(page)
        return self.replace(
            k=put(self.k, k), v=put(self.v, v), k_stats=put(self.k_stats, ks),
            v_stats=put(self.v_stats, vs),
        )  # fmt: skip


@struct.dataclass
class LayerCache:
    """One layer's slots: a full-precision tier and an optional INT8 tier.

    Attributes:
        k: [B, Hkv, C, D] keys after RoPE.
        v: [B, Hkv, C, D] values.
        pos: [B, Hkv, C] int32 original position of the token in each slot; EMPTY (-1) if free.
        score: [B, Hkv, C] float32, the policy's per-slot score (its meaning is the policy's).
        int8: the INT8 tier, or None.
        lowbit: the paged low-bit tier (`LowBitTier`, or `KernelLowBitTier` in the Mosaic
            GPU kernel's layout), or None.
        aux: per-layer state owned by the policy (a pytree, e.g. QEvict's ledger links), or None.
        head: None for per-head slots; for a pooled layer (`CacheSpec.pooled`) [B, 1, P] int32,
            the KV head owning each slot of the pool: k, v are then [B, 1, P, D] and pos, score
            [B, 1, P], one pool of P slots shared by the layer's `pool_heads` KV heads.
        pool_heads: Hkv of a pooled layer (static; 0 for per-head slots).
    """

    k: Array
    v: Array
    pos: Array
    score: Array
    int8: Int8Tier | None = None
    lowbit: LowBitTier | KernelLowBitTier | None = None
    aux: Any = None
    head: Array | None = None
    pool_heads: int = struct.field(pytree_node=False, default=0)

    @property
    def capacity(self) -> int:
        return self.pos.shape[-1]

    @property
    def num_kv_heads(self) -> int:
        """Hkv, also for a pooled layer (whose slot arrays have a head axis of 1) and a stacked
        one (leading [L] axis)."""
        return self.pool_heads if self.head is not None else self.k.shape[-3]

    def occupied(self) -> Array:
        """[B, Hkv, C] bool: slot holds a token."""
        return self.pos >= 0

    def live_slots(self) -> Array:
        """[B, Hkv] int32: number of occupied slots ([B, 1], all heads, for a pooled layer)."""
        return jnp.sum(self.occupied(), axis=-1, dtype=jnp.int32)

    def live_extent(self) -> Array:
        """[B, Hkv] int32: one past the last occupied slot (kernels stop reading there)."""
        idx = jnp.arange(1, self.capacity + 1, dtype=jnp.int32)
        return jnp.max(jnp.where(self.occupied(), idx, 0), axis=-1)


@struct.dataclass
class Cache:
    """The whole model's cache.

    Attributes:
        layers: one LayerCache per layer, or one LayerCache whose arrays have a leading [L]
            axis (a stacked cache, `kvjax.cache.stack_cache`: the step runs a layer scan).
        length: [B] int32 tokens consumed so far per sequence (the next position).
        policy_state: a pytree owned by the policy (e.g. a confidence-chosen budget).
    """

    layers: tuple[LayerCache, ...] | LayerCache
    length: Array
    policy_state: Any = None


def init_cache(
    spec: CacheSpec, policy_state: Any = None, layer_aux: tuple[Any, ...] | None = None
) -> Cache:
    """An empty cache: all slots EMPTY, all data zero.

    Args:
        spec: the static shape.
        policy_state: the policy-wide state (Cache.policy_state).
        layer_aux: one policy-owned pytree per layer (LayerCache.aux), or None.
    """
    b, h, d = spec.batch, spec.num_kv_heads, spec.head_dim
    q_caps = spec.int8_capacities or (None,) * spec.num_layers
    pages = spec.lowbit_pages or (None,) * spec.num_layers
    if layer_aux is None:
        layer_aux = (None,) * spec.num_layers
    if len(layer_aux) != spec.num_layers:
        raise ValueError(
            f"layer_aux needs one entry per layer ({spec.num_layers}), got {len(layer_aux)}"
        )
    if spec.pooled:
        layers = tuple(
            _pool_layer(b, h, h * c, d, spec.dtype, aux)
            for c, aux in zip(spec.capacities, layer_aux, strict=True)
        )
        return Cache(layers=layers, length=jnp.zeros((b,), jnp.int32), policy_state=policy_state)
    layers = tuple(
        LayerCache(
            k=jnp.zeros((b, h, c, d), spec.dtype),
            v=jnp.zeros((b, h, c, d), spec.dtype),
            pos=jnp.full((b, h, c), EMPTY, jnp.int32),
            score=jnp.zeros((b, h, c), jnp.float32),
            int8=None if cq is None else _empty_int8(b, h, cq, d),
            lowbit=None if p is None else _empty_lowbit(spec, p),
            aux=aux,
        )
        for c, cq, p, aux in zip(spec.capacities, q_caps, pages, layer_aux, strict=True)
    )
    return Cache(layers=layers, length=jnp.zeros((b,), jnp.int32), policy_state=policy_state)


def _pool_layer(b: int, heads: int, slots: int, d: int, dtype: Any, aux: Any) -> LayerCache:
    """An empty pooled layer: `slots` slots shared by `heads` KV heads."""
    return LayerCache(
        k=jnp.zeros((b, 1, slots, d), dtype),
        v=jnp.zeros((b, 1, slots, d), dtype),
        pos=jnp.full((b, 1, slots), EMPTY, jnp.int32),
        score=jnp.zeros((b, 1, slots), jnp.float32),
        aux=aux,
        head=jnp.zeros((b, 1, slots), jnp.int32),
        pool_heads=heads,
    )


def _empty_int8(b: int, h: int, c: int, d: int) -> Int8Tier:
    return Int8Tier(
        k=jnp.zeros((b, h, c, d), jnp.int8),
        v=jnp.zeros((b, h, c, d), jnp.int8),
        k_scale=jnp.zeros((b, h, c), jnp.float32),
        v_scale=jnp.zeros((b, h, c), jnp.float32),
        pos=jnp.full((b, h, c), EMPTY, jnp.int32),
        score=jnp.zeros((b, h, c), jnp.float32),
    )


def _empty_lowbit(spec: CacheSpec, pages: int) -> LowBitTier | KernelLowBitTier:
    b, h, d, g = spec.batch, spec.num_kv_heads, spec.head_dim, spec.lowbit_page_size
    if spec.lowbit_layout in KERNEL_LAYOUTS:  # shapes checked by CacheSpec
        ng, dn = d // spec.lowbit_value_group, d * spec.lowbit_bits // 4
        if spec.lowbit_layout == "words":
            w = d * spec.lowbit_bits // 64
            k, v = (jnp.zeros((b, h, pages, w, 128), jnp.uint32) for _ in range(2))
        else:
            k, v = (
                jnp.zeros((b, h, pages, g, dn), jnp.int4),
                jnp.zeros((b, h, pages, dn, g), jnp.int4),
            )
        return KernelLowBitTier(
            k=k,
            v=v,
            k_stats=jnp.zeros((b, h, pages, 2, d), STAT_DTYPE),
            v_stats=jnp.zeros((b, h, pages, 2, ng, g), STAT_DTYPE),
            pos=jnp.full((b, h, pages, g), EMPTY, jnp.int32),
            score=jnp.zeros((b, h, pages), jnp.float32),
            held=jnp.zeros((b, h, pages), bool),
            bits=spec.lowbit_bits,
        )
    dp = d * spec.lowbit_bits // 8
    if d % spec.lowbit_value_group or (d * spec.lowbit_bits) % 8:
        raise ValueError(
            f"head_dim {d} must be a multiple of lowbit_value_group "
            f"({spec.lowbit_value_group}) and pack into bytes at "
            f"{spec.lowbit_bits} bits"
        )
    ng = d // spec.lowbit_value_group
    f32, sd = jnp.float32, STAT_DTYPE
    return LowBitTier(
        k=jnp.zeros((b, h, pages, g, dp), jnp.uint8),
        v=jnp.zeros((b, h, pages, g, dp), jnp.uint8),
        k_scale=jnp.zeros((b, h, pages, d), sd),
        k_zero=jnp.zeros((b, h, pages, d), sd),
        v_scale=jnp.zeros((b, h, pages, g, ng), sd),
        v_zero=jnp.zeros((b, h, pages, g, ng), sd),
        pos=jnp.full((b, h, pages, g), EMPTY, jnp.int32),
        score=jnp.zeros((b, h, pages), f32),
        held=jnp.zeros((b, h, pages), bool),
        bits=spec.lowbit_bits,
    )
