"""Sharding as data: logical axis names for params and caches, rules that map them onto a
`jax.sharding.Mesh` (`data`, `model`, optional `seq`), and their placement (docs/sharding.md)."""

from kvjax.sharding._axes import PARAM_AXES, Axis, Names, cache_names, layer_names, param_names
from kvjax.sharding._hlo import collectives, large_collectives
from kvjax.sharding._kernels import map_slot_writes, slots_sharded, take_slots
from kvjax.sharding._place import (
    active_layout,
    bytes_per_device,
    cache_shardings,
    constrain_cache,
    param_shardings,
    place_global,
    shard_params,
    use_layout,
)
from kvjax.sharding._rules import (
    CONTEXT_PARALLEL,
    DATA,
    MODEL,
    SEQ,
    TENSOR_PARALLEL,
    Layout,
    ShardingRules,
    auto_mesh,
    make_mesh,
    resolve_layout,
)

__all__ = [
    "CONTEXT_PARALLEL",
    "DATA",
    "MODEL",
    "PARAM_AXES",
    "SEQ",
    "TENSOR_PARALLEL",
    "Axis",
    "Layout",
    "Names",
    "ShardingRules",
    "active_layout",
    "auto_mesh",
    "bytes_per_device",
    "cache_names",
    "cache_shardings",
    "collectives",
    "constrain_cache",
    "large_collectives",
    "layer_names",
    "make_mesh",
    "map_slot_writes",
    "param_names",
    "param_shardings",
    "place_global",
    "resolve_layout",
    "shard_params",
    "slots_sharded",
    "take_slots",
    "use_layout",
]
