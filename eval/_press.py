"""Compression as kvpress does it (query-agnostic, once): the whole context is prefilled and
compressed once to (1 − ratio) × its length, then the question and the answer append without
evicting any context token (`AppendPolicy`).

Two kinds of policy:
* *press-scored* (`kvzip`, `expected`): the context is prefilled into a full cache through the
  public `forward`; the press's scores come from extra model passes (KVzip: reconstructing the
  context) or the context's queries (ExpectedAttention), and the top scores per KV head are kept;
* every other full-precision policy: the context streams through it as ONE prefill chunk, so it
  compresses once with the whole context in view (SnapKV from the context's last window), and
  its kept tokens move into the append-only cache.

`adakv` over either kind pools each layer's budget: Hkv·(budget − 1) tokens go to the top scores
over all the layer's KV heads (after each head's safeguard, `adakv_keep`), so heads keep unequal
shares, and the append-only cache is a pool too (`AppendPolicy(pooled=True)`): its bytes are the
kept tokens' plus the room's, whatever the split (`_press_pool.py`).

Batch 1 (as kvpress's pipeline). The timing covers every pass, the reconstruction included.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from kvjax.cache import Cache, CacheSpec, init_cache, stack_cache, unstack_cache
from kvjax.eval._press_pool import pool_append_cache, pooled_top_mask
from kvjax.generate import GenerateConfig, cache_spec_for, new_cache, prefill_cache
from kvjax.models import ModelConfig, Params, forward, stack_params
from kvjax.policies import (
    AdaKVPolicy,
    AppendPolicy,
    ExpectedAttentionPolicy,
    FullPolicy,
    KVzipPolicy,
    Policy,
    cached_tokens,
    kvzip_scores,
    unrotate,
)

Array = jax.Array
PRESS_SCORED = (KVzipPolicy, ExpectedAttentionPolicy)


@dataclasses.dataclass(frozen=True)
class Pressed:
    """A compressed context, ready for the question.

    Attributes:
        cache: the append-only cache (kept context as a dense prefix, then `room` free slots).
        policy: the AppendPolicy that continues it (pass it to `generate_from_cache`).
        kept: tokens kept per KV head of each layer (under adakv the layer's total over Hkv,
            floored: heads keep unequal shares).
        seconds: wall time of the prefill and compression (every pass, device synchronized).
    """

    cache: Cache
    policy: AppendPolicy
    kept: tuple[int, ...]
    seconds: float


def press_context(
    config: ModelConfig,
    params: Params,
    policy: Policy,
    context: Sequence[int],
    *,
    room: int,
    reconstruct: Sequence[int] = (),
    reconstruct_next: Sequence[int] = (),
    suffix: Sequence[int] = (),
    dtype=jnp.float32,
    min_slots: int = 0,
    chunk_multiple: int = 16,
    scan_params: Params | None = None,
) -> Pressed:
    """Prefill `context` and compress it once with `policy`: it keeps `cached_tokens(budget)`
    = budget - 1 tokens per KV head, as in the generate loop (a budget counts the attended
    current token).

    Args:
        config, params: the model.
        policy: any full-precision policy; `kvzip`/`expected` are scored by their passes;
            `adakv` over any of them shares each layer's budget across its KV heads.
        context: the context's token ids (chat head included, question excluded).
        room: free slots left after the kept context (question + answer tokens).
        reconstruct: KVzip's first-chunk prompt ids (RECONSTRUCT_PROMPT tokenized);
        reconstruct_next: its later-chunk prompt ids (RECONSTRUCT_CONTINUE tokenized);
        suffix: ids between that prompt and the repeated text (the chat's assistant head).
        min_slots: slots per KV head of every layer of the append-only cache at least (kept
            context + room, or more): an evaluation grid that passes the same value for all its
            compression ratios and tasks decodes them with one compiled generate step (the extra
            slots stay empty and are never attended; the kept tokens are unchanged).
        chunk_multiple: the policy's prefill pads the context to a multiple of this (padding
            is not attended), so contexts of nearby lengths share one compiled prefill.
        scan_params: `params` stacked along the layers (`stack_params`), for the layer-scanned
            prefill of a policy that allows one: a caller compressing many contexts stacks
            them once (stacked here on every call otherwise).

    Raises:
        ValueError: empty context, room < 1, a tiered (INT8/low-bit) policy, or KVzip without
            its reconstruction prompt.
    """
    s = len(context)
    if s < 1 or room < 1:
        raise ValueError(f"press_context needs a context (got {s} tokens) and room >= 1")
    if min_slots < 0 or chunk_multiple < 1:
        raise ValueError(
            f"press_context needs min_slots >= 0 and chunk_multiple >= 1, got {min_slots} and "
            f"{chunk_multiple}"
        )
    t0 = time.perf_counter()
    ids = jnp.asarray([list(context)], jnp.int32)
    press = policy.press if isinstance(policy, AdaKVPolicy) else policy
    if isinstance(press, PRESS_SCORED):
        full, scores = press_scores(
            config, params, press, context, ids, reconstruct, reconstruct_next, suffix, dtype
        )
        n = min(cached_tokens(press.budget), s)
        if isinstance(policy, AdaKVPolicy):
            keep = [pooled_top_mask(sc, n, policy.safeguard(i)) for i, sc in enumerate(scores)]
        else:
            keep = [top_slots(sc, n) for sc in scores]
        layers = full.layers
    else:
        spec = cache_spec_for(config, policy, batch=1, max_len=s, dtype=dtype)
        if is_tiered(spec):
            raise ValueError(f"press mode keeps full-precision tokens; {policy.name!r} is tiered")
        chunk = -(-s // chunk_multiple) * chunk_multiple
        gen = GenerateConfig(chunk_size=chunk, max_new_tokens=1)
        padded = jnp.zeros((1, chunk), jnp.int32).at[:, :s].set(ids)
        empty, weights = policy.empty_cache(spec), params
        # A layer scan where the policy allows one: one compiled layer instead of L unrolled
        # (an evaluation grid compiles this prefill once per policy, ratio and length).
        scan = policy.scans_layers()
        if scan:
            empty = stack_cache(empty)
            weights = stack_params(params, config) if scan_params is None else scan_params
        cache, _ = prefill_cache(
            config, policy, gen, weights, empty, padded, jnp.asarray([s], jnp.int32)
        )
        layers = (unstack_cache(cache) if scan else cache).layers
        # adakv's pools: every occupied slot is kept (`pool_append_cache`)
        pooled = isinstance(policy, AdaKVPolicy)
        keep = [None if pooled else live_slots(ly.pos) for ly in layers]
    if isinstance(policy, AdaKVPolicy):
        cache, slots, kept = pool_append_cache(config, layers, keep, room, s, dtype, min_slots)
        append = AppendPolicy(slots=slots, pooled=True)
    else:
        cache, slots, kept = _append_cache(config, layers, keep, room, s, dtype, min_slots)
        append = AppendPolicy(slots=slots)
    jax.block_until_ready(cache)
    return Pressed(
        cache=cache,
        policy=append,
        kept=kept,
        seconds=time.perf_counter() - t0,
    )


def is_tiered(spec: CacheSpec) -> bool:
    """Whether a cache of `spec` has an INT8 or low-bit tier (a press keeps full-precision
    tokens only)."""
    return spec.int8_capacities is not None or getattr(spec, "lowbit_pages", None) is not None


def top_slots(scores: Array, n: int) -> Array:
    """[B, H, n] slot indices of the n highest scores per KV head, ordered by slot (ties: the
    lower slot)."""
    order = jnp.argsort(-scores, axis=-1, stable=True)[..., :n]
    return jnp.sort(order, axis=-1)


def live_slots(pos: Array) -> Array:
    """[B, H, n] the occupied slots per KV head ordered by position, n = the most any head holds
    (heads holding fewer are padded with empty slots)."""
    n = int(jnp.max(jnp.sum(pos >= 0, axis=-1)))
    key = jnp.where(pos >= 0, pos, jnp.iinfo(jnp.int32).max)
    return jnp.argsort(key, axis=-1, stable=True)[..., :n]


def _append_cache(config, layers, keep, room, length, dtype, min_slots=0):
    """The append-only cache: per layer, each head's kept slots `keep` [B, H, n] (-1 = none,
    after the kept ones) as a dense prefix, then free slots: `room` of them, or up to
    `min_slots` in all. Returns (cache, slots per KV head of each layer, kept per KV head of
    each layer)."""
    slots = tuple(max(int(k.shape[-1]) + room, min_slots) for k in keep)
    spec = CacheSpec(
        batch=1,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        capacities=slots,
        dtype=dtype,
    )
    out, kept = [], []
    for ly, idx, empty in zip(layers, keep, init_cache(spec).layers, strict=True):
        h = idx.shape[1]
        safe = jnp.maximum(idx, 0)

        def take(a, safe=safe):
            return jnp.take_along_axis(a, safe.reshape(safe.shape + (1,) * (a.ndim - 3)), 2)

        n = idx.shape[-1]
        pos = jnp.where(idx >= 0, take(ly.pos), -1)
        kept.append(int(jnp.sum(pos >= 0)) // h)
        out.append(
            empty.replace(
                k=empty.k.at[:, :, :n].set(take(ly.k).astype(empty.k.dtype)),
                v=empty.v.at[:, :, :n].set(take(ly.v).astype(empty.v.dtype)),
                pos=empty.pos.at[:, :, :n].set(pos),
            )
        )
    cache = Cache(layers=tuple(out), length=jnp.asarray([length], jnp.int32))
    return cache, slots, tuple(kept)


def press_scores(config, params, press, context, ids, reconstruct, later, suffix, dtype):
    """The full cache of the context and a press-scored policy's scores, per layer
    [1, Hkv, S] float32 (KVzip: its reconstruction passes; ExpectedAttention: the context's
    queries)."""
    s = len(context)
    full, q, _ = _full_prefill(config, params, ids, dtype)
    if isinstance(press, KVzipPolicy):
        if not reconstruct:
            raise ValueError("kvzip needs its reconstruction prompt ids (`reconstruct`)")
        scores = _kvzip(
            config, params, press, full, list(context), reconstruct, later or reconstruct, suffix
        )
        return full, scores
    unrot = lambda qi: unrotate(qi, jnp.arange(s)[None], config.rope_theta)
    scores = [
        press.scores(unrot(qi), ly.k, ly.v, s, config.rope_theta)
        for qi, ly in zip(q, full.layers, strict=True)
    ]
    return full, scores


def _full_prefill(config, params, ids, dtype):
    """The context through the model into a full cache: (cache, queries after RoPE per layer
    [1, S, Hq, D], keys per layer). The empty cache is an argument of the jitted pass (built
    inside, XLA would constant-fold attention over its zeros)."""
    empty = new_cache(config, FullPolicy(), batch=1, max_len=ids.shape[1], dtype=dtype)
    return _full_pass(config, params, ids, empty)


@functools.partial(jax.jit, static_argnums=(0,))
def _full_pass(config, params, ids, cache):
    s = ids.shape[1]
    pos = jnp.arange(s, dtype=jnp.int32)[None]
    valid = jnp.ones((1, s), bool)
    out = forward(config, params, ids, pos, valid, cache, return_queries=True, need_mass=False)
    layers = FullPolicy().write_layers(
        cache.layers, out.k_new, out.v_new, pos, valid, out.stats, None
    )
    return Cache(layers=layers, length=jnp.asarray([s], jnp.int32)), out.q, out.k_new


def _kvzip(config, params, policy, full, context, first, later, suffix):
    """KVzip's reconstruction passes over the full cache; per layer [1, Hkv, S] scores."""
    s = len(context)
    scores = [jnp.zeros((1, config.num_kv_heads, s), jnp.float32) for _ in full.layers]
    for start in range(0, s, policy.chunk):
        stop = min(start + policy.chunk, s)
        prompt = list(first) if start == 0 else list(later) + context[max(0, start - 8) : start]
        tokens = jnp.asarray([prompt + list(suffix) + context[start:stop]], jnp.int32)
        sink = min(policy.n_sink, start)
        got = _kvzip_pass(config, params, full, tokens, start, stop, sink)
        scores = [sc.at[:, :, start:stop].set(g) for sc, g in zip(scores, got, strict=True)]
    return [sc.at[:, :, : policy.n_sink].set(1.0) for sc in scores]


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6))
def _kvzip_pass(config, params, full, tokens, start, stop, sink):
    t = tokens.shape[1]
    s = full.layers[0].pos.shape[-1]
    pos = s + jnp.arange(t, dtype=jnp.int32)[None]
    out = forward(
        config,
        params,
        tokens,
        pos,
        jnp.ones((1, t), bool),
        full,
        return_queries=True,
        need_mass=False,
    )
    return [
        kvzip_scores(q, ly.k[:, :, :sink], ly.k[:, :, start:stop], k)
        for q, ly, k in zip(out.q, full.layers, out.k_new, strict=True)
    ]
