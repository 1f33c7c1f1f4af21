"""`generate`: chunked prefill then decode, one jit, cache updated in place."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from kvjax.cache import CacheSpec, stack_cache
from kvjax.generate._fit import fit_policy
from kvjax.generate._sampling import row_keys
from kvjax.generate._step import cache_spec_for, check_scannable
from kvjax.generate._stream import prefill_and_decode
from kvjax.generate._types import GenerateConfig, GenerateOutput
from kvjax.generate._validate import check_lengths, check_tokens, check_window, pad_prompts
from kvjax.models import ModelConfig, Params, stack_params
from kvjax.policies import Policy
from kvjax.sharding import TENSOR_PARALLEL, ShardingRules

Array = jax.Array


def generate(
    config: ModelConfig,
    params: Params,
    prompts: Sequence[Sequence[int]],
    *,
    policy: Policy,
    gen: GenerateConfig,
    seed: int | Sequence[int] = 0,
    mesh: jax.sharding.Mesh | None = None,
    rules: ShardingRules = TENSOR_PARALLEL,
) -> GenerateOutput:
    """Generate continuations of a batch of prompts (different lengths allowed).

    Args:
        config: the model's config.
        params: the model's parameters.
        prompts: B lists of token ids, each non-empty.
        policy: the cache policy.
        gen: static generation settings.
        seed: sampling seed (ignored when greedy): one int (row i samples with
            fold_in(key(seed), i)) or one seed per row (row i with key(seed[i])). A row's
            samples depend only on its own key, prompt and the policy, never on the other rows:
            a row generated alone with its key gives the same tokens as in any batch.
        mesh: run sharded over this device mesh (docs/sharding.md): params and cache are placed
            by `rules` and the same loop runs as one SPMD program. None: one device.
        rules: how logical axes map onto the mesh's axes (used only with `mesh`).
    """
    policy = fit_policy(policy, config)  # the layer count comes from the model
    lengths = check_lengths(prompts)
    tokens = pad_prompts(prompts, gen.chunk_size, gen.pad_id)
    check_tokens(tokens, lengths, config.vocab_size)
    max_len = tokens.shape[1] + gen.max_new_tokens
    if config.max_positions and int(lengths.max()) + gen.max_new_tokens > config.max_positions:
        raise ValueError(
            f"prompt + max_new_tokens = {int(lengths.max()) + gen.max_new_tokens} "
            f"exceeds the model's {config.max_positions} learned positions"
        )
    check_window(config, int(lengths.max()) + gen.max_new_tokens)
    for s in gen.stop_tokens:
        if not 0 <= s < config.vocab_size:
            raise ValueError(f"stop token {s} is out of range [0, {config.vocab_size})")
    dtype = gen.cache_dtype or jax.tree_util.tree_leaves(params)[0].dtype
    spec = cache_spec_for(config, policy, batch=len(prompts), max_len=max_len, dtype=dtype)
    if gen.scan_layers:
        check_scannable(policy, "GenerateConfig(scan_layers=True)")
        if mesh is not None:
            raise ValueError("GenerateConfig(scan_layers=True) does not run on a mesh yet")
        params = stack_params(params, config)  # no copy when already stacked
    if mesh is not None:
        from kvjax.generate._sharded import generate_sharded

        args = (params, tokens, lengths, seed)
        return generate_sharded(config, policy, gen, spec, mesh, rules, *args)
    return _generate(
        config,
        policy,
        gen,
        spec,
        params,
        jnp.asarray(tokens),
        jnp.asarray(lengths),
        _row_keys(seed, len(prompts)),
    )


def _row_keys(seed: int | Sequence[int], batch: int) -> Array:
    if isinstance(seed, int):
        return row_keys(jax.random.key(seed), batch)
    seeds = list(seed)
    if len(seeds) != batch or not all(isinstance(s, int) for s in seeds):
        raise ValueError(f"seed must be an int or {batch} ints (one per prompt), got {seed!r}")
    return jnp.stack([jax.random.key(s) for s in seeds])


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
    cache = policy.empty_cache(spec)
    if gen.scan_layers:
        cache = stack_cache(cache)
    return prefill_and_decode(config, policy, gen, params, cache, tokens, lengths, key)[0]
