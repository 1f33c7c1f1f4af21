"""Teacher activations: keys (after RoPE), values and targets of the frozen model over a token
sequence, one full causal forward pass per batch."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.cache import CacheSpec, init_cache
from kvjax.models import ModelConfig, Params, forward
from kvjax.train._targets import HeadAggregate, log_future_mass

Array = jax.Array


@struct.dataclass
class Teacher:
    """What the scorer learns from, for B sequences of S tokens.

    Attributes:
        k: [B, S, L, Hkv, D] keys after RoPE (storage dtype of the caller's choice).
        v: [B, S, L, Hkv, D] values.
        log_mass: [B, L, Hkv, S] float32 log future attention mass (-inf: no future query).
    """

    k: Array
    v: Array
    log_mass: Array


@functools.partial(jax.jit, static_argnames=("config", "window", "aggregate", "block"))
def teacher_activations(
    config: ModelConfig,
    params: Params,
    tokens: Array,
    *,
    window: int,
    aggregate: HeadAggregate = HeadAggregate.MAX,
    block: int = 128,
) -> Teacher:
    """Run the frozen model over `tokens` [B, S] int32 (positions 0..S−1, no cache) and compute
    each layer's targets with the transposed pass and the model's own per-query log-sum-exp."""
    b, s = tokens.shape
    spec = CacheSpec(
        batch=b,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        capacities=(1,) * config.num_layers,  # one empty slot: every key is a new token
        dtype=jax.tree_util.tree_leaves(params)[0].dtype,
    )
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    out = forward(
        config,
        params,
        tokens,
        positions,
        jnp.ones((b, s), bool),
        init_cache(spec),
        return_queries=True,
    )
    masses = [
        log_future_mass(q, k, st.lse, window=window, aggregate=aggregate, block=block)[0]
        for q, k, st in zip(out.q, out.k_new, out.stats, strict=True)
    ]
    return Teacher(
        k=jnp.stack(out.k_new, axis=2),
        v=jnp.stack(out.v_new, axis=2),
        log_mass=jnp.stack(masses, axis=1),
    )


@functools.partial(jax.jit, static_argnames=("config",))
def accumulated_mass(config: ModelConfig, params: Params, tokens: Array) -> Array:
    """H2O's score for the baseline: [B, L, Hkv, S(query), S(key)] float32 attention mass on each
    key accumulated over queries 0..q, summed over the query heads of each KV head. S × S:
    evaluation on short sequences only."""
    b, s = tokens.shape
    spec = CacheSpec(
        batch=b,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        capacities=(1,) * config.num_layers,
        dtype=jax.tree_util.tree_leaves(params)[0].dtype,
    )
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    valid = jnp.ones((b, s), bool)
    out = forward(config, params, tokens, positions, valid, init_cache(spec), return_queries=True)
    d = config.head_dim
    hkv, g = config.num_kv_heads, config.num_heads // config.num_kv_heads
    causal = jnp.arange(s)[:, None] >= jnp.arange(s)[None, :]
    cums = []
    for q, k in zip(out.q, out.k_new, strict=True):
        qg = q.astype(jnp.float32).reshape(b, s, hkv, g, d)
        logits = jnp.einsum("bqhgx,bthx->bhgqt", qg, k.astype(jnp.float32)) * d**-0.5
        p = jax.nn.softmax(jnp.where(causal, logits, -1e30), axis=-1)
        cums.append(jnp.cumsum(jnp.sum(p, axis=2), axis=2))
    return jnp.stack(cums, axis=1)
