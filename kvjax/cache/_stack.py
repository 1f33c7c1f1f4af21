"""A stacked cache: every layer's buffers along one leading layer axis, for a layer loop.

`Cache.layers` is either a tuple of LayerCache (one per layer, the unrolled step) or one
LayerCache whose every array has a leading [L] axis (a *stacked* cache). A model step over a
stacked cache runs its layers' forward in a `lax.scan` and their writes as one `jax.vmap` over
the stack (`kvjax.generate.write_stacked`; QEvict's as one routing cond and one move loop
for all layers), in place (`tests/policies/test_in_place.py`), and compiles its layer
once, not L times.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from kvjax.cache._state import Cache, LayerCache

Array = jax.Array


def is_stacked(cache: Cache) -> bool:
    """Whether `cache.layers` is one LayerCache with a leading layer axis."""
    return isinstance(cache.layers, LayerCache)


def num_layers(cache: Cache) -> int:
    """L, for a stacked or a per-layer cache."""
    if is_stacked(cache):
        return cache.layers.pos.shape[0]
    return len(cache.layers)


def stack_trees(trees: Any, what: str) -> Any:
    """Pytrees of equal structure and shapes stacked leaf by leaf along a new leading axis.

    Raises:
        ValueError: the trees differ in structure, shape or dtype (e.g. per-layer capacities).
    """
    trees = tuple(trees)
    first = jax.tree.structure(trees[0])
    shapes = [jax.tree.map(lambda a: (a.shape, a.dtype), t) for t in trees]
    for i, (t, s) in enumerate(zip(trees, shapes, strict=True)):
        if jax.tree.structure(t) != first or s != shapes[0]:
            raise ValueError(
                f"cannot stack {what}: layer {i} differs from layer 0 in structure or shape "
                "(per-layer capacities or budgets); a layer scan needs layers of one shape"
            )
    return jax.tree.map(lambda *a: jax.numpy.stack(a), *trees)


def stack_cache(cache: Cache) -> Cache:
    """The cache with its layers stacked along a leading [L] axis (a copy: call it once, when
    the cache is made, never per step).

    Raises:
        ValueError: the layers differ in shape (per-layer capacities).
    """
    if is_stacked(cache):
        return cache
    return cache.replace(layers=stack_trees(cache.layers, "the cache's layers"))


def unstack_cache(cache: Cache) -> Cache:
    """The per-layer (tuple) form of a stacked cache."""
    if not is_stacked(cache):
        return cache
    n = num_layers(cache)
    layers = tuple(jax.tree.map(lambda a, i=i: a[i], cache.layers) for i in range(n))
    return cache.replace(layers=layers)


def layer_at(stacked: Any, i: Array) -> Any:
    """Layer i (a traced int32 scalar) of a stacked pytree."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), stacked)


class Extents(NamedTuple):
    """One past the last occupied slot (page, for the low-bit tier) of each tier: [B, Hkv]
    int32 for one layer, [L, B, Hkv] for a stack; None where the layer has no such tier."""

    full: Array
    int8: Array | None
    lowbit: Array | None


def _last_plus_one(occupied: Array) -> Array:
    """[..., N] bool -> [...] int32 one past the last True (0 if none)."""
    idx = jnp.arange(1, occupied.shape[-1] + 1, dtype=jnp.int32)
    return jnp.max(jnp.where(occupied, idx, 0), axis=-1)


def tier_extents(layer: LayerCache) -> Extents:
    """The extents of a layer's tiers (or, over a stacked LayerCache, of every layer's: one
    reduction per tier for the whole stack instead of one per layer in the scan)."""
    int8 = layer.int8
    lowbit = layer.lowbit
    return Extents(
        full=_last_plus_one(layer.pos >= 0),
        int8=None if int8 is None else _last_plus_one(int8.pos >= 0),
        lowbit=None if lowbit is None else _last_plus_one(jnp.any(lowbit.pos >= 0, axis=-1)),
    )


class StackedLayer(NamedTuple):
    """Layer `index` of a stacked LayerCache, not sliced out: what a layer scan hands attention,
    so that kernels which take the stack (the GPU decode kernels of every tier but a pooled
    one, `layer=`) read the layer in place; everything else reads `get()`, a slice (which XLA
    fuses into its readers, but must copy for a kernel's operand).

    Attributes:
        stack: the stacked LayerCache (leading [L] axis on every array).
        index: int32 scalar, the layer.
        extents: None, or the layer's `Extents` ([B, Hkv] each), computed for every layer
            before the scan (`tier_extents` of the stack), so the step reduces each tier's
            positions once for all layers rather than once per layer.
    """

    stack: LayerCache
    index: Array
    extents: Extents | None = None

    def get(self) -> LayerCache:
        """The layer sliced out of the stack."""
        return layer_at(self.stack, self.index)
