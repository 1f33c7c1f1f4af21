"""Logical axis names of every array of the params and cache pytrees.

Arrays are named by what their dimensions mean (`batch`, `kv_heads`, `slots`, ...), never by mesh
axes; `ShardingRules` maps the names onto a mesh. Params are named by their field names (the
model dataclasses share one vocabulary, `kvjax.models._params`); cache arrays by their tier's
fields. Policy-owned arrays (`LayerCache.aux`, `Cache.policy_state`) follow one convention that
every policy keeps: they lead with [B] or [B, Hkv] (QEvict's ledger [B, Hkv, W], KVpop's mLSTM
memories [B, Hkv, ...], CONF-KV's tight flag [B]) and are named by that prefix.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax

from kvjax.cache import Cache, Int8Tier, KernelLowBitTier, LayerCache, LowBitTier


class Axis(enum.StrEnum):
    """What one dimension of an array means."""

    BATCH = "batch"  # B, sequences
    KV_HEADS = "kv_heads"  # Hkv (flattened with D in projection weights)
    HEADS = "heads"  # Hq (flattened with D in projection weights)
    HEAD_DIM = "head_dim"  # D (and its packed bytes D·bits/8, its value groups)
    SLOTS = "slots"  # C / Cq / P: the slot (or page) axis of a cache tier
    PAGE = "page"  # G, tokens of one low-bit page
    EMBED = "embed"  # E, the residual width
    MLP = "mlp"  # F, the MLP hidden width
    VOCAB = "vocab"  # V
    POSITIONS = "positions"  # GPT-2's learned position table
    FUSED_QKV = "fused_qkv"  # GPT-2's [q | k | v] columns (not head-aligned: never split)


@dataclasses.dataclass(frozen=True)
class Names:
    """The logical names of one array's dimensions (a pytree leaf, so a tree of Names mirrors the
    tree of arrays it names). `None` is a dimension no rule ever shards."""

    axes: tuple[Axis | None, ...]


B, H, HQ, D, C = Axis.BATCH, Axis.KV_HEADS, Axis.HEADS, Axis.HEAD_DIM, Axis.SLOTS
E, F, V = Axis.EMBED, Axis.MLP, Axis.VOCAB

# Parameter field → names. One table for both families (field names are unique per meaning).
PARAM_AXES: dict[str, tuple[Axis | None, ...]] = {
    "embed": (V, E),
    "lm_head": (E, V),
    "final_norm": (E,),
    "attn_norm": (E,),
    "mlp_norm": (E,),
    "wq": (E, HQ),
    "wk": (E, H),
    "wv": (E, H),
    "wo": (HQ, E),
    "bq": (HQ,),
    "bk": (H,),
    "bv": (H,),
    "w_gate": (E, F),
    "w_up": (E, F),
    "w_down": (F, E),
    "wqkv": (E, H),  # grouped per KV head (`fuse_projections`): an even split keeps heads whole
    "w_gate_up": (E, F),  # gate and up columns side by side: an even split keeps the pairs
    "wte": (V, E),
    "wpe": (Axis.POSITIONS, E),
    "ln1_g": (E,),
    "ln1_b": (E,),
    "ln2_g": (E,),
    "ln2_b": (E,),
    "ln_f_g": (E,),
    "ln_f_b": (E,),
    "w_qkv": (E, Axis.FUSED_QKV),
    "b_qkv": (Axis.FUSED_QKV,),
    "bo": (E,),
    "w_fc": (E, F),
    "b_fc": (F,),
    "w_proj": (F, E),
    "b_proj": (E,),
}

_TIER_AXES: dict[str, tuple[Axis | None, ...]] = {
    # LayerCache and Int8Tier: [B, Hkv, C(, D)]
    "k": (B, H, C, D),
    "v": (B, H, C, D),
    "pos": (B, H, C),
    "score": (B, H, C),
    "k_scale": (B, H, C),
    "v_scale": (B, H, C),
}
_LOWBIT_AXES: dict[str, tuple[Axis | None, ...]] = {
    # LowBitTier: pages are its slot axis.
    "k": (B, H, C, Axis.PAGE, D),
    "v": (B, H, C, Axis.PAGE, D),
    "k_scale": (B, H, C, D),
    "k_zero": (B, H, C, D),
    "v_scale": (B, H, C, Axis.PAGE, D),
    "v_zero": (B, H, C, Axis.PAGE, D),
    "pos": (B, H, C, Axis.PAGE),
    "score": (B, H, C),
    "held": (B, H, C),
}
_KERNEL_LOWBIT_AXES: dict[str, tuple[Axis | None, ...]] = {
    # KernelLowBitTier: values channel-major, statistics stacked on an axis of 2.
    "k": (B, H, C, Axis.PAGE, D),
    "v": (B, H, C, D, Axis.PAGE),
    "k_stats": (B, H, C, None, D),
    "v_stats": (B, H, C, None, None, Axis.PAGE),
    "pos": (B, H, C, Axis.PAGE),
    "score": (B, H, C),
    "held": (B, H, C),
}
# KernelLowBitTier in the words layout: codes [.., P, W, 128] words in the dots' register order
# (neither axis is one of tokens or channels).
_WORDS_LOWBIT_AXES = {**_KERNEL_LOWBIT_AXES, "k": (B, H, C, None, None), "v": (B, H, C, None, None)}


def param_names(params: Any) -> Any:
    """A tree of `Names` mirroring `params` (LlamaParams or GPT2Params).

    Raises:
        ValueError: a parameter field this table does not know (a new model family must name
            its arrays here, or it would silently stay replicated).
    """

    def name(path, leaf) -> Names:
        field = next(
            (k.name for k in reversed(path) if isinstance(k, jax.tree_util.GetAttrKey)), None
        )
        if field not in PARAM_AXES:
            raise ValueError(f"no logical axis names for parameter {jax.tree_util.keystr(path)}")
        axes = PARAM_AXES[field]
        if len(axes) != leaf.ndim:
            raise ValueError(
                f"parameter {jax.tree_util.keystr(path)} has {leaf.ndim} dims, names {axes}"
            )
        return Names(axes)

    return jax.tree_util.tree_map_with_path(name, params)


def _policy_owned(tree: Any, batch: int, heads: int) -> Any:
    """Names for policy-owned arrays by their leading [B] / [B, Hkv] dims (module docstring)."""

    def name(leaf) -> Names:
        shape = leaf.shape
        if len(shape) >= 2 and shape[:2] == (batch, heads):
            return Names((B, H) + (None,) * (len(shape) - 2))
        if len(shape) >= 1 and shape[0] == batch:
            return Names((B,) + (None,) * (len(shape) - 1))
        return Names((None,) * len(shape))

    return jax.tree.map(name, tree)


def _fields(tier: Any, table: dict[str, tuple[Axis | None, ...]], **skip: Any) -> dict:
    return {f: Names(table[f]) for f in table if f not in skip and hasattr(tier, f)}


def layer_names(layer: LayerCache) -> LayerCache:
    """A LayerCache-shaped tree of `Names` (the same pytree structure as `layer`)."""
    b, h = layer.k.shape[:2]
    int8 = lowbit = None
    if layer.int8 is not None:
        int8 = Int8Tier(**_fields(layer.int8, _TIER_AXES))
    if layer.lowbit is not None:
        lb = layer.lowbit
        if isinstance(lb, KernelLowBitTier):
            table = _WORDS_LOWBIT_AXES if lb.words else _KERNEL_LOWBIT_AXES
            lowbit = KernelLowBitTier(**_fields(lb, table), bits=lb.bits)
        else:
            lowbit = LowBitTier(**_fields(lb, _LOWBIT_AXES), bits=lb.bits)
    if layer.head is not None:  # a pool shared by the KV heads: its head axis (1) unsplit
        slot, data = Names((B, None, C)), Names((B, None, C, D))
        return LayerCache(
            k=data, v=data, pos=slot, score=slot, head=slot,
            aux=_policy_owned(layer.aux, b, layer.pool_heads), pool_heads=layer.pool_heads,
        )  # fmt: skip
    return LayerCache(
        k=Names(_TIER_AXES["k"]),
        v=Names(_TIER_AXES["v"]),
        pos=Names(_TIER_AXES["pos"]),
        score=Names(_TIER_AXES["score"]),
        int8=int8,
        lowbit=lowbit,
        aux=_policy_owned(layer.aux, b, h),
    )


def cache_names(cache: Cache) -> Cache:
    """A Cache-shaped tree of `Names` for every tier, the counters and the policy's state."""
    b, h = cache.layers[0].k.shape[:2]
    return Cache(
        layers=tuple(layer_names(layer) for layer in cache.layers),
        length=Names((B,)),
        policy_state=_policy_owned(cache.policy_state, b, h),
    )
