"""Teacher-forced scoring through the policy's cache (perplexity as in generation).

Token t+1 is predicted from the *compressed* cache after tokens 0..t were fed, exactly as in
decoding; with `chunk=1` every token is its own decode step.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.attention import Implementation
from kvjax.cache import Cache, attended_slots_per_layer
from kvjax.generate._fit import fit_policy
from kvjax.generate._step import cache_spec_for, check_scannable, model_step, new_cache
from kvjax.generate._validate import check_window
from kvjax.models import ModelConfig, Params, stack_params
from kvjax.policies import Policy
from kvjax.sharding import (
    TENSOR_PARALLEL,
    Layout,
    ShardingRules,
    cache_shardings,
    constrain_cache,
    place_global,
    shard_params,
    use_layout,
)

Array = jax.Array


@struct.dataclass
class ScoreOutput:
    """Attributes:
    nll: [B, S-1] float32 negative log-likelihood of tokens 1..S-1 (0 past a row's length).
    live_slots: [S-1, B, L, 3] int32 units attended per layer and tier when each prediction was
        made: the occupied units after the token that makes it was written, plus that token.
    cache: the final cache.
    """

    nll: Array
    live_slots: Array
    cache: Cache


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4), donate_argnums=(6,))
def _score_segment(
    config: ModelConfig,
    policy: Policy,
    chunk: int,
    impl: Implementation,
    layout: Layout | None,
    params: Params,
    cache: Cache,
    tokens: Array,
    targets: Array,
    valid: Array,
):
    """Feed a segment [B, K] chunk by chunk; NLL of each token's target. Cache is donated.
    Traced under `layout` (None: unsharded)."""
    with use_layout(layout):
        return _score_chunks(config, policy, chunk, impl, params, cache, tokens, targets, valid)


def _score_chunks(config, policy, chunk, impl, params, cache, tokens, targets, valid):
    b, k = tokens.shape

    def body(cache, xs):
        tok, tgt, val = xs  # each [B, chunk]
        logits, cache = model_step(config, policy, params, cache, tok, val, implementation=impl)
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = jnp.where(val, -jnp.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0], 0.0)
        live = attended_slots_per_layer(cache)
        return cache, (nll, jnp.broadcast_to(live[:, None], (b, chunk, *live.shape[1:])))

    split = lambda x: jnp.moveaxis(x.reshape(b, k // chunk, chunk), 1, 0)
    xs = (split(tokens), split(targets), split(valid))
    cache, (nll, live) = jax.lax.scan(body, constrain_cache(cache), xs)
    nll = jnp.moveaxis(nll, 0, 1).reshape(b, k)
    live = jnp.moveaxis(live, 0, 1).reshape(b, k, *live.shape[-2:])
    return cache, nll, jnp.moveaxis(live, 0, 1)


def score_tokens(
    config: ModelConfig,
    params: Params,
    tokens,
    *,
    policy: Policy,
    chunk: int = 1,
    segment: int = 256,
    cache_dtype=None,
    implementation: Implementation = "auto",
    progress: bool = False,
    lengths: Sequence[int] | None = None,
    mesh: jax.sharding.Mesh | None = None,
    rules: ShardingRules = TENSOR_PARALLEL,
    scan_layers: bool = False,
) -> ScoreOutput:
    """Teacher-forced NLL of every token after the first, through the policy's cache.

    Args:
        config: model config.
        params: model parameters.
        tokens: [B, S] or [S] int token ids (S >= 2).
        policy: the cache policy.
        chunk: tokens fed per model call (1 = exact decode semantics).
        segment: tokens per jitted call (a multiple of chunk); one compilation serves all.
        cache_dtype: cache storage dtype (default: the params' dtype).
        implementation: attention implementation.
        progress: show a progress bar.
        lengths: [B] real tokens per row, each in [2, S] (texts of different lengths,
            right-padded); None: every row has S. Padding is never cached or scored.
        mesh: score sharded over this device mesh, as `generate(..., mesh=)` (params and cache
            placed by `rules`, rows split over its batch axis). None: one device.
        rules: how logical axes map onto the mesh's axes (used only with `mesh`).
        scan_layers: run the layers in one `lax.scan` over a stacked cache (compiled once, not
            per layer; `GenerateConfig.scan_layers`); the returned cache is then stacked.

    Raises:
        ValueError: bad shapes, token ids, lengths, or a policy built for another model;
            `scan_layers` with per-layer budgets or a mesh.
    """
    policy = fit_policy(policy, config)
    tokens = np.asarray(tokens)
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(f"tokens must be [S] or [B, S] with S >= 2, got shape {tokens.shape}")
    if tokens.min() < 0 or tokens.max() >= config.vocab_size:
        raise ValueError(
            f"token ids must be in [0, {config.vocab_size}), got min "
            f"{tokens.min()} max {tokens.max()}"
        )
    if segment % chunk:
        raise ValueError(f"segment ({segment}) must be a multiple of chunk ({chunk})")
    if config.max_positions and tokens.shape[1] > config.max_positions:
        raise ValueError(
            f"{tokens.shape[1]} tokens exceed the model's {config.max_positions} learned positions"
        )
    check_window(config, tokens.shape[1])
    b, s = tokens.shape
    lengths = np.full((b,), s, np.int64) if lengths is None else np.asarray(lengths, np.int64)
    if lengths.shape != (b,) or lengths.min() < 2 or lengths.max() > s:
        raise ValueError(
            f"lengths must be {b} numbers in [2, {s}] (one per row of tokens), got {lengths}"
        )
    n = s - 1  # predictions
    n_pad = math.ceil(n / segment) * segment
    inp = np.zeros((b, n_pad), np.int32)
    tgt = np.zeros((b, n_pad), np.int32)
    val = np.zeros((b, n_pad), bool)
    inp[:, :n], tgt[:, :n] = tokens[:, :-1], tokens[:, 1:]
    val[:, :n] = np.arange(n)[None, :] < (lengths[:, None] - 1)
    dtype = cache_dtype or jax.tree_util.tree_leaves(params)[0].dtype
    if scan_layers:
        check_scannable(policy, "score_tokens(scan_layers=True)")
        if mesh is not None:
            raise ValueError("score_tokens(scan_layers=True) does not run on a mesh yet")
        params = stack_params(params, config)  # no copy when already stacked
    cache = new_cache(config, policy, batch=b, max_len=n_pad, dtype=dtype, stacked=scan_layers)
    layout, rows = None, jnp.asarray
    if mesh is not None:
        from kvjax.generate._sharded import layout_for, place_rows

        spec = cache_spec_for(config, policy, batch=b, max_len=n_pad, dtype=dtype)
        layout = layout_for(config, spec, mesh, rules)
        params = shard_params(params, layout)
        cache = place_global(cache, cache_shardings(cache, layout))
        rows = lambda x: place_rows(x, layout)
    nlls, lives = [], []
    bar = range(0, n_pad, segment)
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(bar, desc=f"ppl [{policy.name}]", unit="seg", total=n_pad // segment)
    for start in bar:
        sl = slice(start, start + segment)
        seg = (rows(inp[:, sl]), rows(tgt[:, sl]), rows(val[:, sl]))
        cache, nll, live = _score_segment(
            config, policy, chunk, implementation, layout, params, cache, *seg
        )
        nlls.append(nll)
        lives.append(live)
    nll = jnp.concatenate(nlls, axis=1)[:, :n]
    live = jnp.concatenate(lives, axis=0)[:n]
    return ScoreOutput(nll=nll, live_slots=live, cache=cache)
