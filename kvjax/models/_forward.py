"""Forward pass over the slot cache: (params, tokens, positions, cache) → logits, new K/V, stats.

The forward pass only *reads* the cache. It returns each layer's new keys/values (after RoPE)
and the attention mass on every slot; the policy then decides what to write. This lets a policy
use the step's logits (CONF-KV's confidence) and keeps the model ignorant of policies.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

from kvjax._numerics import project, separate
from kvjax.attention import AttnStats, Implementation, KeyShift, attend
from kvjax.cache import (
    Cache,
    StackedLayer,
    is_stacked,
    num_layers,
    stack_trees,
    tier_extents,
)
from kvjax.models._config import Arch, ModelConfig
from kvjax.models._layers import (
    apply_rope,
    apply_rope_table,
    dense,
    gelu_tanh,
    layer_norm,
    rms_norm,
    rope_table,
)
from kvjax.models._params import GPT2Params, LlamaParams, Params

Array = jax.Array


@struct.dataclass
class ForwardOutput:
    """Attributes:
    logits: [B, T, V] float32.
    k_new: per layer [B, T, Hkv, D] keys after RoPE.
    v_new: per layer [B, T, Hkv, D] values.
    stats: per layer AttnStats.
    q: per layer [B, T, Hq, D] queries after RoPE, only with `return_queries=True` (else None).

    Over a stacked cache (`kvjax.cache.stack_cache`) each of k_new, v_new, stats and q is one
    array (one AttnStats) with a leading [L] axis instead of a tuple.
    """

    logits: Array
    k_new: tuple[Array, ...]
    v_new: tuple[Array, ...]
    stats: tuple[AttnStats, ...]
    q: tuple[Array, ...] | None = None


def forward(
    config: ModelConfig,
    params: Params,
    tokens: Array,
    positions: Array,
    valid: Array,
    cache: Cache,
    *,
    query_weight: Array | None = None,
    implementation: Implementation = "auto",
    return_queries: bool = False,
    need_mass: bool = True,
    key_shift: tuple[KeyShift, ...] | KeyShift | None = None,
) -> ForwardOutput:
    """Run the model on T new tokens per sequence, attending over the cache plus themselves.

    Args:
        config: the model's static config.
        params: LlamaParams or GPT2Params.
        tokens: [B, T] int32 token ids.
        positions: [B, T] int32 original positions.
        valid: [B, T] bool, real token (False = padding; it is neither attended nor cached).
        cache: the cache, holding only tokens before these. A stacked cache runs the layers
            in a `lax.scan`; pass params stacked too (`stack_params`), else they are stacked
            on every call.
        query_weight: [B, T] weight of each query in the attention mass (default: valid).
        implementation: attention implementation name.
        return_queries: also return each layer's queries (the KVpop teacher needs them).
        need_mass: whether the attention mass in `stats` is read (see `attend`).
        key_shift: None, or per layer the positions by which attention turns each cached key
            (`KeyShift`; one per layer, or one with a leading [L] axis over a stacked cache):
            keys attended at positions within the cache (`Policy.key_shift`). RoPE models only.

    Raises:
        ValueError: `key_shift` for a model without RoPE.
    """
    attn = dict(query_weight=query_weight, implementation=implementation, need_mass=need_mass)
    if key_shift is not None:
        rotate = rope_rotation(config)
        if rotate is None:
            raise ValueError(f"key_shift: the model {config.name or ''} has no RoPE")
        attn["rotate"] = rotate
    else:
        n = num_layers(cache)
        key_shift = None if is_stacked(cache) else (None,) * n
    run = _gpt2 if config.arch == Arch.GPT2 else _llama
    out, qs = run(config, params, tokens, positions, valid, cache, key_shift, attn)
    return out.replace(q=qs) if return_queries else out


def rope_rotation(config: ModelConfig) -> Callable[[Array, Array], Array] | None:
    """The model's RoPE as a rotation of keys, for policies that move cached keys
    (`Policy.reposition_keys`); None for a model without RoPE (GPT-2's learned positions).

    The result maps (x [B, T, H, D], by [B, T] int32) to x turned by `by` positions with the
    model's theta and frequency scaling, in x's dtype (computed in float32).
    """
    if config.arch == Arch.GPT2:
        return None
    return functools.partial(apply_rope, theta=config.rope_theta, scaling=config.rope_scaling)


def _split_heads(x: Array, h: int, d: int) -> Array:
    return x.reshape(*x.shape[:-1], h, d)


def _llama_qkv(config: ModelConfig, lp, h: Array) -> tuple[Array, Array, Array]:
    """q [B, T, Hq, D], k and v [B, T, Hkv, D] (before RoPE) of the normed input h, in h's
    dtype: one GEMM of a fused `wqkv` (`fuse_projections`), else one each."""
    hq, hkv, d = config.num_heads, config.num_kv_heads, config.head_dim
    if lp.wqkv is None:
        hq_, hk_, hv_ = separate(h, 3)
        q = _split_heads(dense(hq_, lp.wq, lp.bq), hq, d)
        return (
            q,
            _split_heads(dense(hk_, lp.wk, lp.bk), hkv, d),
            _split_heads(dense(hv_, lp.wv, lp.bv), hkv, d),
        )
    g = hq // hkv
    y = project(h, lp.wqkv).reshape(*h.shape[:-1], hkv, g + 2, d)
    parts = [y[..., :g, :].reshape(*h.shape[:-1], hq, d), y[..., g, :], y[..., g + 1, :]]
    biases = (lp.bq, lp.bk, lp.bv)
    return tuple(
        (p if b is None else p + _bias_heads(b, p)).astype(h.dtype)
        for p, b in zip(parts, biases, strict=True)
    )


def _bias_heads(b: Array, like: Array) -> Array:
    """A [H*D] bias as float32 [1, ..., H, D], to add to like [..., H, D] (explicit ranks)."""
    return b.astype(jnp.float32).reshape((1,) * (like.ndim - 2) + like.shape[-2:])


def _llama_gate_up(lp, h: Array) -> tuple[Array, Array]:
    """The MLP's gate and up projections of the normed input h, float32 values of h's dtype:
    one GEMM of a fused `w_gate_up`, else one each."""
    if lp.w_gate_up is None:
        hg, hu = separate(h, 2)
        return dense(hg, lp.w_gate).astype(jnp.float32), dense(hu, lp.w_up).astype(jnp.float32)
    y = project(h, lp.w_gate_up).astype(h.dtype).astype(jnp.float32)
    y = y.reshape(*h.shape[:-1], -1, 2)
    return y[..., 0], y[..., 1]


def _llama_layer(config: ModelConfig, lp, layer_cache, shift, x, positions, valid, attn, rope):
    """One Llama block: x [B, T, E] → (x, (q, k, v, stats)); `shift`: the layer's KeyShift
    or None; `rope`: the call's `rope_table` at `positions` (every layer's)."""
    hq, d = config.num_heads, config.head_dim
    q, k, v = _llama_qkv(config, lp, rms_norm(x, lp.attn_norm, config.norm_eps))
    q, k = apply_rope_table(q, rope), apply_rope_table(k, rope)
    k, v = _to_cache_dtype(layer_cache, k, v)
    o, st = attend(q, layer_cache, k, v, positions, valid, key_shift=shift, **attn)
    x = x + dense(o.reshape(*o.shape[:2], hq * d), lp.wo)
    gate, up = _llama_gate_up(lp, rms_norm(x, lp.mlp_norm, config.norm_eps))
    x = x + dense((jax.nn.silu(gate) * up).astype(x.dtype), lp.w_down)
    return x, (q, k, v, st)


def _gpt2_layer(config: ModelConfig, lp, layer_cache, shift, x, positions, valid, attn):
    """One GPT-2 block: x [B, T, E] → (x, (q, k, v, stats)); `shift` is always None."""
    del shift
    hq, d = config.num_heads, config.head_dim
    h = layer_norm(x, lp.ln1_g, lp.ln1_b, config.norm_eps)
    qkv = dense(h, lp.w_qkv, lp.b_qkv)
    q, k, v = (_split_heads(a, hq, d) for a in jnp.split(qkv, 3, axis=-1))
    k, v = _to_cache_dtype(layer_cache, k, v)
    o, st = attend(q, layer_cache, k, v, positions, valid, **attn)
    x = x + dense(o.reshape(*o.shape[:2], hq * d), lp.wo, lp.bo)
    h = layer_norm(x, lp.ln2_g, lp.ln2_b, config.norm_eps)
    x = x + dense(gelu_tanh(dense(h, lp.w_fc, lp.b_fc)), lp.w_proj, lp.b_proj)
    return x, (q, k, v, st)


def _to_cache_dtype(layer_cache, k, v):
    """This call's k, v in the dtypes of the layer's cache (a LayerCache or a StackedLayer)."""
    kv = layer_cache.stack if isinstance(layer_cache, StackedLayer) else layer_cache
    return k.astype(kv.k.dtype), v.astype(kv.v.dtype)


def _layers(config: ModelConfig, block, param_layers, cache: Cache, shifts, x, args):
    """Every block in order: unrolled over a per-layer cache, a `lax.scan` over a stacked one
    (its layer compiled once; each block gets a `StackedLayer`, the stack and its index, read
    only, so attention kernels that take the stack read it in place). `shifts`: a KeyShift (or
    None) per layer, or one stacked KeyShift (or None) over a stacked cache.
    Returns x and (qs, ks, vs, stats): tuples per layer, or stacked [L, ...] arrays."""
    run = lambda x, lp, lc, ks: block(config, lp, lc, ks, x, *args)  # positions, valid, attn
    if not is_stacked(cache):
        if not isinstance(param_layers, tuple | list):  # stacked params: layer i is a slice
            n = len(cache.layers)
            param_layers = [jax.tree.map(lambda a, i=i: a[i], param_layers) for i in range(n)]
        outs = []
        for lp, lc, ks in zip(param_layers, cache.layers, shifts, strict=True):
            x, out = run(x, lp, lc, ks)
            outs.append(out)
        return x, tuple(tuple(o) for o in zip(*outs, strict=True))
    if isinstance(param_layers, tuple):  # per-layer params: stacked here, i.e. once per call
        param_layers = stack_trees(param_layers, "the model's layer parameters")
    n = num_layers(cache)
    # Every layer's tier extents in one reduction per tier, before the scan (XLA does not hoist
    # the per-layer ones: a kernel per tier and layer each step).
    extents = tier_extents(cache.layers)

    # The layer index rides in the carry: as a scanned `arange` it was a per-layer slice, which
    # the GPU compiles as one more device copy a layer and step (1.7 µs each on an H100).
    def body(carry, xs):
        x, i = carry
        x, out = run(x, xs[0], StackedLayer(cache.layers, i, xs[2]), xs[1])
        return (x, i + 1), out

    (x, _), outs = jax.lax.scan(body, (x, jnp.int32(0)), (param_layers, shifts, extents), length=n)
    return x, outs


def _llama(config: ModelConfig, p: LlamaParams, tokens, positions, valid, cache, shifts, attn):
    x = jnp.take(p.embed, tokens, axis=0)  # [B, T, E]
    rope = rope_table(positions, config.head_dim, config.rope_theta, config.rope_scaling)
    args = (positions, valid, attn, rope)
    x, (qs, ks, vs, stats) = _layers(config, _llama_layer, p.layers, cache, shifts, x, args)
    x = rms_norm(x, p.final_norm, config.norm_eps)
    tied = p.lm_head is None  # tied: the embedding [V, E] read as stored
    logits = project(x, p.embed, w_transposed=True) if tied else project(x, p.lm_head)
    return ForwardOutput(logits=logits, k_new=ks, v_new=vs, stats=stats), qs


def _gpt2(config: ModelConfig, p: GPT2Params, tokens, positions, valid, cache, shifts, attn):
    x = jnp.take(p.wte, tokens, axis=0) + jnp.take(p.wpe, positions, axis=0)
    args = (positions, valid, attn)
    x, (qs, ks, vs, stats) = _layers(config, _gpt2_layer, p.layers, cache, shifts, x, args)
    x = layer_norm(x, p.ln_f_g, p.ln_f_b, config.norm_eps)
    logits = project(x, p.wte, w_transposed=True)
    return ForwardOutput(logits=logits, k_new=ks, v_new=vs, stats=stats), qs
