"""Adapter from a layer's cache to the Pallas decode kernels (`implementation="pallas"`).

The kernels attend over the cache tiers only and return (out, lse, per-tier scaled logits); the
step's own token, which is not in the cache yet, is merged here with a log-sum-exp combine, and
the per-slot attention mass the policies consume is computed from the logits and the final lse
(a few % of the KV bytes, no second pass over K/V). Decode only: one query per sequence.

On a mesh (`attend_pallas_sharded`) the whole adapter runs under `shard_map`: each device
attends its own (sequence, KV head) blocks, and with the slot axis sharded (context-parallel
decode) the per-device partials merge by the same log-sum-exp combine before the new token joins.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax._numerics import einsum_f32
from kvjax.attention._types import AttnStats
from kvjax.cache import KernelLowBitTier, LayerCache, StackedLayer, tier_extents
from kvjax.pallas_kernels.decode_attention import (
    ChannelMajorLowBitTier,
    FullTier,
    Int8Tier,
    LowBitTier,
    Partials,
    PooledTier,
    attention_mass,
    combine,
    decode_partials,
    default_backend,
    join_applies,
    join_new_token,
    slots_on_m,
    tuning_for,
)
from kvjax.sharding import Axis, Layout, Names, layer_names

Array = jax.Array


def _visible(pos: Array, q_pos: Array) -> Array:
    """pos [B, Hkv, N], q_pos [B] → [B, Hkv, N] bool."""
    return (pos >= 0) & (pos <= q_pos[:, None, None])


def _index(stacked: StackedLayer | None) -> Array | None:
    """The layer a stacked tier is read at in place (None: the layer's own arrays)."""
    return stacked.index if stacked is not None else None


def attend_pallas(
    q: Array,
    layer: LayerCache,
    k_new: Array,
    v_new: Array,
    q_pos: Array,
    new_valid: Array,
    query_weight: Array,
    *,
    scale: float,
    need_mass: bool = True,
    seq_axis: str | None = None,
    stacked: StackedLayer | None = None,
) -> tuple[Array, AttnStats]:
    """`attend_xla`'s contract for T == 1, through the Pallas kernels.

    Args:
        q: [B, 1, Hq, D] queries after RoPE.
        layer: the layer's cache.
        k_new, v_new: [B, 1, Hkv, D] this step's key and value.
        q_pos: [B, 1] int32 query positions.
        new_valid: [B, 1] bool.
        query_weight: [B, 1] float32 weight of the query in the mass.
        scale: logit scale.
        need_mass: compute the per-slot mass (else the kernels write no logits; zeros).
        seq_axis: inside `shard_map` with the slot axis split over this mesh axis: merge the
            devices' partial attentions (all-gather of [B, Hkv, G, D] partials, not of K/V).
        stacked: None, or the StackedLayer that `layer` was sliced from (a layer scan): on
            the GPU (and in the interpreter) the full, INT8 and low-bit tiers' kernels then
            read the stack in place (`layer=`, either low-bit layout), so no slice of theirs
            is copied; a pooled layer and the TPU kernels read the slice. The tiers' extents
            are its `extents` (computed for every layer before the scan) when given, else the
            layer's; the positions the masses are computed from are the layer's own slices.

    Returns:
        out [B, 1, Hq, D] in q's dtype, and AttnStats (as attend_xla's).
    """
    b, t, hq, d = q.shape
    if t != 1:
        raise ValueError(f"attend_pallas is decode-only (T == 1), got T={t}")
    hkv = layer.num_kv_heads
    qg = q[:, 0].reshape(b, hkv, hq // hkv, d)
    qp = q_pos[:, 0]
    backend = default_backend()
    if layer.head is not None or backend == "tpu":  # their kernels take a layer, not a stack
        stacked = None
    # The tiers' extents: precomputed for every layer before a layer scan, else the layer's.
    given = stacked.extents if stacked is not None else None
    ext = given if given is not None else tier_extents(layer)
    if layer.head is not None:  # one pool read once for every head (`_triton_pooled.py`)
        full = PooledTier(layer.k, layer.v, layer.pos, layer.head, ext.full)
    else:
        src = stacked.stack if stacked is not None else layer  # the stack: read in place
        full = FullTier(src.k, src.v, src.pos, ext.full)
    int8 = lowbit = None
    if layer.int8 is not None:
        t8 = stacked.stack.int8 if stacked is not None else layer.int8
        int8 = Int8Tier(t8.k, t8.v, t8.k_scale, t8.v_scale, t8.pos, ext.int8)
    if layer.lowbit is not None:
        lb = layer.lowbit
        extent = ext.lowbit
        # A stacked cache's pages are read at the layer in place (no slice of the stack).
        src = stacked.stack.lowbit if stacked is not None else lb
        if isinstance(lb, KernelLowBitTier):  # read as stored by the Mosaic GPU kernel
            if backend == "tpu":
                raise ValueError(
                    "a low-bit tier in the kernel layouts (lowbit_layout='kernel' or 'words') "
                    "is read by "
                    "the Mosaic GPU kernel (Hopper GPUs) or by XLA attention; on a TPU use "
                    "lowbit_layout='token' or implementation='xla'"
                )
            lowbit = ChannelMajorLowBitTier(src.k, src.v, src.k_stats, src.v_stats, src.pos, extent)
        else:
            lowbit = LowBitTier(
                src.k, src.v, src.k_scale, src.k_zero, src.v_scale, src.v_zero, src.pos, extent
            )
    tune = tuning_for()
    joined = (
        seq_axis is None
        and backend != "tpu"
        and tune.join_new_token
        and (backend is None or join_applies(qg) is None)
        # An INT8 tier read by the Triton kernel as value words returns its channels
        # permuted, a transpose XLA fuses into its own merge but copies for the join's (5.8 us
        # a layer: confkv's step 10.30 -> 10.45 ms with the join, H100,
        # docs/lab/2026-12-07-h100-join.md); the slots-on-M kernel returns them in order.
        and not (
            int8 is not None and tune.int8_v_words and not slots_on_m(qg, int8, qp, _index(stacked))
        )
    )
    parts = decode_partials(
        qg,
        qp,
        full=full,
        int8=int8,
        lowbit=lowbit,
        bits=layer.lowbit.bits if lowbit is not None else 2,
        scale=scale,
        backend=backend or "triton",
        return_logits=need_mass,
        interpret=backend is None,  # CPU: the Pallas interpreter (tests)
        layer=_index(stacked),
        padded=joined,  # the join reads the real rows in place
    )
    logits = tuple(p.logits for p in parts) if need_mass else ()
    splits = tuple(p.out.shape[2] for p in parts)
    if joined and backend is not None and join_applies(qg, splits) is not None:
        joined = False  # too many splits for its registers: XLA's combine instead
        g = qg.shape[2]
        parts = [p._replace(out=p.out[:, :, :, :g], lse=p.lse[..., :g]) for p in parts]
    if joined:  # the partials and the step's own token merged in one launch
        out, lse, w_new = join_new_token(
            parts, qg, k_new[:, 0], v_new[:, 0], new_valid[:, 0], scale=scale,
            interpret=backend is None,
        )  # fmt: skip
    else:
        res_out, res_lse = combine(parts)
        if seq_axis is not None:
            gather = lambda x: jax.lax.all_gather(x, seq_axis, axis=2)  # [B, Hkv, S, G(, D)]
            res_out, res_lse = combine([Partials(gather(res_out), gather(res_lse), None)])
        # The step's own token joins with a log-sum-exp combine.
        s_new = einsum_f32("bhgd,bhd->bhg", qg, k_new[:, 0]) * scale  # [B, Hkv, G]
        s_new = jnp.where(new_valid[:, :1, None], s_new, -jnp.inf)
        lse = jnp.logaddexp(res_lse, s_new)
        safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
        w_cache = jnp.exp(res_lse - safe)[..., None]
        w_new = jnp.exp(s_new - safe)  # [B, Hkv, G]
        v1 = v_new[:, 0].astype(jnp.float32)[:, :, None, :]  # [B, Hkv, 1, D]
        out = w_cache * res_out + w_new[..., None] * v1
    w = query_weight[:, 0].astype(jnp.float32)
    tier_pos = [layer.pos]
    tier_pos += [layer.int8.pos] if int8 is not None else []
    tier_pos += [layer.lowbit.pos] if lowbit is not None else []
    if need_mass:
        masses = [
            attention_mass(logits, lse, _visible(pos.reshape(b, pos.shape[1], -1), qp), w)
            for logits, pos in zip(logits, tier_pos, strict=True)
        ]
    else:
        masses = [jnp.zeros((b, pos.shape[1], pos[0, 0].size), jnp.float32) for pos in tier_pos]
    if layer.head is not None:  # each pool slot's mass from its own KV head: [B, 1, P]
        own = layer.head == jnp.arange(hkv, dtype=jnp.int32)[None, :, None]  # [B, Hkv, P]
        masses[0] = jnp.sum(jnp.where(own, masses[0], 0.0), axis=1, keepdims=True)
    stats = AttnStats(
        slot_mass=masses[0],
        new_mass=(jnp.sum(w_new, axis=2) * w[:, None])[..., None],
        lse=lse.reshape(b, 1, hq),
        int8_mass=masses[1] if int8 is not None else None,
        lowbit_mass=masses[-1].reshape(layer.lowbit.pos.shape) if lowbit is not None else None,
    )
    return out.reshape(b, 1, hq, d).astype(q.dtype), stats


def attend_pallas_sharded(
    layout: Layout,
    q: Array,
    layer: LayerCache,
    k_new: Array,
    v_new: Array,
    q_pos: Array,
    new_valid: Array,
    query_weight: Array,
    *,
    scale: float,
    need_mass: bool = True,
) -> tuple[Array, AttnStats]:
    """`attend_pallas` per device of `layout`'s mesh (module docstring); the other arguments
    and the results are `attend_pallas`'s, with global shapes."""
    b_, h_, hq_, c_ = Axis.BATCH, Axis.KV_HEADS, Axis.HEADS, Axis.SLOTS
    spec = lambda *axes: layout.spec(Names(axes))
    heads_q, heads_kv, rows = spec(b_, None, hq_, None), spec(b_, None, h_, None), spec(b_, None)
    layer_specs = jax.tree.map(layout.spec, layer_names(layer), is_leaf=_is_names)
    stats_specs = AttnStats(
        slot_mass=spec(b_, h_, c_),
        new_mass=spec(b_, h_, None),
        lse=spec(b_, None, hq_),
        int8_mass=spec(b_, h_, c_) if layer.int8 is not None else None,
        lowbit_mass=spec(b_, h_, c_, None) if layer.lowbit is not None else None,
    )
    local = functools.partial(
        attend_pallas, scale=scale, need_mass=need_mass, seq_axis=layout.mesh_axis(c_)
    )
    return jax.shard_map(
        local,
        mesh=layout.mesh,
        in_specs=(heads_q, layer_specs, heads_kv, heads_kv, rows, rows, rows),
        out_specs=(heads_q, stats_specs),
        check_vma=False,
    )(q, layer, k_new, v_new, q_pos, new_valid, query_weight)


def _is_names(x) -> bool:
    return isinstance(x, Names)
