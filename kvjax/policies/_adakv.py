"""AdaKV (Feng et al., 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation
for Efficient LLM Inference", arXiv:2407.11550): a layer's budget is shared by its KV heads — the
layer keeps the top scores over all its heads, so a head whose attention is spread out keeps more
tokens than one that attends to a few. A safeguard keeps each head's own top
int(alpha_safeguard × its mean share) tokens first. kvpress: `AdaKVPress(press,
alpha_safeguard=0.20)` over a `ScorerPress`; kvpress *masks* the pruned pairs (the cache keeps
its full size), here the memory is freed.

Layout (`CacheSpec.pooled`, docs/decisions.md): each layer holds ONE pool of Hkv·(N − 1) slots
(N = the wrapped policy's budget per KV head; the current token is attended on top), every slot
carrying the KV head that owns it; attention masks each head's queries to its own slots. A
layer's K/V bytes are therefore its budget, whatever the split between heads.

Each write ranks the pool and the call's tokens (O(P log P) per layer and step: the allocation
across heads is a global top-k, the method's rule) and the new kept tokens fill the slots freed
by evictions (K/V of kept tokens never move). Scores come from the wrapped policy's hooks
(`update_score`, `init_score`, `candidate_scores`, `priority`, `key_scores`); its recent window
and sinks stay protected per head, and a policy frozen in decode (SnapKV) still only admits a
token leaving the window into a free slot.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.policies._base import Policy, cached_tokens
from kvjax.policies._keyscored import KeyScoredPolicy
from kvjax.policies._ranked import RankedPolicy
from kvjax.policies._regions import Tokens

Array = jax.Array
_INF = jnp.inf


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdaKVPolicy(Policy):
    """Head-adaptive budgets: the wrapped policy's per-head budget becomes a per-layer pool.

    Attributes:
        press: the score policy wrapped (a full-precision ranked policy with a fixed budget:
            snapkv, pyramidkv, chunkkv, h2o, tova, knorm, keydiff, kvzip, expected, random).
        alpha_safeguard: share of its mean budget each KV head keeps by its own ranking
            (kvpress: 0.20; 0 = pure top-k over the layer, 1 = per-head budgets).
    """

    name = "adakv"
    press: RankedPolicy
    alpha_safeguard: float = 0.20

    def __post_init__(self) -> None:
        p = self.press
        if not isinstance(p, RankedPolicy):
            raise ValueError(
                f"AdaKVPolicy.press must be a ranked score policy, got {type(p).__name__}"
            )
        overrides = type(p).ranked_budget is not RankedPolicy.ranked_budget
        writes = type(p).write not in (RankedPolicy.write, KeyScoredPolicy.write)
        if p.int8 or overrides or writes or type(p).merge is not RankedPolicy.merge:
            raise ValueError(
                f"AdaKVPolicy wraps full-precision policies with a fixed budget; "
                f"{p.name!r} is tiered, budget-adaptive or writes its own slots"
            )
        if p.position_shift:
            raise ValueError(
                "AdaKVPolicy does not support position_shift: its heads share one pool of "
                f"slots (build {p.name!r} with position_shift=False, or use {p.name!r} itself)"
            )
        if not 0.0 <= self.alpha_safeguard <= 1.0:
            raise ValueError(
                f"AdaKVPolicy.alpha_safeguard must be in [0, 1], got {self.alpha_safeguard}"
            )

    @property
    def budget(self) -> int:
        return self.press.budget

    @property
    def uses_attention_mass(self) -> bool:  # type: ignore[override]
        return self.press.uses_attention_mass

    def max_budget(self, layer_index: int) -> int:
        """Mean tokens attended per KV head in a layer (the pool holds Hkv·(this − 1) slots)."""
        return self.press.max_budget(layer_index)

    def safeguard(self, layer_index: int) -> int:
        """Tokens each KV head keeps by its own ranking before the layer-wide top-k."""
        return int(cached_tokens(self.max_budget(layer_index)) * self.alpha_safeguard)

    def capacity(self, max_len: int) -> int:
        del max_len
        return cached_tokens(self.max_budget(0))

    def capacities(self, num_layers: int, max_len: int) -> tuple[int, ...]:
        del max_len
        return tuple(cached_tokens(self.max_budget(i)) for i in range(num_layers))

    def cache_spec(self, *, batch, num_layers, num_kv_heads, head_dim, max_len, dtype):
        spec = super().cache_spec(
            batch=batch, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
            max_len=max_len, dtype=dtype,
        )  # fmt: skip
        return dataclasses.replace(spec, pooled=True)

    def init_state(self, batch: int) -> Any:
        return self.press.init_state(batch)

    def query_weight(self, pos_new: Array, valid: Array) -> Array | None:
        return self.press.query_weight(pos_new, valid)

    def begin_step(self, state: Any, logits: Array, valid: Array) -> Any:
        return self.press.begin_step(state, logits, valid)

    def write(self, layer, k_new, v_new, pos_new, valid, stats, state, *, layer_index):
        if layer.head is None:
            raise ValueError("AdaKVPolicy writes pooled caches (build it with its cache_spec)")
        p, li = self.press, layer_index
        b, t, h, _ = k_new.shape
        size = layer.capacity
        decode = t == 1
        last = jnp.max(jnp.where(valid, pos_new, -1), axis=1)  # [B]
        cur3 = last[:, None, None]
        pos_t = jnp.where(valid, pos_new, -1)  # [B, T]
        score, new_mass = layer.score[:, 0], stats.new_mass  # [B, P], [B, H, T]
        if isinstance(p, KeyScoredPolicy):
            view = layer.replace(
                k=jnp.broadcast_to(layer.k, (b, h, *layer.k.shape[2:])),
                pos=jnp.where(_mine(layer.head[:, 0], h), layer.pos, -1),
                head=None,
            )
            slot, new_mass = p.key_scores(view, k_new, pos_new, valid)
            if slot is not None:
                score = _own(slot, layer.head[:, 0])
        elif not (decode and p.frozen_in_decode):
            score = p.update_score(layer.score, stats.slot_mass, layer.pos, cur3, state, li)[:, 0]
        new_score = p.init_score(new_mass.astype(jnp.float32), pos_t[:, None, :], state, li)
        # Candidates: the pool's P slots, then this call's tokens head-major (H·T).
        c_pos = jnp.concatenate(
            [layer.pos[:, 0], jnp.broadcast_to(pos_t[:, None, :], (b, h, t)).reshape(b, h * t)], -1
        )
        heads_new = jnp.broadcast_to(jnp.repeat(jnp.arange(h, dtype=jnp.int32), t), (b, h * t))
        c_head = jnp.concatenate([layer.head[:, 0], heads_new], -1)
        raw = jnp.concatenate([score, new_score.reshape(b, h * t)], -1).astype(jnp.float32)
        occupied = c_pos >= 0
        ring = occupied & (c_pos > last[:, None] - p.ring)
        c_score = raw
        if not decode:  # the merge hook (SnapKV pools votes) sees each head's candidates
            mine = _mine(c_head, h)
            n = c_pos.shape[-1]
            view = Tokens(
                k=jnp.zeros((b, h, n, 0), jnp.float32),
                v=jnp.zeros((b, h, n, 0), jnp.float32),
                pos=jnp.where(mine, c_pos[:, None], -1),
                score=jnp.where(mine, raw[:, None], 0.0),
            )
            c_score = jnp.where(ring, raw, _own(p.candidate_scores(view), c_head))
        prio = p.priority(c_score[:, None], c_pos[:, None], cur3, li)[:, 0]
        if decode and p.frozen_in_decode:  # the token leaving the window: a free slot only
            prio = jnp.where(c_pos == last[:, None] - p.ring, -_INF, prio)
        protected = ring | (occupied & (c_pos < p.sinks))
        prio = jnp.where(occupied, jnp.where(protected, _INF, prio), -_INF)
        keep = adakv_keep(prio, c_head, protected, occupied, h, self.safeguard(li), size)
        return _place(layer, keep, c_pos, c_head, c_score, k_new, v_new)


def adakv_keep(
    prio: Array,
    head: Array,
    protected: Array,
    occupied: Array,
    heads: int,
    n_safe: int,
    size: int,
) -> Array:
    """AdaKV's allocation: [B, N] bool, the candidates a layer keeps in its `size` slots.

    Every protected candidate is kept, then each head's own top `n_safe` (by priority, ties to
    the lower index; a -inf priority is never safeguarded), then the highest priorities left over
    all heads fill the remaining slots (ties to the lower index).

    Args:
        prio: [B, N] float32 priorities (+inf protected, -inf empty).
        head: [B, N] int32 KV head of each candidate.
        protected, occupied: [B, N] bool.
    """
    v_prio = jnp.where(_mine(head, heads), prio[:, None], -_INF)  # [B, H, N]
    rank = jnp.argsort(jnp.argsort(-v_prio, axis=-1, stable=True), axis=-1)
    safe = occupied & (protected | ((_own(rank, head) < n_safe) & (prio > -_INF)))
    room = size - jnp.sum(safe, axis=-1, keepdims=True)  # [B, 1]
    eligible = occupied & ~safe
    order = jnp.lexsort((-prio, ~eligible), axis=-1)
    grank = jnp.argsort(order, axis=-1)
    return safe | (eligible & (grank < room))


def _mine(head: Array, heads: int) -> Array:
    """[B, H, N] bool: candidate n belongs to head h."""
    return head[:, None, :] == jnp.arange(heads, dtype=jnp.int32)[None, :, None]


def _own(x: Array, head: Array) -> Array:
    """[B, H, N] per-head values → [B, N], each candidate's value at its own head."""
    return jnp.take_along_axis(x, head[:, None, :], axis=1)[:, 0]


def _place(layer, keep, c_pos, c_head, c_score, k_new, v_new):
    """The pool with its evicted slots emptied and the kept new tokens written into free slots
    (the first free slots, in candidate order); kept old tokens stay where they are."""
    b, t, h, d = k_new.shape
    size = layer.capacity
    keep_old, keep_new = keep[:, :size], keep[:, size:]
    free_first = jnp.argsort(keep_old, axis=-1, stable=True)  # free slots first, in order
    rank = jnp.cumsum(keep_new, axis=-1, dtype=jnp.int32) - 1
    target = jnp.take_along_axis(free_first, jnp.clip(rank, 0, size - 1), axis=-1)
    target = jnp.where(keep_new, target, size)  # [B, H·T]; size = dropped
    bi = jnp.arange(b)[:, None]
    flat = lambda x: jnp.swapaxes(x, 1, 2).reshape(b, h * t, d).astype(layer.k.dtype)
    pos = jnp.where(keep_old, layer.pos[:, 0], -1)
    score = jnp.where(keep_old, c_score[:, :size], 0.0)
    new_pos, new_head, new_score = c_pos[:, size:], c_head[:, size:], c_score[:, size:]
    return layer.replace(
        k=layer.k.at[bi, 0, target].set(flat(k_new), mode="drop"),
        v=layer.v.at[bi, 0, target].set(flat(v_new), mode="drop"),
        pos=pos.at[bi, target].set(new_pos, mode="drop")[:, None],
        score=score.at[bi, target].set(new_score, mode="drop")[:, None],
        head=layer.head[:, 0].at[bi, target].set(new_head, mode="drop")[:, None],
    )
