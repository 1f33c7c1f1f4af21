"""Array plumbing for ranked policies: the ranked region's storage (full-precision slots after
the recent ring, or the INT8 tier), gathered and scattered per (batch, KV head)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.cache import Int8Tier, LayerCache
from kvjax.pallas_kernels.slot_write import SlotWrite, write_slots
from kvjax.quant import quantize_int8

Array = jax.Array


@struct.dataclass
class Tokens:
    """A set of tokens per (batch, KV head), in one of two storage forms.

    Attributes:
        k, v: [B, H, N, D] full-precision data, or int8 codes when `k_scale` is set.
        k_scale, v_scale: [B, H, N] float32 INT8 scales, or None for full precision.
        pos: [B, H, N] int32 positions (EMPTY = not a token).
        score: [B, H, N] float32 policy scores.
    """

    k: Array
    v: Array
    pos: Array
    score: Array
    k_scale: Array | None = None
    v_scale: Array | None = None

    def quantized(self) -> Tokens:
        """INT8 form (codes computed here, once; already-INT8 tokens are returned as they are)."""
        if self.k_scale is not None:
            return self
        kc, ks = quantize_int8(self.k)
        vc, vs = quantize_int8(self.v)
        return Tokens(k=kc, v=vc, pos=self.pos, score=self.score, k_scale=ks, v_scale=vs)

    def concat(self, other: Tokens) -> Tokens:
        return jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=2), self, other)

    def take(self, idx: Array) -> Tokens:
        """Gather along the token axis with idx [B, H, M]."""
        return jax.tree.map(
            lambda a: jnp.take_along_axis(a, idx.reshape(idx.shape + (1,) * (a.ndim - 3)), axis=2),
            self,
        )


def fp_slice(layer: LayerCache, start: int, stop: int | None = None) -> Tokens:
    """Full-precision slots [start, stop) as Tokens."""
    sl = slice(start, stop)
    return Tokens(
        k=layer.k[:, :, sl],
        v=layer.v[:, :, sl],
        pos=layer.pos[:, :, sl],
        score=layer.score[:, :, sl],
    )


def int8_tokens(tier: Int8Tier) -> Tokens:
    return Tokens(
        k=tier.k,
        v=tier.v,
        pos=tier.pos,
        score=tier.score,
        k_scale=tier.k_scale,
        v_scale=tier.v_scale,
    )


_FP_FIELDS = ("k", "v", "pos", "score")
_INT8_FIELDS = _FP_FIELDS + ("k_scale", "v_scale")


def _scatter(store, slots: Array, toks: Tokens, fields: tuple[str, ...]):
    """Write toks (N per head) into slots [B, H, N] of `store` (out of range = drop)."""
    b, h, _ = slots.shape
    bi = jnp.arange(b)[:, None, None]
    hi = jnp.arange(h)[None, :, None]
    put = lambda a, x: a.at[bi, hi, slots].set(x.astype(a.dtype), mode="drop")
    return store.replace(**{f: put(getattr(store, f), getattr(toks, f)) for f in fields})


def scatter_fp(layer: LayerCache, slots: Array, toks: Tokens) -> LayerCache:
    """Write full-precision toks into full-precision slots [B, H, N]."""
    return _scatter(layer, slots, toks, _FP_FIELDS)


def scatter_int8(tier: Int8Tier, slots: Array, toks: Tokens) -> Int8Tier:
    """Write INT8 toks into INT8 slots [B, H, N]."""
    return _scatter(tier, slots, toks, _INT8_FIELDS)


def scatter_fused(
    layer: LayerCache, fp: tuple[Array, Tokens], int8: tuple[Array, Tokens] | None = None
) -> LayerCache:
    """`scatter_fp(layer, *fp)` and `scatter_int8(layer.int8, *int8)` as one kernel launch
    (`kvjax.pallas_kernels.slot_write`; the interpreter on CPU) instead of one XLA scatter per
    array. Slots are [B, H, N]; out of range = drop."""
    backend = jax.default_backend()
    if backend == "tpu":
        raise ValueError("write_kernel='pallas' has no TPU kernel yet; use write_kernel='xla'")
    fields = lambda store, toks, names: (
        tuple(getattr(store, f) for f in names),
        tuple(getattr(toks, f) for f in names),
    )
    writes = [SlotWrite(fp[0], *fields(layer, fp[1], _FP_FIELDS))]
    if int8 is not None:
        writes.append(SlotWrite(int8[0], *fields(layer.int8, int8[1], _INT8_FIELDS)))
    outs = write_slots(*writes, interpret=backend == "cpu")
    layer = layer.replace(**dict(zip(_FP_FIELDS, outs[0], strict=True)))
    if int8 is not None:
        tier = layer.int8.replace(**dict(zip(_INT8_FIELDS, outs[1], strict=True)))
        layer = layer.replace(int8=tier)
    return layer


def replace_fp_range(layer: LayerCache, start: int, toks: Tokens) -> LayerCache:
    """Overwrite full-precision slots [start, start + N) with toks."""
    upd = lambda a, x: jax.lax.dynamic_update_slice_in_dim(a, x.astype(a.dtype), start, axis=2)
    return layer.replace(
        k=upd(layer.k, toks.k),
        v=upd(layer.v, toks.v),
        pos=upd(layer.pos, toks.pos),
        score=upd(layer.score, toks.score),
    )


def int8_from_tokens(toks: Tokens) -> Int8Tier:
    return Int8Tier(
        k=toks.k,
        v=toks.v,
        k_scale=toks.k_scale,
        v_scale=toks.v_scale,
        pos=toks.pos,
        score=toks.score,
    )
