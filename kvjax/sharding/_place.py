"""Placing params and caches on a mesh, constraining them inside jit, and the active layout.

The layout in force while a function is traced (`use_layout`) tells the attention dispatch to run
the Pallas kernels under `shard_map` and the step to keep the cache's shardings; outside it every
function traces exactly as without a mesh. A traced function keys its compilation on the layout
only through its static arguments, so pass the `Layout` as one (as `generate` does).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from kvjax.cache import Cache
from kvjax.sharding._axes import Names, cache_names, param_names
from kvjax.sharding._rules import Layout

_ACTIVE: contextvars.ContextVar[Layout | None] = contextvars.ContextVar("layout", default=None)


@contextlib.contextmanager
def use_layout(layout: Layout | None) -> Iterator[None]:
    """Trace the enclosed code for `layout` (None: unsharded, the default)."""
    token = _ACTIVE.set(layout)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_layout() -> Layout | None:
    """The layout the code being traced is sharded by, or None."""
    return _ACTIVE.get()


def _shardings(names: Any, layout: Layout) -> Any:
    return jax.tree.map(layout.sharding, names, is_leaf=lambda x: isinstance(x, Names))


def param_shardings(params: Any, layout: Layout) -> Any:
    """A tree of NamedSharding mirroring `params`."""
    return _shardings(param_names(params), layout)


def cache_shardings(cache: Cache, layout: Layout) -> Any:
    """A tree of NamedSharding mirroring `cache` (works on abstract caches too)."""
    return _shardings(cache_names(cache), layout)


def shard_params(params: Any, layout: Layout) -> Any:
    """`params` placed on the layout's mesh (a no-op for arrays already placed so). With several
    processes every process passes the same full params and keeps its devices' shards."""
    return place_global(params, param_shardings(params, layout))


def place_global(tree: Any, shardings: Any) -> Any:
    """`tree` on `shardings`: `device_put` in one process; with several (multi-controller),
    each process builds its addressable shards from its own full host copy."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def build(x, sharding):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    return jax.tree.map(build, tree, shardings)


def constrain_cache(cache: Cache, layout: Layout | None = None) -> Cache:
    """Inside jit: pin every cache array to its layout sharding (identity without a layout).

    The policies' scatters and selects would otherwise leave XLA free to pick another sharding
    for the cache carried through the decode loop, and to move cache-sized data to get there.
    """
    layout = layout or active_layout()
    if layout is None:
        return cache
    return jax.lax.with_sharding_constraint(cache, cache_shardings(cache, layout))


def bytes_per_device(tree: Any) -> dict[int, int]:
    """Device id → bytes of `tree`'s arrays held on that device (host side, exact)."""
    held: dict[int, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            nbytes = int(np.prod(shard.data.shape)) * leaf.dtype.itemsize
            held[shard.device.id] = held.get(shard.device.id, 0) + nbytes
    return held
