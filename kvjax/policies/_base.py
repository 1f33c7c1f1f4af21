"""The policy contract. A policy is a frozen keyword-only dataclass of hyperparameters with pure
methods; the generate loop calls them inside one jit.

Per step: the model reads the cache and returns each layer's new K/V and attention mass; then
`begin_step` sees the step's logits (budget decisions), and `write` updates each layer's slots.

Budgets: a budget of N means N tokens attended at every decode step, the current token included
(StreamingLLM's cache size, Mistral's `sliding_window`). The current token is attended from the
step's own K/V, on top of the cache, so a budgeted policy caches at most `cached_tokens(N)` =
N - 1 tokens; live bytes (`kvjax.cache.attended_slots_per_layer`) count the cache plus the
current token, i.e. what a step attends.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from kvjax.attention import AttnStats, KeyShift
from kvjax.cache import Cache, CacheSpec, LayerCache, init_cache, write_slots
from kvjax.policies._cache_positions import cache_position_shift

Array = jax.Array


def cached_tokens(budget: int) -> int:
    """Tokens a policy with a budget of `budget` attended tokens per step may keep cached: the
    current token is attended on top of the cache (from this step's own K/V)."""
    return budget - 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class Policy(abc.ABC):
    """Base of every cache policy. Subclasses set `name` and implement `capacity` and `write`."""

    name: ClassVar[str]
    # Whether `write` reads the attention mass in AttnStats of a one-token (decode) write.
    # False lets the Pallas decode path skip the per-slot logits (the stats then hold zeros);
    # multi-token (prefill) calls always carry the real mass.
    uses_attention_mass: ClassVar[bool] = True

    @abc.abstractmethod
    def capacity(self, max_len: int) -> int:
        """Slots per KV head needed for sequences of at most `max_len` tokens."""

    def capacities(self, num_layers: int, max_len: int) -> tuple[int, ...]:
        """Slots per KV head for each layer (pyramidal policies override)."""
        return (self.capacity(max_len),) * num_layers

    def int8_capacities(self, num_layers: int, max_len: int) -> tuple[int, ...] | None:
        """INT8-tier slots per KV head for each layer (None: the policy keeps no INT8 tier)."""
        del num_layers, max_len
        return None

    def cache_spec(
        self,
        *,
        batch: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: Any,
    ) -> CacheSpec:
        """The cache this policy needs for `batch` sequences of at most `max_len` tokens."""
        return CacheSpec(
            batch=batch,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            capacities=self.capacities(num_layers, max_len),
            dtype=dtype,
            int8_capacities=self.int8_capacities(num_layers, max_len),
        )

    def live_bytes_bound(self, spec: CacheSpec) -> int | None:
        """Most live K/V bytes the cache can hold, when the policy enforces a tighter bound than
        "every slot occupied" (a byte budget); None otherwise."""
        del spec
        return None

    def init_layer_aux(self, spec: CacheSpec) -> tuple[Any, ...] | None:
        """Per-layer policy state (LayerCache.aux), one pytree per layer; None if not needed."""
        del spec
        return None

    def empty_cache(self, spec: CacheSpec) -> Cache:
        """An empty cache of `spec` with this policy's initial state."""
        return init_cache(spec, self.init_state(spec.batch), self.init_layer_aux(spec))

    def init_state(self, batch: int) -> Any:
        """Policy-wide state carried in the cache (None if the policy needs none)."""
        del batch
        return None

    def current_budget(self, state: Any, batch: int) -> Array:
        """[B] int32 token budget in force (telemetry); -1 for policies with a fixed budget."""
        del state
        return jnp.full((batch,), -1, jnp.int32)

    def query_weight(self, pos_new: Array, valid: Array) -> Array | None:
        """[B, T] weight of each query of this call in the attention mass the policy sees
        (None: every valid query counts once)."""
        del pos_new, valid
        return None

    def begin_step(self, state: Any, logits: Array, valid: Array) -> Any:
        """Update policy-wide state from this step's next-token logits [B, V] (valid: [B])."""
        del logits, valid
        return state

    @abc.abstractmethod
    def write(
        self,
        layer: LayerCache,
        k_new: Array,
        v_new: Array,
        pos_new: Array,
        valid: Array,
        stats: AttnStats,
        state: Any,
        *,
        layer_index: int,
    ) -> LayerCache:
        """Insert this call's tokens (evicting as needed) and update slot scores.

        Args:
            layer: the layer's cache before this call.
            k_new: [B, T, Hkv, D] new keys after RoPE.
            v_new: [B, T, Hkv, D] new values.
            pos_new: [B, T] int32 positions of the new tokens.
            valid: [B, T] bool, real token (padding and finished sequences are never written).
            stats: attention mass of this call's queries on the old slots and new tokens.
            state: the policy-wide state after `begin_step`.
            layer_index: which layer (for per-layer budgets).
        """

    def repositions_keys(self) -> bool:
        """Whether `model_step` calls `reposition_keys` after every write (a policy that moves
        cached keys to other RoPE positions, e.g. StreamingLLM's positions within the cache)."""
        return False

    def reposition_keys(
        self, layer: LayerCache, next_pos: Array, rotate: Callable[[Array, Array], Array]
    ) -> LayerCache:
        """Rewrite cached keys before the next call's attention reads them.

        Called by `model_step` after `write`, only when `repositions_keys()`, so a policy that
        never moves keys needs no model knowledge. Policies see no model: `rotate` is the
        model's RoPE, given by the caller.

        Args:
            layer: the layer's cache after this call's write.
            next_pos: [B] int32 position of the next call's first query (the tokens consumed).
            rotate: `rotate(x, by)` turns keys x [B, T, Hkv, D] by `by` [B, T] int32 positions
                (a rotation, so rotate(rotate(x, a), b) = rotate(x, a + b)), in x's dtype.
        """
        del next_pos, rotate
        return layer

    def shifts_key_positions(self) -> bool:
        """Whether attention turns the cached keys to other RoPE positions (`key_shift`) for
        every call's queries, leaving the cache as it is (the ranked policies and QEvict with
        `position_shift`)."""
        return False

    def key_shift(self, layer: LayerCache, first_pos: Array) -> KeyShift:
        """Positions by which attention turns each cached key for this call's queries.

        Called by `model_step` before the forward, only when `shifts_key_positions()`; the
        model turns the keys with its own RoPE inside attention, from the cached keys as they
        are (no rounding accumulates, the cache is not written). Default: positions within
        the cache (`kvjax.policies._cache_positions.cache_position_shift`): the key of rank r
        among the n cached tokens at position r, the query at n.

        Args:
            layer: the layer's cache before this call's write.
            first_pos: [B] int32 position of this call's first query.
        """
        return cache_position_shift(layer, first_pos)

    def scans_layers(self) -> bool:
        """Whether every layer is written by the same function, `layer_index` only indexing
        arrays (never a Python branch or a static size), so a layer scan may pass it as a
        traced int32 (`kvjax.cache.stack_cache`). Per-layer budgets override this to False."""
        return True

    def write_stack(
        self,
        layers: LayerCache,
        k_new: Array,
        v_new: Array,
        pos_new: Array,
        valid: Array,
        stats: AttnStats,
        state: Any,
    ) -> LayerCache:
        """`write` into every layer of a stacked LayerCache (every array with a leading [L]
        axis; k_new, v_new, stats too), with `layer_index` a traced int32.

        By default one `jax.vmap` of `write` over the stack: each scatter writes the stacked
        buffer itself, with L as a batching dimension (a layer scan would slice each layer out
        and back, a layer-sized copy each way). A policy whose write runs loops overrides this
        so that the loops run once for all layers (QEvict); the result must equal `write`
        layer by layer.
        """
        n = layers.pos.shape[0]

        def one(layer, i, k, v, st):
            return self.write(layer, k, v, pos_new, valid, st, state, layer_index=i)

        return jax.vmap(one)(layers, jnp.arange(n, dtype=jnp.int32), k_new, v_new, stats)

    def write_layers(
        self,
        layers: Sequence[LayerCache],
        k_new: Sequence[Array],
        v_new: Sequence[Array],
        pos_new: Array,
        valid: Array,
        stats: Sequence[AttnStats],
        state: Any,
    ) -> tuple[LayerCache, ...]:
        """`write` into every layer (k_new, v_new, stats: one per layer, as in `write`).

        A policy overrides this where one computation for all layers is cheaper than one per
        layer (QEvict runs its data-movement loops once per step); the result must equal
        `write` layer by layer.
        """
        return tuple(
            self.write(layer, k, v, pos_new, valid, st, state, layer_index=i)
            for i, (layer, k, v, st) in enumerate(zip(layers, k_new, v_new, stats, strict=True))
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class PositionalPolicy(Policy):
    """A policy whose slot for a token depends only on its position (full, window, sinks)."""

    uses_attention_mass: ClassVar[bool] = False

    @abc.abstractmethod
    def slot_of(self, pos: Array, capacity: int) -> Array:
        """Slot index for positions `pos` (int32 array of any shape)."""

    def survives(self, pos: Array, last_pos: Array, capacity: int) -> Array:
        """Whether a token at `pos` is still cached once `last_pos` has been written."""
        del last_pos, capacity
        return jnp.ones(pos.shape, bool)

    def write(self, layer, k_new, v_new, pos_new, valid, stats, state, *, layer_index):
        del stats, state, layer_index
        c = layer.capacity
        last = jnp.max(jnp.where(valid, pos_new, -1), axis=1, keepdims=True)  # [B, 1]
        # Tokens overwritten later in the same chunk are dropped (a scatter with duplicate
        # indices has no defined order).
        keep = valid & self.survives(pos_new, last, c)
        slots = jnp.where(keep, self.slot_of(pos_new, c), c)  # [B, T]
        slots = jnp.broadcast_to(slots[:, :, None], (*slots.shape, k_new.shape[2]))
        return write_slots(layer, k_new, v_new, pos_new, slots)
