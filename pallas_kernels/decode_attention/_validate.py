"""Shape and dtype checks of the kernels' inputs, so bad input fails with a message naming the
array instead of deep inside a Triton or Mosaic lowering. Shapes are static, so the checks run
at trace time and cost nothing in a compiled step."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.pallas_kernels.decode_attention._tiers import (
    ChannelMajorLowBitTier,
    FullTier,
    Int8Tier,
    LowBitTier,
    PooledTier,
)

Array = jax.Array
_FLOATS = (jnp.bfloat16, jnp.float16, jnp.float32)


def _fail(where: str, what: str) -> None:
    raise ValueError(f"decode attention: {where} {what}")


def _expect(where: str, x, shape: tuple[int, ...], dtypes) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        _fail(where, f"must be an array, got {type(x).__name__}")
    if tuple(x.shape) != tuple(shape):
        _fail(where, f"has shape {tuple(x.shape)}; expected {tuple(shape)}")
    if not any(x.dtype == jnp.dtype(d) for d in dtypes):
        names = " or ".join(jnp.dtype(d).name for d in dtypes)
        _fail(where, f"has dtype {x.dtype}; expected {names}")


def check_query(q, q_pos) -> tuple[int, int, int, int]:
    """q [B, Hkv, G, D] float, q_pos [B] int32; returns (B, Hkv, G, D)."""
    if not hasattr(q, "shape") or len(q.shape) != 4:
        _fail("q", f"must be [B, Hkv, G, D] (4 axes), got shape {getattr(q, 'shape', None)}")
    b, hkv, g, d = q.shape
    _expect("q", q, q.shape, _FLOATS)
    if min(b, hkv, g, d) < 1:
        _fail("q", f"has an empty axis: shape {tuple(q.shape)}")
    _expect("q_pos", q_pos, (b,), (jnp.int32,))
    return b, hkv, g, d


def check_dense(tier, q) -> None:
    """A FullTier or Int8Tier against q [B, Hkv, G, D]."""
    b, hkv, _, d = q.shape
    if not isinstance(tier, FullTier | Int8Tier):
        _fail("tier", f"must be a FullTier or Int8Tier, got {type(tier).__name__}")
    name = type(tier).__name__
    if getattr(tier.pos, "ndim", None) != 3:
        _fail(f"{name}.pos", f"must be [B, Hkv, C], got {getattr(tier.pos, 'shape', None)}")
    cap = tier.pos.shape[-1]
    _expect(f"{name}.pos", tier.pos, (b, hkv, cap), (jnp.int32,))
    if isinstance(tier, Int8Tier):
        for f in ("k", "v"):
            _expect(f"{name}.{f}", getattr(tier, f), (b, hkv, cap, d), (jnp.int8,))
        for f in ("k_scale", "v_scale"):
            _expect(f"{name}.{f}", getattr(tier, f), (b, hkv, cap), (jnp.float32,))
    else:
        for f in ("k", "v"):
            _expect(f"{name}.{f}", getattr(tier, f), (b, hkv, cap, d), _FLOATS)
        if tier.k.dtype != tier.v.dtype:
            _fail(name, f"k ({tier.k.dtype}) and v ({tier.v.dtype}) differ in dtype")
    _expect(f"{name}.extent", tier.extent, (b, hkv), (jnp.int32,))


def check_pooled(tier, q) -> None:
    """A PooledTier against q [B, Hkv, G, D] (its arrays have a head axis of 1)."""
    b, _, _, d = q.shape
    if not isinstance(tier, PooledTier):
        _fail("tier", f"must be a PooledTier, got {type(tier).__name__}")
    if getattr(tier.pos, "ndim", None) != 3:
        _fail("PooledTier.pos", f"must be [B, 1, P], got {getattr(tier.pos, 'shape', None)}")
    cap = tier.pos.shape[-1]
    for f in ("pos", "head"):
        _expect(f"PooledTier.{f}", getattr(tier, f), (b, 1, cap), (jnp.int32,))
    for f in ("k", "v"):
        _expect(f"PooledTier.{f}", getattr(tier, f), (b, 1, cap, d), _FLOATS)
    if tier.k.dtype != tier.v.dtype:
        _fail("PooledTier", f"k ({tier.k.dtype}) and v ({tier.v.dtype}) differ in dtype")
    _expect("PooledTier.extent", tier.extent, (b, 1), (jnp.int32,))


def check_lowbit(tier, q, bits: int) -> None:
    """A LowBitTier of `bits`-bit codes against q [B, Hkv, G, D]."""
    b, hkv, _, d = q.shape
    if bits not in (2, 4, 8):
        _fail("bits", f"must be 2, 4 or 8, got {bits}")
    if not isinstance(tier, LowBitTier):
        _fail("tier", f"must be a LowBitTier, got {type(tier).__name__}")
    if not hasattr(tier.k, "shape") or tier.k.ndim != 5:
        _fail("LowBitTier.k", f"must be [B, Hkv, P, Tp, Dp], got {getattr(tier.k, 'shape', None)}")
    pages, tp, dp = tier.k.shape[2:]
    if dp * 8 != d * bits:
        _fail("LowBitTier.k", f"packed width {dp} does not hold D={d} channels at {bits} bits")
    for f in ("k", "v"):
        _expect(f"LowBitTier.{f}", getattr(tier, f), (b, hkv, pages, tp, dp), (jnp.uint8,))
    for f in ("k_scale", "k_zero"):
        _expect(f"LowBitTier.{f}", getattr(tier, f), (b, hkv, pages, d), _FLOATS)
    ng = tier.v_scale.shape[-1] if getattr(tier.v_scale, "ndim", 0) == 5 else 0
    if ng < 1 or d % ng:
        _fail("LowBitTier.v_scale", f"needs a last axis of value groups dividing D={d}")
    for f in ("v_scale", "v_zero"):
        _expect(f"LowBitTier.{f}", getattr(tier, f), (b, hkv, pages, tp, ng), _FLOATS)
    _expect("LowBitTier.pos", tier.pos, (b, hkv, pages, tp), (jnp.int32,))
    _expect("LowBitTier.extent", tier.extent, (b, hkv), (jnp.int32,))


def check_channel_major(tier, q, bits: int) -> None:
    """A ChannelMajorLowBitTier of `bits`-bit codes against q [B, Hkv, G, D]."""
    b, hkv, _, d = q.shape
    name = "ChannelMajorLowBitTier"
    if bits not in (2, 4):
        _fail("bits", f"must be 2 or 4 for a {name}, got {bits}")
    if not isinstance(tier, ChannelMajorLowBitTier):
        _fail("tier", f"must be a {name} (to_channel_major), got {type(tier).__name__}")
    if not hasattr(tier.k, "shape") or tier.k.ndim != 5:
        _fail(
            f"{name}.k", f"must be [B, Hkv, P, Tp, D·bits/8], got {getattr(tier.k, 'shape', None)}"
        )
    pages, tp, dp = tier.k.shape[2:]
    if tier.k.dtype == jnp.uint32:  # to_channel_major(words=True): [W, 128] words a page
        if (d * bits) % 256:
            _fail(f"{name}.k", f"the words layout needs D·bits a multiple of 256, got D={d}")
        _expect(f"{name}.k", tier.k, (b, hkv, pages, d * bits // 64, 128), (jnp.uint32,))
        _expect(f"{name}.v", tier.v, (b, hkv, pages, d * bits // 64, 128), (jnp.uint32,))
        tp = getattr(tier.pos, "shape", (0,) * 4)[-1]
    elif tier.k.dtype == jnp.int4:  # to_channel_major(native=True): 4/bits codes a nibble
        _expect(f"{name}.k", tier.k, (b, hkv, pages, tp, d * bits // 4), (jnp.int4,))
        _expect(f"{name}.v", tier.v, (b, hkv, pages, d * bits // 4, tp), (jnp.int4,))
    elif dp * 8 != d * bits:
        _fail(f"{name}.k", f"packed width {dp} does not hold D={d} channels at {bits} bits")
    elif tp * bits % 8:
        _fail(f"{name}.k", f"a page of {tp} tokens does not pack whole bytes at {bits} bits")
    else:
        _expect(f"{name}.k", tier.k, (b, hkv, pages, tp, dp), (jnp.uint8,))
        _expect(f"{name}.v", tier.v, (b, hkv, pages, d, tp * bits // 8), (jnp.uint8,))
    _expect(f"{name}.k_stats", tier.k_stats, (b, hkv, pages, 2, d), (jnp.bfloat16,))
    ng = tier.v_stats.shape[4] if getattr(tier.v_stats, "ndim", 0) == 6 else 0
    if ng < 1 or d % ng:
        _fail(f"{name}.v_stats", f"needs [B, Hkv, P, 2, NG, Tp] with NG dividing D={d}")
    _expect(f"{name}.v_stats", tier.v_stats, (b, hkv, pages, 2, ng, tp), (jnp.bfloat16,))
    _expect(f"{name}.pos", tier.pos, (b, hkv, pages, tp), (jnp.int32,))
    _expect(f"{name}.extent", tier.extent, (b, hkv), (jnp.int32,))


def layer_view(tier, layer):
    """One layer of a stacked tier (`layer=`), for the per-layer checks: `layer` must be an
    integer scalar and every slot array (all but extent, the layer's own) carry one leading [L]
    axis of the same size; returns the tier with those arrays as one layer's ShapeDtypeStructs."""
    if jnp.shape(layer) != () or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
        raise ValueError(f"decode attention: layer must be an integer scalar, got {layer!r}")
    slots = {f: a for f, a in tier._asdict().items() if f != "extent"}
    lead = {f: (tuple(getattr(a, "shape", ())) or (None,))[0] for f, a in slots.items()}
    if len(set(lead.values())) != 1 or any(getattr(a, "ndim", 0) < 2 for a in slots.values()):
        sizes = ", ".join(f"{f} {n}" for f, n in lead.items())
        raise ValueError(
            f"decode attention: with layer=, every slot array of the {type(tier).__name__} needs "
            f"one leading [L] axis of the same size, got leading sizes {sizes}"
        )
    one = {f: jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for f, a in slots.items()}
    return tier._replace(**one)
