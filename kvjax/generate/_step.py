"""One model call through the policy: forward (reads the cache) → policy writes new tokens.

These are the pure building blocks for users who write their own jitted loops; `generate` and
`score_tokens` are built from them.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp

from kvjax.attention import AttnStats, Implementation
from kvjax.cache import (
    Cache,
    CacheSpec,
    LayerCache,
    is_stacked,
    stack_cache,
)
from kvjax.generate._fit import fit_policy
from kvjax.models import ModelConfig, Params, forward, rope_rotation
from kvjax.policies import Policy
from kvjax.sharding import constrain_cache

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
        key_shift=_key_shifts(policy, cache),
    )
    # Every read of the cache (attention) completes before the policy writes into it; without
    # this XLA's CPU compiler may sink a read past the write and copy the whole cache.
    out, cache = jax.lax.optimization_barrier((out, cache))
    n_valid = jnp.sum(valid, axis=1, dtype=jnp.int32)
    at = jnp.maximum(n_valid - 1, 0)[:, None, None]  # in range: no bounds mask
    last = jnp.take_along_axis(out.logits, at, axis=1, mode="clip")[:, 0]
    state = policy.begin_step(cache.policy_state, last, n_valid > 0)
    # Keys a policy moves to new positions (StreamingLLM's positions within the cache) are
    # turned by the model's RoPE after the write, for the next call's queries.
    moved = (cache.length + n_valid, rope_rotation(config)) if policy.repositions_keys() else None
    if is_stacked(cache):
        layers = write_stacked(
            policy, cache.layers, out.k_new, out.v_new, positions, valid, out.stats, state,
            moved=moved,
        )  # fmt: skip
        new_cache = Cache(layers=layers, length=cache.length + n_valid, policy_state=state)
        return out.logits, new_cache
    layers = policy.write_layers(
        cache.layers, out.k_new, out.v_new, positions, valid, out.stats, state
    )
    if moved is not None:
        layers = tuple(policy.reposition_keys(layer, *moved) for layer in layers)
    new_cache = Cache(layers=layers, length=cache.length + n_valid, policy_state=state)
    return out.logits, constrain_cache(new_cache)  # identity unless traced under a layout


def _key_shifts(policy: Policy, cache: Cache):
    """Each layer's `Policy.key_shift` for this call (positions within the cache), one per
    layer or one stacked over a stacked cache; None when the policy attends keys where they
    were cached."""
    if not policy.shifts_key_positions():
        return None
    first = cache.length  # [B] the position of this call's first query
    if is_stacked(cache):
        return jax.vmap(lambda layer: policy.key_shift(layer, first))(cache.layers)
    return tuple(policy.key_shift(layer, first) for layer in cache.layers)


def check_scannable(policy: Policy, what: str) -> None:
    """One clear error where `policy` cannot run in a layer scan.

    Raises:
        ValueError: per-layer budgets (pyramidkv, confkv with `pyramid`): its layers differ in
            shape or in how they are written.
    """
    if not policy.scans_layers():
        raise ValueError(
            f"{what}: policy {policy.name!r} with these settings cannot run in a layer scan: "
            "its layers have different budgets (per-layer budgets: pyramid) and so differ in "
            "shape or in how they are written; run it unrolled (scan_layers=False)"
        )


def write_stacked(
    policy: Policy,
    layers: LayerCache,
    k_new: Array,
    v_new: Array,
    positions: Array,
    valid: Array,
    stats: AttnStats,
    state,
    *,
    moved=None,
) -> LayerCache:
    """`policy.write` into every layer of a stacked cache (the layer-scan counterpart of
    `Policy.write_layers`): `Policy.write_stack`, by default one `jax.vmap` of the write over
    the layers (QEvict's: one routing cond and one move loop for all layers), each
    scatter writing the stacked buffers in place.

    Args:
        layers: the stacked LayerCache (leading [L] axis on every array).
        k_new, v_new: [L, B, T, Hkv, D] each layer's new keys (after RoPE) and values.
        positions: [B, T] int32; valid: [B, T] bool.
        stats: AttnStats with a leading [L] axis on every array.
        state: the policy's state for this step (`Policy.begin_step`).
        moved: None, or the (next position, rotation) of `Policy.reposition_keys`, applied
            to each layer after its write.

    Raises:
        ValueError: the policy cannot scan (`check_scannable`).
    """
    check_scannable(policy, "a stacked cache")
    new = policy.write_stack(layers, k_new, v_new, positions, valid, stats, state)
    if moved is None:
        return new
    return jax.vmap(lambda layer: policy.reposition_keys(layer, *moved))(new)


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


def new_cache(
    config: ModelConfig,
    policy: Policy,
    *,
    batch: int,
    max_len: int,
    dtype,
    stacked: bool = False,
) -> Cache:
    """An empty cache shaped for `policy` (all tiers) and sequences of at most `max_len` tokens.

    With `stacked=True` the layers' buffers share one leading [L] axis and `model_step` runs a
    layer scan over them (compiled once instead of once per layer; docs/compile.md).

    Raises:
        ValueError: `stacked=True` for a policy whose layers differ in shape or in how they
            are written (per-layer budgets: pyramidkv, confkv with `pyramid`).
    """
    policy = fit_policy(policy, config)
    spec = cache_spec_for(config, policy, batch=batch, max_len=max_len, dtype=dtype)
    if not stacked:
        return policy.empty_cache(spec)
    check_scannable(policy, "new_cache(stacked=True)")
    return _empty_stacked(policy, spec)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _empty_stacked(policy: Policy, spec) -> Cache:
    """The empty cache stacked, built in one computation: only the stack is allocated (stacked
    eagerly, the per-layer buffers and the stack would both be live: twice the cache)."""
    return stack_cache(policy.empty_cache(spec))
