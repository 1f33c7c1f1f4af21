"""The one entry point models call for attention; implementations are chosen by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp

from kvjax.attention._types import AttnStats, KeyShift, turn_keys
from kvjax.attention._xla import attend_xla
from kvjax.cache import LayerCache, StackedLayer
from kvjax.sharding import active_layout

Array = jax.Array
Implementation = Literal["xla", "pallas", "auto"]
IMPLEMENTATIONS: tuple[str, ...] = ("xla", "pallas", "auto")


def resolve_implementation(implementation: str, platform: str | None = None) -> str:
    """ "auto" → "pallas" on GPU/TPU and "xla" elsewhere; other names unchanged."""
    if implementation != "auto":
        return implementation
    platform = platform or jax.default_backend()
    return "pallas" if platform in ("gpu", "cuda", "tpu") else "xla"


def attend(
    q: Array,
    layer: LayerCache | StackedLayer,
    k_new: Array,
    v_new: Array,
    q_pos: Array,
    new_valid: Array,
    *,
    query_weight: Array | None = None,
    scale: float | None = None,
    implementation: Implementation = "auto",
    need_mass: bool = True,
    key_shift: KeyShift | None = None,
    rotate: Callable[[Array, Array], Array] | None = None,
) -> tuple[Array, AttnStats]:
    """Attention of this call's queries over the layer's cache and this call's own tokens.

    Args:
        q: [B, T, Hq, D] queries after RoPE.
        layer: the layer's slot cache (tokens strictly before this call's), or a
            `StackedLayer` (a layer scan's): the Pallas decode path then reads its full and
            INT8 tiers in the stack, in place; every other path reads the layer sliced out.
        k_new: [B, T, Hkv, D] this call's keys after RoPE.
        v_new: [B, T, Hkv, D] this call's values.
        q_pos: [B, T] int32 positions of this call's tokens.
        new_valid: [B, T] bool, real token (False = padding).
        query_weight: [B, T] weight of each query in the returned attention mass; defaults to
            `new_valid` (every real query counts once).
        scale: logit scale; default 1/sqrt(D).
        implementation: "xla" (plain jnp reference, always available), "pallas" (the
            Pallas decode kernels for T == 1 — Triton on GPU, Mosaic on TPU, the interpreter
            on CPU — and the XLA path for T > 1; a pooled layer's kernel is Triton's only, so
            a pool on a TPU or on a mesh takes the XLA path), or "auto" (pallas on GPU/TPU,
            else xla).
        need_mass: whether the caller reads the attention mass; False lets the Pallas kernels
            skip the per-slot logits (the mass fields then hold zeros). XLA drops unused mass.
        key_shift: None, or the positions by which each cached key is turned (with `rotate`,
            the model's RoPE) before it is scored: keys attended at positions other than the
            ones they were cached at (positions within the cache). The Pallas path reads a
            turned copy of the layer's full-precision keys (one layer at a time); a layer with
            an INT8 or low-bit tier takes the XLA path, which turns those keys after
            dequantizing them (the kernels fuse dequantization into their loads and cannot
            turn them).
        rotate: `rotate(x [B, T, H, D], by [B, T] int32)`, the model's RoPE; needed with
            `key_shift`.

    Returns:
        (out [B, T, Hq, D], AttnStats).
    """
    stacked = layer if isinstance(layer, StackedLayer) else None
    layer = stacked.get() if stacked is not None else layer
    b, t, hq, d = q.shape
    hkv = layer.num_kv_heads
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of cache KV heads ({hkv})")
    if k_new.shape != (b, t, hkv, d) or v_new.shape != (b, t, hkv, d):
        raise ValueError(f"k_new/v_new must be {(b, t, hkv, d)}, got {k_new.shape}, {v_new.shape}")
    if layer.k.shape[0] != b or layer.k.shape[-1] != d:
        raise ValueError(f"cache layer shape {layer.k.shape} does not match queries {q.shape}")
    if query_weight is None:
        query_weight = new_valid.astype(jnp.float32)
    if scale is None:
        scale = d**-0.5
    implementation = resolve_implementation(implementation)
    xla_args: dict = {}
    if key_shift is not None:
        if rotate is None or layer.head is not None:
            raise ValueError(
                "attend: key_shift needs `rotate` (the model's RoPE) and a per-head cache "
                "layer (a pooled layer's slots are shared by heads)"
            )
        xla_args = dict(key_shift=key_shift, rotate=rotate)
        if layer.int8 is None and layer.lowbit is None:
            # The kernels read a turned copy of this layer's keys (not the stack in place).
            layer, stacked = layer.replace(k=turn_keys(layer.k, key_shift.full, rotate)), None
            xla_args = {}
        elif implementation == "pallas":
            implementation = "xla"  # quantized keys are turned after dequantization, in XLA
    args = (q, layer, k_new, v_new, q_pos, new_valid, query_weight)
    if implementation == "pallas" and t == 1:
        from kvjax.attention._pallas import attend_pallas, attend_pallas_sharded
        from kvjax.pallas_kernels.decode_attention import default_backend

        layout = active_layout()  # a mesh: the kernels run per device under shard_map
        if layer.head is None and layout is not None:
            return attend_pallas_sharded(layout, *args, scale=scale, need_mass=need_mass)
        # A pooled layer (adakv) has a Triton kernel (GPU; the interpreter on CPU), not a TPU
        # one, and is not sharded: those take the XLA path.
        if layer.head is None or (layout is None and default_backend() != "tpu"):
            return attend_pallas(*args, scale=scale, need_mass=need_mass, stacked=stacked)
    if implementation in ("xla", "pallas"):
        return attend_xla(*args, scale=scale, **xla_args)
    raise ValueError(
        f"unknown attention implementation {implementation!r}; choose one of {IMPLEMENTATIONS}"
    )
