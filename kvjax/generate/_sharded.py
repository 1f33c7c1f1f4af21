"""`generate` over a device mesh: the same jitted loop, with params, inputs and cache placed by
a `Layout` and traced under it (so the attention dispatch runs its kernels per device)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from kvjax.cache import CacheSpec
from kvjax.generate._stream import prefill_and_decode
from kvjax.generate._types import GenerateConfig, GenerateOutput
from kvjax.models import ModelConfig, Params
from kvjax.policies import Policy
from kvjax.sharding import (
    Axis,
    Layout,
    Names,
    ShardingRules,
    constrain_cache,
    place_global,
    resolve_layout,
    shard_params,
    use_layout,
)

Array = jax.Array


def layout_for(
    config: ModelConfig, spec: CacheSpec, mesh: jax.sharding.Mesh, rules: ShardingRules
) -> Layout:
    """The layout of `rules` on `mesh` for this model and cache (replication rule and errors:
    `kvjax.sharding.resolve_layout`)."""
    slots = spec.capacities + (spec.int8_capacities or ()) + (spec.lowbit_pages or ())
    return resolve_layout(
        mesh,
        rules,
        batch=spec.batch,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        slot_counts=slots,
    )


def place_rows(x: np.ndarray, layout: Layout) -> Array:
    """A host array with leading batch axis, split over the layout's batch axis. Every process
    passes the whole array (multi-process: each keeps its addressable rows)."""
    names = Names((Axis.BATCH,) + (None,) * (x.ndim - 1))
    sharding = layout.sharding(names)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def generate_sharded(
    config: ModelConfig,
    policy: Policy,
    gen: GenerateConfig,
    spec: CacheSpec,
    mesh: jax.sharding.Mesh,
    rules: ShardingRules,
    params: Params,
    tokens: np.ndarray,
    lengths: np.ndarray,
    seed: int | Sequence[int],
) -> GenerateOutput:
    """`generate`'s jitted core on `mesh` (arguments already validated by `generate`). Every
    process of a multi-controller run calls it with the same arguments."""
    seeds = [seed] if isinstance(seed, int) else list(seed)
    if not isinstance(seed, int) and (
        len(seeds) != spec.batch or not all(isinstance(s, int) for s in seeds)
    ):
        raise ValueError(f"seed must be an int or {spec.batch} ints (one per prompt), got {seed!r}")
    if not all(0 <= s < 2**32 for s in seeds):
        raise ValueError(f"seeds must be in [0, 2**32) on a mesh, got {seed!r}")
    layout = layout_for(config, spec, mesh, rules)
    params = shard_params(params, layout)
    tokens, lengths = place_rows(tokens, layout), place_rows(lengths, layout)
    if isinstance(seed, int):  # the keys are made inside: one, folded with each row's index
        seed = place_global(
            np.asarray(seed, np.uint32), NamedSharding(layout.mesh, PartitionSpec())
        )
    else:  # row i samples with key(seed[i]), as unsharded; the seeds split with the rows
        seed = place_rows(np.asarray(seeds, np.uint32), layout)
    return _generate_on(config, policy, gen, spec, layout, params, tokens, lengths, seed)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _generate_on(
    config: ModelConfig,
    policy: Policy,
    gen: GenerateConfig,
    spec: CacheSpec,
    layout: Layout,
    params: Params,
    tokens: Array,
    lengths: Array,
    seed: Array,
) -> GenerateOutput:
    key = jax.random.key(seed) if seed.ndim == 0 else jax.vmap(jax.random.key)(seed)
    with use_layout(layout):
        cache = constrain_cache(policy.empty_cache(spec))  # allocated sharded, never gathered
        out = prefill_and_decode(config, policy, gen, params, cache, tokens, lengths, key)[0]
    return out
