"""Array plumbing for ranked policies: the ranked region's storage (full-precision slots after
the recent ring, or the INT8 tier), gathered and scattered per (batch, KV head)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.cache import Int8Tier, LayerCache
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


@struct.dataclass
class SlotWrites:
    """A layer's pending decode writes: `fp` = (slots [B, H, N], Tokens) into its full-precision
    slots, `int8` = the same into its INT8 tier (or None). Out-of-range slots are dropped."""

    fp: tuple[Array, Tokens]
    int8: tuple[Array, Tokens] | None = None

    def apply(self, layer: LayerCache) -> LayerCache:
        """The writes as XLA scatters, one per array."""
        if self.int8 is not None:
            layer = layer.replace(int8=scatter_int8(layer.int8, *self.int8))
        return scatter_fp(layer, *self.fp)


class _Write(NamedTuple):
    """`kvjax.pallas_kernels.slot_write.SlotWrite`'s fields (that module loads Triton)."""

    slots: Array
    arrays: tuple[Array, ...]
    rows: tuple[Array, ...]


def _scatter_writes(*writes: _Write) -> tuple[tuple[Array, ...], ...]:
    """The slot-write kernel's contract as XLA scatters: rows into slots, out of range dropped."""

    def put(a: Array, slots: Array, x: Array) -> Array:
        b, h, _ = slots.shape
        bi, hi = jnp.arange(b)[:, None, None], jnp.arange(h)[None, :, None]
        return a.at[bi, hi, slots].set(x.astype(a.dtype), mode="drop")

    return tuple(
        tuple(put(a, w.slots, r) for a, r in zip(w.arrays, w.rows, strict=True)) for w in writes
    )


def scatter_fused(
    plans: list[tuple[LayerCache, SlotWrites]], *, kernel: str = "pallas"
) -> list[LayerCache]:
    """Every layer's SlotWrites together, equal to `writes.apply(layer)` for each (layer,
    writes): "pallas", one kernel launch (`kvjax.pallas_kernels.slot_write`; the interpreter on
    CPU) instead of one XLA scatter per array and layer; "xla", XLA scatters. On a mesh both run
    per device under shard_map (`kvjax.sharding.map_slot_writes`): with the slot axis split
    (context-parallel) each device writes only the rows aimed at its own slots, so no slot
    shard crosses devices."""
    from kvjax.sharding import map_slot_writes

    backend = jax.default_backend()
    if kernel == "pallas":
        if backend == "tpu":
            raise ValueError("write_kernel='pallas' has no TPU kernel yet; use write_kernel='xla'")
        from kvjax.pallas_kernels.slot_write import write_slots  # Triton: load on use

        run, knobs = write_slots, dict(interpret=backend == "cpu")
    else:
        run, knobs = _scatter_writes, {}

    def group(store, slots_toks, names):
        slots, toks = slots_toks
        return _Write(
            slots, tuple(getattr(store, f) for f in names), tuple(getattr(toks, f) for f in names)
        )

    groups = []
    for layer, w in plans:
        groups.append(group(layer, w.fp, _FP_FIELDS))
        if w.int8 is not None:
            groups.append(group(layer.int8, w.int8, _INT8_FIELDS))
    outs = iter(map_slot_writes(run, tuple(groups), **knobs))
    done = []
    for layer, w in plans:
        layer = layer.replace(**dict(zip(_FP_FIELDS, next(outs), strict=True)))
        if w.int8 is not None:
            tier = layer.int8.replace(**dict(zip(_INT8_FIELDS, next(outs), strict=True)))
            layer = layer.replace(int8=tier)
        done.append(layer)
    return done


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
