"""Prefill and decode as pure, jittable pieces, and their jitted entry points that continue from
an existing cache (multi-turn chat, query-agnostic evaluation). `generate` is built from them."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax.attention import Implementation
from kvjax.cache import Cache, attended_slots_per_layer, slot_bytes_per_layer
from kvjax.generate._sampling import row_keys, sample
from kvjax.generate._step import model_step
from kvjax.generate._types import GenerateConfig, GenerateOutput, Telemetry
from kvjax.models import ModelConfig, Params
from kvjax.policies import Policy
from kvjax.policies._confidence import confidence

Array = jax.Array


def prefill(
    config: ModelConfig,
    policy: Policy,
    params: Params,
    cache: Cache,
    tokens: Array,
    lengths: Array,
    *,
    chunk_size: int,
    implementation: Implementation = "auto",
) -> tuple[Cache, Array]:
    """Stream right-padded prompts into the cache through the policy, chunk by chunk.

    Pure and jittable (a `lax.while_loop` over chunks); continues from whatever the cache holds.

    Args:
        tokens: [B, S] int32, right-padded, S a multiple of `chunk_size`.
        lengths: [B] int32 real tokens per row (>= 1).

    Returns:
        the cache and [B, V] float32 logits after each row's last real token.
    """
    b, t = tokens.shape[0], chunk_size

    def body(carry):
        i, cache, last_logits = carry
        start = i * t
        chunk = jax.lax.dynamic_slice_in_dim(tokens, start, t, axis=1)
        valid = (start + jnp.arange(t))[None, :] < lengths[:, None]
        logits, cache = model_step(
            config, policy, params, cache, chunk, valid, implementation=implementation
        )
        idx = lengths - 1 - start
        here = (idx >= 0) & (idx < t)
        at = jnp.take_along_axis(logits, jnp.clip(idx, 0, t - 1)[:, None, None], axis=1)[:, 0]
        return i + 1, cache, jnp.where(here[:, None], at, last_logits)

    n_chunks = (jnp.max(lengths) + t - 1) // t
    _, cache, logits = jax.lax.while_loop(
        lambda c: c[0] < n_chunks,
        body,
        (jnp.int32(0), cache, jnp.zeros((b, config.vocab_size), jnp.float32)),
    )
    return cache, logits


def decode(
    config: ModelConfig,
    policy: Policy,
    gen: GenerateConfig,
    params: Params,
    cache: Cache,
    logits: Array,
    key: Array,
) -> tuple[GenerateOutput, Cache]:
    """Sample up to gen.max_new_tokens tokens per row, starting from next-token `logits` [B, V].

    Pure and jittable (a `lax.while_loop` that stops early once every row hit a stop token).
    key: [B] per-row keys or one key (row i then uses fold_in(key, i)); step t of row b samples
    with fold_in(key[b], t), so a row's samples never depend on its batch companions.
    """
    b, n = logits.shape[0], gen.max_new_tokens
    if key.ndim == 0:
        key = row_keys(key, b)
    stops = jnp.asarray(gen.stop_tokens or (-1,), jnp.int32)
    telemetry = Telemetry(
        confidence=jnp.zeros((n, b), jnp.float32),
        live_slots=jnp.zeros((n, b, config.num_layers, 3), jnp.int32),
        budget=jnp.full((n, b), -1, jnp.int32),
        steps=jnp.int32(0),
        slot_bytes=jnp.asarray(slot_bytes_per_layer(cache), jnp.int32),
    )

    def body(carry):
        step, cache, logits, key, done, out, count, tel = carry
        sub = jax.vmap(jax.random.fold_in, (0, None))(key, step)  # [B] this step's row keys
        tok = jnp.where(done, gen.pad_id, sample(logits, sub, gen.sampling))
        out = out.at[:, step].set(tok)
        count = count + (~done).astype(jnp.int32)
        conf = confidence(logits).score()
        now_done = done | jnp.isin(tok, stops)
        logits, cache = model_step(
            config,
            policy,
            params,
            cache,
            tok[:, None],
            (~now_done)[:, None],
            implementation=gen.implementation,
        )
        tel = Telemetry(
            confidence=tel.confidence.at[step].set(jnp.where(done, 0.0, conf)),
            live_slots=tel.live_slots.at[step].set(attended_slots_per_layer(cache)),
            budget=tel.budget.at[step].set(policy.current_budget(cache.policy_state, b)),
            steps=step + 1,
            slot_bytes=tel.slot_bytes,
        )
        return step + 1, cache, logits[:, 0], key, now_done, out, count, tel

    init = (
        jnp.int32(0),
        cache,
        logits,
        key,
        jnp.zeros((b,), bool),
        jnp.full((b, n), gen.pad_id, jnp.int32),
        jnp.zeros((b,), jnp.int32),
        telemetry,
    )
    _, cache, _, _, _, out, count, tel = jax.lax.while_loop(
        lambda c: (c[0] < n) & ~jnp.all(c[4]), body, init
    )
    return GenerateOutput(tokens=out, num_generated=count, telemetry=tel), cache


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(4,))
def prefill_cache(
    config: ModelConfig,
    policy: Policy,
    gen: GenerateConfig,
    params: Params,
    cache: Cache,
    tokens: Array,
    lengths: Array,
) -> tuple[Cache, Array]:
    """Jitted `prefill` with the cache donated (updated in place): compress a context first."""
    return _prefill_gen(config, policy, gen, params, cache, tokens, lengths)


def _prefill_gen(config, policy, gen: GenerateConfig, params, cache, tokens, lengths):
    """`prefill` with the chunk size and attention implementation of `gen`."""
    knobs = dict(chunk_size=gen.chunk_size, implementation=gen.implementation)
    return prefill(config, policy, params, cache, tokens, lengths, **knobs)


def prefill_and_decode(
    config: ModelConfig,
    policy: Policy,
    gen: GenerateConfig,
    params: Params,
    cache: Cache,
    tokens: Array,
    lengths: Array,
    key: Array,
) -> tuple[GenerateOutput, Cache]:
    """`prefill` the right-padded `tokens` ([B, S], S a multiple of gen.chunk_size) on top of
    whatever the cache holds, then `decode`."""
    cache, logits = _prefill_gen(config, policy, gen, params, cache, tokens, lengths)
    return decode(config, policy, gen, params, cache, logits, key)


# Continue from a filled cache (multi-turn chat, query-agnostic evaluation). The cache is donated;
# the returned one replaces it.
generate_from_cache = jax.jit(prefill_and_decode, static_argnums=(0, 1, 2), donate_argnums=(4,))
