"""One model call through the policy: forward (reads the cache) → policy writes new tokens.

These are the pure building blocks for users who write their own jitted loops; `generate` and
`score_tokens` are built from them.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from kvjax.attention import Implementation
from kvjax.cache import Cache, CacheSpec
from kvjax.generate._fit import fit_policy
from kvjax.models import ModelConfig, Params, forward
from kvjax.policies import Policy

Array = jax.Array


def model_step(
    config: ModelConfig,
    policy: Policy,
    params: Params,
    cache: Cache,
    tokens: Array,
    valid: Array,
    *,
    query_weight: Array | None = None,
    implementation: Implementation = "auto",
) -> tuple[Array, Cache]:
    """Feed T tokens per sequence at positions cache.length + [0, T) and update the cache.

    Args:
        config: model config (static).
        policy: cache policy (static).
        params: model parameters.
        cache: the cache before these tokens.
        tokens: [B, T] int32.
        valid: [B, T] bool; a sequence's valid tokens must be a prefix of its T (padding after).
            Invalid tokens are not cached and do not advance the sequence.
        query_weight: [B, T] weight of each query in the attention mass the policy sees
            (default: the policy's `query_weight`, else every valid query once).
        implementation: attention implementation.

    Returns:
        logits [B, T, V] float32 and the updated cache. Pass the cache with
        `donate_argnums` when calling this under your own jit so it is updated in place.
    """
    policy = fit_policy(policy, config)
    try:  # shapes are static, so this also runs (once, at trace time) under jit
        chex.assert_rank([tokens, valid], 2)
        chex.assert_equal_shape([tokens, valid])
        chex.assert_type([tokens, valid], [int, bool])
    except AssertionError as e:
        raise ValueError(f"model_step: tokens and valid must be [B, T] int and bool: {e}") from None
    t = tokens.shape[1]
    positions = cache.length[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    if query_weight is None:
        query_weight = policy.query_weight(positions, valid)
    out = forward(
        config,
        params,
        tokens,
        positions,
        valid,
        cache,
        query_weight=query_weight,
        implementation=implementation,
        need_mass=policy.uses_attention_mass,
    )
    # Every read of the cache (attention) completes before the policy writes into it; without
    # this XLA's CPU compiler may sink a read past the write and copy the whole cache.
    out, cache = jax.lax.optimization_barrier((out, cache))
    n_valid = jnp.sum(valid, axis=1, dtype=jnp.int32)
    last = jnp.take_along_axis(out.logits, jnp.maximum(n_valid - 1, 0)[:, None, None], axis=1)[:, 0]
    state = policy.begin_step(cache.policy_state, last, n_valid > 0)
    layers = policy.write_layers(
        cache.layers, out.k_new, out.v_new, positions, valid, out.stats, state
    )
    new_cache = Cache(layers=layers, length=cache.length + n_valid, policy_state=state)
    return out.logits, new_cache


def cache_spec_for(
    config: ModelConfig, policy: Policy, *, batch: int, max_len: int, dtype
) -> CacheSpec:
    """The cache `policy` needs for this model and `batch` sequences of at most `max_len`
    tokens.

    Raises:
        ValueError: the policy was built for another layer count (see `fit_policy`).
    """
    policy = fit_policy(policy, config)
    return policy.cache_spec(
        batch=batch,
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_len=max_len,
        dtype=dtype,
    )


def new_cache(config: ModelConfig, policy: Policy, *, batch: int, max_len: int, dtype) -> Cache:
    """An empty cache shaped for `policy` (all tiers) and sequences of at most `max_len` tokens."""
    policy = fit_policy(policy, config)
    return policy.empty_cache(
        cache_spec_for(config, policy, batch=batch, max_len=max_len, dtype=dtype)
    )
