"""The one entry point models call for attention; implementations are chosen by name."""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from kvjax.attention._types import AttnStats
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
        return attend_xla(*args, scale=scale)
    raise ValueError(
        f"unknown attention implementation {implementation!r}; choose one of {IMPLEMENTATIONS}"
    )
