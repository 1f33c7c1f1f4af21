"""`generate`: chunked prefill then decode, one jit, cache updated in place."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.attention import Implementation
from kvjax.cache import (
    Cache,
    CacheSpec,
    init_cache,
    live_slots_per_layer,
    slot_bytes_per_layer,
    slots_to_bytes,
)
from kvjax.generate._sampling import GREEDY, Sampling, sample
from kvjax.generate._step import model_step
from kvjax.generate._validate import check_lengths, check_tokens, pad_prompts
from kvjax.models import ModelConfig, Params
from kvjax.policies import Policy
from kvjax.policies._confidence import confidence

Array = jax.Array


@struct.dataclass
class Telemetry:
    """Per decode step (rows past `steps` are zero).

    Attributes:
        confidence: [N, B] float32 CONF-KV confidence of the distribution the token came from.
        live_slots: [N, B, L, 3] int32 occupied units per layer and tier (full slots, INT8
            slots, low-bit pages), summed over KV heads, after the step.
        budget: [N, B] int32 the policy's token budget chosen for the step (-1: fixed budget).
        steps: [] int32 number of decode steps run.
        slot_bytes: [L, 3] int32 K/V bytes of one unit of one KV head, per layer and tier.
    """

    confidence: Array
    live_slots: Array
    budget: Array
    steps: Array
    slot_bytes: Array

    def live_bytes(self) -> np.ndarray:
        """[N, B] int64 live K/V bytes after each step (host side, exact)."""
        return slots_to_bytes(np.asarray(self.live_slots), np.asarray(self.slot_bytes, np.int64))


@struct.dataclass
class GenerateOutput:
    """Attributes:
    tokens: [B, N] int32 generated ids (pad after a stop token; the stop token is included).
    num_generated: [B] int32 tokens generated per sequence.
    telemetry: per-step Telemetry.
    """

    tokens: Array
    num_generated: Array
    telemetry: Telemetry


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerateConfig:
    """Static settings of a generation (hashable: one compilation per distinct value).

    Attributes:
        max_new_tokens: N, tokens generated per sequence at most.
        sampling: greedy / temperature / top-p.
        stop_tokens: ids that end a sequence (included in the output).
        chunk_size: prompt tokens per prefill call (a prompt longer than the cache streams
            through the policy chunk by chunk).
        cache_dtype: storage dtype of the full-precision cache tier (None: the params' dtype).
        implementation: attention implementation.
        pad_id: id written after a sequence stops.
    """

    max_new_tokens: int
    sampling: Sampling = GREEDY
    stop_tokens: tuple[int, ...] = ()
    chunk_size: int = 256
    cache_dtype: str | None = None
    implementation: Implementation = "xla"
    pad_id: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")


def generate(
    config: ModelConfig,
    params: Params,
    prompts: Sequence[Sequence[int]],
    *,
    policy: Policy,
    gen: GenerateConfig,
    seed: int = 0,
) -> GenerateOutput:
    """Generate continuations of a batch of prompts (different lengths allowed).

    Args:
        config: the model's config.
        params: the model's parameters.
        prompts: B lists of token ids, each non-empty.
        policy: the cache policy.
        gen: static generation settings.
        seed: sampling seed (ignored when greedy).
    """
    lengths = check_lengths(prompts)
    tokens = pad_prompts(prompts, gen.chunk_size, gen.pad_id)
    check_tokens(tokens, lengths, config.vocab_size)
    max_len = tokens.shape[1] + gen.max_new_tokens
    if config.max_positions and int(lengths.max()) + gen.max_new_tokens > config.max_positions:
        raise ValueError(
            f"prompt + max_new_tokens = {int(lengths.max()) + gen.max_new_tokens} "
            f"exceeds the model's {config.max_positions} learned positions"
        )
    for s in gen.stop_tokens:
        if not 0 <= s < config.vocab_size:
            raise ValueError(f"stop token {s} is out of range [0, {config.vocab_size})")
    dtype = gen.cache_dtype or jax.tree_util.tree_leaves(params)[0].dtype
    spec = policy.cache_spec(
        batch=len(prompts),
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_len=max_len,
        dtype=dtype,
    )
    return _generate(
        config,
        policy,
        gen,
        spec,
        params,
        jnp.asarray(tokens),
        jnp.asarray(lengths),
        jax.random.key(seed),
    )


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _generate(
    config: ModelConfig,
    policy: Policy,
    gen: GenerateConfig,
    spec: CacheSpec,
    params: Params,
    tokens: Array,
    lengths: Array,
    key: Array,
) -> GenerateOutput:
    cache = init_cache(spec, policy.init_state(tokens.shape[0]))
    cache, logits = prefill(
        config,
        policy,
        params,
        cache,
        tokens,
        lengths,
        chunk_size=gen.chunk_size,
        implementation=gen.implementation,
    )
    return decode(config, policy, gen, params, cache, logits, key)[0]


def prefill(
    config: ModelConfig,
    policy: Policy,
    params: Params,
    cache: Cache,
    tokens: Array,
    lengths: Array,
    *,
    chunk_size: int,
    implementation: Implementation = "xla",
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
    """
    b, n = logits.shape[0], gen.max_new_tokens
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
        key, sub = jax.random.split(key)
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
            live_slots=tel.live_slots.at[step].set(live_slots_per_layer(cache)),
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
    return prefill(
        config,
        policy,
        params,
        cache,
        tokens,
        lengths,
        chunk_size=gen.chunk_size,
        implementation=gen.implementation,
    )


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(4,))
def generate_from_cache(
    config: ModelConfig,
    policy: Policy,
    gen: GenerateConfig,
    params: Params,
    cache: Cache,
    tokens: Array,
    lengths: Array,
    key: Array,
) -> tuple[GenerateOutput, Cache]:
    """Continue from a filled cache (multi-turn chat, query-agnostic evaluation): prefill
    `tokens` ([B, S] right-padded, S a multiple of gen.chunk_size) on top of it, then decode.
    The cache is donated; the returned one replaces it."""
    cache, logits = prefill(
        config,
        policy,
        params,
        cache,
        tokens,
        lengths,
        chunk_size=gen.chunk_size,
        implementation=gen.implementation,
    )
    return decode(config, policy, gen, params, cache, logits, key)


def prompt_array(prompts: Sequence[Sequence[int]]) -> np.ndarray:
    """Right-padded [B, S] int32 array of prompts (pad 0), for inspection."""
    return pad_prompts(prompts, 1, 0)
