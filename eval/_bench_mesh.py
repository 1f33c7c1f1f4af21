"""The sharded decode step of `kvjax bench decode --mesh`: the same model step as the unsharded
bench, traced under a mesh layout, and what its compiled HLO communicates per step."""

from __future__ import annotations

import collections
import functools
import re

import jax
import numpy as np

from kvjax.cache import Cache, layer_slot_bytes
from kvjax.eval._bench import greedy_steps
from kvjax.models import ModelConfig, Params
from kvjax.policies import Policy
from kvjax.sharding import (
    TENSOR_PARALLEL,
    Axis,
    Layout,
    Names,
    ShardingRules,
    bytes_per_device,
    cache_shardings,
    collectives,
    constrain_cache,
    resolve_layout,
    shard_params,
    use_layout,
)


def parse_mesh(text: str) -> dict[str, int]:
    """ "data=1,model=1" → {"data": 1, "model": 1}.

    Raises:
        ValueError: not comma-separated name=size pairs with sizes >= 1.
    """
    axes = {}
    for part in text.split(","):
        m = re.fullmatch(r"\s*([a-z_]+)\s*=\s*(\d+)\s*", part)
        if not m or int(m.group(2)) < 1 or m.group(1) in axes:
            raise ValueError(f"--mesh must be name=size pairs like data=1,model=1, got {text!r}")
        axes[m.group(1)] = int(m.group(2))
    return axes


def decode_layout(
    config: ModelConfig, cache: Cache, mesh: jax.sharding.Mesh, rules: ShardingRules
) -> Layout:
    """The layout of a bench cache (its slot counts checked against a `seq` rule)."""
    slots = []
    for layer in cache.layers:
        slots.append(layer.capacity)
        slots += [layer.int8.capacity] if layer.int8 is not None else []
        slots += [layer.lowbit.pos.shape[2]] if layer.lowbit is not None else []
    return resolve_layout(
        mesh,
        rules,
        batch=cache.length.shape[0],
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        slot_counts=tuple(slots),
    )


def place(layout: Layout, params: Params, cache: Cache) -> tuple[Params, Cache]:
    """Params and cache on the layout's mesh."""
    return shard_params(params, layout), jax.device_put(cache, cache_shardings(cache, layout))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4), donate_argnums=(6,))
def sharded_decode(
    config: ModelConfig,
    policy: Policy,
    steps: int,
    impl: str,
    layout: Layout,
    params: Params,
    cache: Cache,
    tok: jax.Array,
):
    """`steps` greedy decode steps (the unsharded bench's loop, `greedy_steps`), traced under
    `layout`; the outputs keep the inputs' shardings, so feeding them back reuses this
    executable."""
    with use_layout(layout):
        cache, tok = greedy_steps(config, policy, steps, impl, params, constrain_cache(cache), tok)
        rows = layout.sharding(Names((Axis.BATCH,)))
        return constrain_cache(cache), jax.lax.with_sharding_constraint(tok, rows)


def collective_counts(hlo_text: str) -> dict[str, int]:
    """Opcode → number of collective instructions in compiled HLO (a one-step loop: per step)."""
    return dict(collections.Counter(op for op, _, _ in collectives(hlo_text)))


def sharded_step(config, policy, steps, impl, mesh, params, cache, tok):
    """The bench's decode loop on `mesh`: (step function, placed params, cache and token, the
    DecodeBench fields of a mesh run). The step's first call compiles, as the unsharded bench's
    does; the collectives come from one more compilation of the same loop, read as HLO text."""
    layout = decode_layout(config, cache, mesh, TENSOR_PARALLEL)
    params, cache = place(layout, params, cache)
    tok = jax.device_put(tok, layout.sharding(Names((Axis.BATCH,))))
    hlo = sharded_decode.lower(config, policy, steps, impl, layout, params, cache, tok)
    fields = dict(
        mesh=",".join(f"{k}={v}" for k, v in mesh.shape.items()),
        live_kv_bytes_per_device=live_bytes_per_device(cache),
        physical_kv_bytes_per_device=physical_bytes_per_device(cache),
        collectives_per_step=collective_counts(hlo.compile().as_text()),
    )
    step = lambda s: sharded_decode(config, policy, steps, impl, layout, params, *s)
    return step, params, cache, tok, fields


def physical_bytes_per_device(cache: Cache) -> list[int]:
    """Bytes of the cache tiers on each device of the placed cache (device order)."""
    held = bytes_per_device(cache.layers)
    return [held[k] for k in sorted(held)]


def live_bytes_per_device(cache: Cache) -> list[int]:
    """Live K/V bytes (occupied slots and held pages, with their scales) on each device of
    the placed cache (device order), counted from each device's own shards."""
    held: dict[int, int] = collections.Counter()

    def count(flags, unit_bytes: int) -> None:
        for shard in flags.addressable_shards:
            held[shard.device.id] += int(np.count_nonzero(np.asarray(shard.data))) * unit_bytes

    for layer in cache.layers:
        count(layer.pos >= 0, layer_slot_bytes(layer)[0])
        if layer.int8 is not None:
            count(layer.int8.pos >= 0, layer.int8.slot_bytes())
        if layer.lowbit is not None:
            count(layer.lowbit.held, layer.lowbit.page_bytes())
    return [held[k] for k in sorted(held)]
