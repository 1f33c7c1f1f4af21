"""The shadow pass: one token stream through a policy's cache and a `full` cache in lockstep,
recording what the full model attends to and what the policy holds.

Prefill: the first P tokens in chunks through `model_step` (both caches). Decode: one token per
step, ω steps per jitted call (one routing interval; one compilation serves the whole run). Each
call returns the full model's attention rows of its ω queries and the policy's held positions at
the event that ends it; the host reduces them at once (FMM streamed over pending events, window
mass and kept windows per event), so memory is O(E · S/ω) per head, never S×S.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import EMPTY, LayerCache
from kvjax.eval._diagnostics import FmmStream, window_of_positions, window_sums
from kvjax.generate import model_step, new_cache
from kvjax.models import ModelConfig, Params
from kvjax.policies import FullPolicy, Policy

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class _FullWithMass(FullPolicy):
    """`full`, and each write leaves this call's attention mass in `score` (slot = position):
    the old slots' mass plus the new tokens' own mass, summed over each KV head's query heads."""

    def write(self, layer, k_new, v_new, pos_new, valid, stats, state, *, layer_index):
        layer = super().write(
            layer, k_new, v_new, pos_new, valid, stats, state, layer_index=layer_index
        )
        b, t = pos_new.shape
        slots = jnp.where(valid, pos_new, layer.capacity)  # [B, T]
        bi = jnp.arange(b)[:, None, None]
        hi = jnp.arange(layer.pos.shape[1])[None, :, None]
        mass = stats.slot_mass.at[bi, hi, slots[:, None, :]].add(stats.new_mass, mode="drop")
        return layer.replace(score=mass)


def _held(layer: LayerCache, s: int) -> tuple[Array, Array]:
    """([Hkv, S] any tier, [Hkv, S] full-precision tier) held positions of sequence 0."""

    def mark(pos: Array) -> Array:  # pos [Hkv, N] -> [Hkv, S]
        idx = jnp.where(pos == EMPTY, s, pos)
        hi = jnp.arange(pos.shape[0])[:, None]
        return jnp.zeros((pos.shape[0], s), bool).at[hi, idx].set(True, mode="drop")

    fp = mark(layer.pos[0])
    anyt = fp
    if layer.int8 is not None:
        anyt = anyt | mark(layer.int8.pos[0])
    if layer.lowbit is not None:
        anyt = anyt | mark(layer.lowbit.pos[0].reshape(layer.lowbit.pos.shape[1], -1))
    return anyt, fp


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(4, 5))
def _prefill(config, policy, probe, params, cache, shadow, tokens, valid):
    """tokens, valid: [1, chunk]. Returns both caches and the policy's next-token logits [V]."""
    logits, cache = model_step(config, policy, params, cache, tokens, valid)
    _, shadow = model_step(config, probe, params, shadow, tokens, valid)
    last = jnp.maximum(jnp.sum(valid, dtype=jnp.int32) - 1, 0)
    return cache, shadow, logits[0, last]


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), donate_argnums=(5, 6))
def _interval(config, policy, probe, greedy, params, cache, shadow, tokens, valid, first):
    """ω decode steps. tokens/valid: [ω] (teacher forcing; ignored after step 0 if greedy),
    first: [] int32 the greedy token for step 0. Returns caches, rows [ω, L, Hkv, S] float32,
    fed tokens [ω], the next greedy token, held [L, Hkv, S] and held_fp [L, Hkv, S] bool."""
    g = config.num_heads // config.num_kv_heads
    s = shadow.layers[0].capacity

    def body(carry, xs):
        cache, shadow, nxt = carry
        tok, val = xs
        tok = nxt if greedy else tok
        logits, cache = model_step(config, policy, params, cache, tok[None, None], val[None, None])
        _, shadow = model_step(config, probe, params, shadow, tok[None, None], val[None, None])
        rows = jnp.stack([layer.score[0] for layer in shadow.layers]) / g
        nxt = jnp.where(val, jnp.argmax(logits[0, 0]).astype(jnp.int32), nxt)
        return (cache, shadow, nxt), (rows, tok)

    (cache, shadow, nxt), (rows, fed) = jax.lax.scan(body, (cache, shadow, first), (tokens, valid))
    held = [_held(layer, s) for layer in cache.layers]
    return (
        cache,
        shadow,
        rows,
        fed,
        nxt,
        jnp.stack([a for a, _ in held]),
        jnp.stack([f for _, f in held]),
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShadowRecord:
    """What one shadow pass saw (leading axes [L, Hkv] on every per-head array).

    Attributes:
        event_pos: [E] int, position t_e of each routing event (P - 1 + kω, k >= 1).
        fmm: [L, Hkv, E] float64 FMM per event (NaN without a full horizon).
        window_mass: [L, Hkv, E, W] float32 full-model mass per window over each event's ω steps.
        held: [L, Hkv, E, W] bool windows with a position in any tier at each event.
        held_fp: [L, Hkv, E, W] bool windows with a position in the full-precision tier.
        tokens: [S] int32 the stream (generated tokens replace the text's in --generate mode).
        attention: [S, L, Hkv, S] float32 full-model rows (decode queries only) if recorded.
        cached: [L, Hkv, E, S] bool held positions per event if recorded.
    """

    event_pos: np.ndarray
    fmm: np.ndarray
    window_mass: np.ndarray
    held: np.ndarray
    held_fp: np.ndarray
    tokens: np.ndarray
    attention: np.ndarray | None = None
    cached: np.ndarray | None = None


def shadow_pass(
    config: ModelConfig,
    params: Params,
    tokens: np.ndarray,
    *,
    policy: Policy,
    prompt_tokens: int,
    window: int = 8,
    horizon: int = 32,
    generate: bool = False,
    prefill_chunk: int = 128,
    cache_dtype=None,
    record: bool = False,
    progress: bool = False,
) -> ShadowRecord:
    """Run `tokens` through `policy`'s cache and a full cache in lockstep (see module doc).

    Args:
        config, params: the model.
        tokens: [S] int token ids (in generate mode only the first P are used).
        policy: the policy under test.
        prompt_tokens: P, prefilled in chunks (1 <= P <= S - ω).
        window: ω, decode steps per routing event and positions per window.
        horizon: H for FMM.
        generate: feed the policy model's greedy tokens after the prompt instead of the text.
        prefill_chunk: tokens per prefill call.
        cache_dtype: storage dtype of both caches (default: the params' dtype).
        record: also return the attention rows and held positions (tests; O(S²) memory).
        progress: show a progress bar.
    """
    tokens = np.asarray(tokens, np.int32)
    s, p = tokens.shape[0], prompt_tokens
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if not 1 <= p <= s - window:
        raise ValueError(f"prompt tokens must be in [1, {s - window}] for {s} tokens, got {p}")
    dtype = cache_dtype or jax.tree_util.tree_leaves(params)[0].dtype
    probe = _FullWithMass()
    # Fresh buffers per leaf: an empty cache may share one array between leaves, which
    # donation (in-place updates) refuses.
    fresh = lambda c: jax.tree.map(jnp.copy, c)
    cache = fresh(new_cache(config, policy, batch=1, max_len=s, dtype=dtype))
    shadow = fresh(new_cache(config, probe, batch=1, max_len=s, dtype=dtype))
    chunk = min(prefill_chunk, p)
    logits = None
    for start in range(0, p, chunk):
        n = min(chunk, p - start)
        tok = np.zeros((1, chunk), np.int32)
        tok[0, :n] = tokens[start : start + n]
        val = np.arange(chunk)[None] < n
        cache, shadow, logits = _prefill(config, policy, probe, params, cache, shadow, tok, val)
    nxt = jnp.argmax(logits).astype(jnp.int32)
    stream = FmmStream(horizon)
    fed_all = [tokens[:p]]
    masses, held, held_fp, rows_all, cached_all, events = [], [], [], [], [], []
    calls = range(math.ceil((s - p) / window))
    if progress:
        from tqdm.auto import tqdm

        calls = tqdm(calls, desc=f"diagnostics [{policy.name}]", unit="event")
    for i in calls:
        start = p + i * window
        n = min(window, s - start)
        tok = np.zeros((window,), np.int32)
        tok[:n] = tokens[start : start + n]
        val = np.arange(window) < n
        cache, shadow, rows, fed, nxt, h_any, h_fp = _interval(
            config, policy, probe, generate, params, cache, shadow, tok, val, nxt
        )
        rows = np.asarray(rows)[:n]
        fed_all.append(np.asarray(fed)[:n])
        stream.add_rows(start, rows)
        if record:
            rows_all.append(rows)
        if n < window:
            break  # a partial interval is no routing event; its rows still count for FMM
        t = start + window - 1
        h_any, h_fp = np.asarray(h_any), np.asarray(h_fp)
        stream.add_event(t, h_any)
        events.append(t)
        masses.append(window_sums(rows.sum(axis=0), window))
        held.append(window_of_positions(h_any, window))
        held_fp.append(window_of_positions(h_fp, window))
        if record:
            cached_all.append(h_any)
    attention = None
    if record:
        attention = np.zeros((s, *rows_all[0].shape[1:]), np.float32)
        attention[p:] = np.concatenate(rows_all)
    stack = lambda xs: np.stack(xs, axis=-2)  # [L, Hkv, E, ...]
    return ShadowRecord(
        event_pos=np.asarray(events, np.int64),
        fmm=stream.result(),
        window_mass=stack(masses),
        held=stack(held),
        held_fp=stack(held_fp),
        tokens=np.concatenate(fed_all),
        attention=attention,
        cached=stack(cached_all) if record else None,
    )
