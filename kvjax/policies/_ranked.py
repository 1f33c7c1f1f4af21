"""Ranked policies: a ring of the most recent tokens (never evicted) plus a *ranked region* that
keeps the highest-priority older tokens, optionally stored in INT8.

A token enters the ring; when it leaves the ring it competes for the ranked region by priority
(the policy's `priority` of its score); the loser is evicted for good. A merge (prefill) leaves
the ranked region a dense prefix ordered by position; a decode eviction empties slots in place
(holes, pos -1, which the next insertions fill first).

Two code paths, checked against each other in tests:
* decode (one token): O(C) scalar work and O(1) slot writes — the leaving ring token replaces the
  lowest-priority ranked token (or fills the first free slot); a budget that shrank (a
  state-dependent budget, CONF-KV's) is enforced by emptying the lowest-priority slots, once
  per step for all layers (a `lax.cond`, or over a stacked cache a loop of at most one trip)
  on positions and statistics only, the sort run only on the steps that need it; a fixed
  budget is never exceeded, so its step has no eviction at all;
* merge (prefill chunks): all candidates (ring, ranked, new) are ranked and the region rebuilt.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.policies._base import Policy, cached_tokens
from kvjax.policies._regions import (
    SlotWrites,
    Tokens,
    fp_slice,
    int8_from_tokens,
    int8_tokens,
    replace_fp_range,
    scatter_fp,
    scatter_fused,
)
from kvjax.sharding import slots_sharded, take_slots

Array = jax.Array
_INF = jnp.inf
WRITE_KERNELS = ("auto", "xla", "pallas")


def check_write_kernel(owner: str, write_kernel: str) -> None:
    """One ValueError naming `owner` unless `write_kernel` is one of WRITE_KERNELS."""
    if write_kernel not in WRITE_KERNELS:
        raise ValueError(
            f"{owner}: write_kernel must be one of {WRITE_KERNELS}, got {write_kernel!r}"
        )


def apply_slot_writes(plans, write_kernel: str) -> tuple:
    """The layers of `plans` ((layer, SlotWrites) pairs) with their slot writes done: one kernel
    launch for all of them (`write_kernel` "pallas", or "auto" on GPU) or XLA scatters per
    layer."""
    if resolve_write_kernel(write_kernel, jax.default_backend()) == "pallas":
        return tuple(scatter_fused(plans))
    if slots_sharded():  # context-parallel: each device scatters into its own slots
        return tuple(scatter_fused(plans, kernel="xla"))
    return tuple(writes.apply(layer) for layer, writes in plans)


def resolve_write_kernel(name: str, backend: str) -> str:
    """The slot-write path a `write_kernel` setting takes on `backend`: "auto" is the one-launch
    Pallas kernel on GPU (measured faster there, docs/benchmarks.md) and XLA's scatters
    elsewhere (TPU has no such kernel; on CPU the interpreter would only be slower)."""
    if name == "auto":
        return "pallas" if backend == "gpu" else "xla"
    return name


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankedPolicy(Policy):
    """Base of score-ranked policies. Subclasses define the scores; the engine does the rest.

    Subclasses provide `ring` (recent tokens kept in full precision, >= 1), `sinks` (first
    tokens never evicted), `int8` (ranked region stored INT8), `max_budget(layer)` and optionally a
    dynamic `ranked_budget`.

    A budget N counts the tokens attended per step, the current one included: the cache holds
    the ring's W tokens before the current one and a ranked region of N - 1 - W.

    Positions (`position_shift`, every ranked policy). By default every key is attended at the
    RoPE position it was cached at, so past the model's trained context a kept old token sits
    at a distance the model never saw. With `position_shift=True` attention sees each key at
    its position within the cache, StreamingLLM's rule (§3.2) applied to the kept set: the key
    of rank r (by original position) among the n tokens cached for a (sequence, KV head) is
    attended at position r, the query at n, so every distance n − r is at most the cache size.
    Attention turns each cached key by RoPE from the key as cached, every call
    (`kvjax.policies._cache_positions`; the cache is never rewritten, nothing accumulates,
    values never change), so scores, priorities and evictions see the attention the model
    actually computes. Exact for one token per call (decode, `score_tokens` with `chunk=1`,
    `kvjax stream`). In a multi-token call the cached keys are ranked once, before the call,
    and the call's token i sits at n + i: exactly the rule for the set those queries attend
    (the cache before the call plus the call's earlier tokens), which is the policy's own
    approximation of chunked prefill (no eviction inside a call). Needs a RoPE model; the
    Pallas decode path reads a turned copy of each layer's full-precision keys, and a layer
    with an INT8 tier (`int8`) takes the XLA attention.
    """

    @property
    @abc.abstractmethod
    def ring(self) -> int:
        """W: most recent tokens, kept in full precision and never evicted."""

    # "pallas": a decode step's slot writes (the token leaving the ring into the ranked region,
    # the new token into the ring) run as one kernel instead of one XLA scatter per array;
    # "auto" (default): "pallas" on GPU, "xla" elsewhere (`resolve_write_kernel`).
    write_kernel: str = "auto"
    # Positions within the cache (class docstring): the key of rank r among the n cached
    # tokens is attended at position r and the query at n (default False: original positions).
    position_shift: bool = False

    # Decode keeps the ranked region as prefill left it: scores stop changing and a token leaving
    # the ring only enters the ranked region if there is a free slot (SnapKV).
    frozen_in_decode = False

    @property
    def sinks(self) -> int:
        return 0

    @property
    def int8(self) -> bool:
        return False

    def max_budget(self, layer_index: int) -> int:
        """Largest total token budget (attended per step: the current token and the ring
        included) of a layer (default: the `budget` field)."""
        del layer_index
        return self.budget

    def ranked_budget(self, state: Any, layer_index: int, batch: int) -> Array:
        """[B] int32 slots of the ranked region allowed now (default: all of them)."""
        del state
        return jnp.full((batch,), self._ranked_slots(layer_index), jnp.int32)

    def _ranked_slots(self, layer_index: int) -> int:
        """Slots of a layer's ranked region: its budget less the current token and the ring."""
        return cached_tokens(self.max_budget(layer_index)) - self.ring

    # --- scores (override) -------------------------------------------------------------------
    def update_score(
        self, score: Array, mass: Array, pos: Array, cur: Array, state: Any, layer_index: int
    ) -> Array:
        """New scores of cached tokens given this call's attention mass (default: accumulate)."""
        del pos, cur, state, layer_index
        return score + mass

    def init_score(self, mass: Array, pos: Array, state: Any, layer_index: int) -> Array:
        """Scores of new tokens [B, H, T] from the mass they received in this call."""
        del pos, state, layer_index
        return mass

    def priority(self, score: Array, pos: Array, cur: Array, layer_index: int) -> Array:
        """Keep-priority (higher = keep) at current position cur (broadcast [B, 1, 1])."""
        del pos, cur, layer_index
        return score

    def candidate_scores(self, cands: Tokens) -> Array:
        """Hook for the merge path: final scores of all candidates (SnapKV pools here)."""
        return cands.score

    # --- cache layout ------------------------------------------------------------------------
    def _check(self) -> None:
        check_write_kernel(type(self).__name__, self.write_kernel)
        if not isinstance(self.position_shift, bool):
            raise ValueError(
                f"{type(self).__name__}.position_shift must be True or False, "
                f"got {self.position_shift!r}"
            )
        if self.ring < 1:
            raise ValueError(f"{type(self).__name__}: the recent window must be >= 1 token")
        for layer in (0,):
            ranked = self._ranked_slots(layer)
            if ranked < max(1, self.sinks):
                raise ValueError(
                    f"{type(self).__name__}: budget {self.max_budget(layer)} leaves {ranked} "
                    f"ranked slots after the current token and the protected window "
                    f"({self.ring}); it must be at least 1 + window + max(1, sinks) "
                    f"= {1 + self.ring + max(1, self.sinks)}"
                )

    def shifts_key_positions(self) -> bool:
        return self.position_shift

    def capacity(self, max_len: int) -> int:
        del max_len
        return cached_tokens(self.max_budget(0)) if not self.int8 else self.ring

    def capacities(self, num_layers: int, max_len: int) -> tuple[int, ...]:
        del max_len
        if self.int8:
            return (self.ring,) * num_layers
        return tuple(cached_tokens(self.max_budget(i)) for i in range(num_layers))

    def int8_capacities(self, num_layers: int, max_len: int) -> tuple[int, ...] | None:
        del max_len
        if not self.int8:
            return None
        return tuple(self._ranked_slots(i) for i in range(num_layers))

    # --- the write ----------------------------------------------------------------------------
    def write(self, layer, k_new, v_new, pos_new, valid, stats, state, *, layer_index):
        if k_new.shape[1] == 1:
            return self._decode(layer, k_new, v_new, pos_new, valid, stats, state, layer_index)
        return self.merge(layer, k_new, v_new, pos_new, valid, stats, state, layer_index)

    def _budget_shrinks(self) -> bool:
        """Whether a layer's ranked budget can fall from one decode step to the next (a
        state-dependent `ranked_budget`, as CONF-KV's tight and loose budgets): only then can a
        ranked region hold more tokens than its budget, so that a decode step must evict. A
        fixed budget is never exceeded (prefill keeps at most the budget; a decode step fills
        a free slot only below it, else replaces the lowest priority), and its decode step
        skips the eviction's cond: passing the regions' positions through it cost a copy and
        a write-back of every layer's positions a step (KVpop at Llama-3-8B shapes, B = 8,
        32K: ~0.11 ms of a 0.34 ms policy step on an H100)."""
        return type(self).ranked_budget is not RankedPolicy.ranked_budget

    def _ranked(self, layer) -> Tokens:
        return int8_tokens(layer.int8) if self.int8 else fp_slice(layer, self.ring)

    def _leaving(self, leaving: Tokens, state) -> Tokens:
        """The token a decode step pushes out of the ring [B, H, 1] as read from its slot; a
        policy that scores it in the same step (KVpop) sets its score here."""
        del state
        return leaving

    def _prio(self, toks: Tokens, cur: Array, li: int) -> Array:
        """Priority with sinks pinned to +inf and empty slots to -inf."""
        return self._prio_of(toks.score, toks.pos, cur, li)

    def _prio_of(self, score: Array, pos: Array, cur: Array, li: int) -> Array:
        """`_prio` of a region's scores and positions [..., M]."""
        return jnp.where(pos >= 0, self._prio_kept(score, pos, cur, li), -_INF)

    def _prio_kept(self, score: Array, pos: Array, cur: Array, li: int) -> Array:
        """`_prio_of` where the slots are occupied (sinks +inf); any value on empty slots
        (what `slot_stats` reads: it sets those itself)."""
        p = self.priority(score, pos, cur, li)
        return jnp.where(pos < self.sinks, _INF, p)

    def _scored(self, layer, stats, cur, state, li):
        """The layer with every cached token's score updated by this call's mass."""
        up = lambda s, m, pos: self.update_score(s, m, pos, cur, state, li)
        layer = layer.replace(score=up(layer.score, stats.slot_mass, layer.pos))
        if layer.int8 is not None:
            t = layer.int8
            layer = layer.replace(int8=t.replace(score=up(t.score, stats.int8_mass, t.pos)))
        return layer

    def write_layers(self, layers, k_new, v_new, pos_new, valid, stats, state):
        """A decode step plans every layer's writes together (`_decode_plans`: one budget-shrink
        cond for all layers instead of one per layer, each a device-to-host sync on GPU); with
        write_kernel="pallas" the slot writes of every layer then run as one kernel launch.
        Policies that override `write` (KVpop) keep the layer-by-layer path."""
        if type(self).write is not RankedPolicy.write or k_new[0].shape[1] != 1:
            return super().write_layers(layers, k_new, v_new, pos_new, valid, stats, state)
        return self._apply(self._decode_plans(layers, k_new, v_new, pos_new, valid, stats, state))

    def write_stack(self, layers, k_new, v_new, pos_new, valid, stats, state):
        """A decode step over a stacked cache as `write_layers` plans it: the per-layer work
        vmapped over the stack and one budget shrink for all layers (`_shrink_stacked`: a loop
        of at most one trip, only where the budget can fall). Under a plain vmap of `write` the
        shrink's predicate is per layer, so it would become a select that runs the eviction's
        sort on every step. Other writes: the default vmap."""
        if type(self).write is not RankedPolicy.write or k_new.shape[2] != 1:
            return super().write_stack(layers, k_new, v_new, pos_new, valid, stats, state)
        return self._decode_stack(layers, k_new, v_new, pos_new, valid, stats, state)

    def leaving_stack(self, layers, pos_new: Array) -> Tokens:
        """The ring token a one-token decode step pushes out of every layer of a stacked cache,
        [L, B, H, 1] Tokens (K/V [L, B, H, 1, D]): the slot pos mod ring of each batch row, read
        for all layers at once (vmapped, the reads were gathers with a layer batch axis and
        transposes after them)."""
        slot = (pos_new[:, 0] % self.ring)[None, :, None, None]  # [1, B, 1, 1]
        take = lambda a: jnp.take_along_axis(
            a, slot.reshape(slot.shape + (1,) * (a.ndim - 4)), 3, mode="clip"
        )
        return Tokens(*(take(a) for a in (layers.k, layers.v, layers.pos, layers.score)))

    def _decode_stack(
        self, layers, k_new, v_new, pos_new, valid, stats, state, state_axis=None, leaving=None
    ):
        """`write_stack`'s decode step; state_axis 0: `state` has a leading [L] axis (one state
        per layer, as KVpop's scores of its leaving tokens), None: one for all layers.
        `leaving`: `leaving_stack(layers, pos_new)` read by the caller before this step's score
        updates (a policy whose decode scores leave its ring untouched), else read here."""
        lis = jnp.arange(layers.pos.shape[0], dtype=jnp.int32)
        cur3 = pos_new[:, 0][:, None, None]
        b = pos_new.shape[0]
        over_layers = lambda f, n: jax.vmap(f, in_axes=(0,) * n + (state_axis,))
        if not self.frozen_in_decode:
            scored = lambda ly, st, li, sta: self._scored(ly, st, cur3, sta, li)
            layers = over_layers(scored, 3)(layers, stats, lis, state)
        budget_of = lambda li, sta: self.ranked_budget(sta, li, b)[:, None]
        budgets = over_layers(budget_of, 1)(lis, state)
        layers, now = self._shrink_stacked(layers, budgets, cur3, lis)

        if leaving is None:
            leaving = self.leaving_stack(layers, pos_new)

        def one(ly, k, v, st, li, budget, nw, lv, sta):
            plan = self._decode_plan(ly, k, v, pos_new, valid, st, sta, li, budget, nw, lv)
            return self._apply([plan])[0]

        args = (layers, k_new, v_new, stats, lis, budgets, now, leaving, state)
        return over_layers(one, 8)(*args)

    def _shrink_stacked(self, layers, budgets, cur3, lis):
        """`_shrink` over a stacked cache (budgets [L, B, 1], lis [L]): the layers and their
        ranked regions' `slot_stats` (each [L, B, H]) after any eviction, one for all layers
        (in a loop of at most one trip)."""
        ranked = jax.vmap(self._ranked)(layers)
        # The priorities [L, B, H, M] are computed where they are used, from the scores: the
        # statistics' reduction reads the scores it writes, and the eviction branch computes
        # them again, so no priority array of the whole stack is stored every step (captured
        # by the cond it was: 103 MB written a step for confkv at Llama-3-8B shapes, 32K).
        prio_of = jax.vmap(lambda score, pos, li: self._prio_of(score, pos, cur3, li))
        kept = jax.vmap(lambda score, pos, li: self._prio_kept(score, pos, cur3, li))
        sizes = [ranked.pos.shape[-1]] * len(lis)
        stats = lambda pos, prios: _stacked_slot_stats(pos, [], sizes, padded_prio=prios)
        now = stats(ranked.pos, kept(ranked.score, ranked.pos, lis))
        if not self._budget_shrinks():
            ints, lows = now
            return layers, (ints[:, 0], ints[:, 1], lows, ints[:, 2])
        over = jnp.any(now[0][:, 0] > budgets, axis=(1, 2))  # [L]: some head is over budget
        ring = self.ring
        # The positions of every layer (the INT8 tier's, or the full-precision slots' with the
        # ranked region after the ring) are rewritten only by an eviction, in a loop of at
        # most one trip: a loop's carry is updated in place, where a cond that passes the
        # positions through on the other steps copied them, and their write-back was one more
        # pass, every step (~0.07 ms a step for CONF-KV at Llama-3-8B shapes, 32K, B = 8).
        region = (lambda a: a) if self.int8 else (lambda a: a[..., ring:])
        score = ranked.score

        def evict(carry):
            _, full, _ = carry
            pos = region(full)
            prios = prio_of(score, pos, lis)
            out = jnp.where(over[:, None, None, None] & ~_keep_top(prios, pos, budgets), -1, pos)
            if not self.int8:
                out = jax.lax.dynamic_update_slice_in_dim(full, out, ring, 3)
            return jnp.bool_(False), out, stats(region(out), prios)

        full = layers.int8.pos if self.int8 else layers.pos
        _, full, (ints, lows) = jax.lax.while_loop(
            lambda c: c[0], evict, (jnp.any(over), full, now)
        )
        if self.int8:
            layers = layers.replace(int8=layers.int8.replace(pos=full))
        else:
            layers = layers.replace(pos=full)
        return layers, (ints[:, 0], ints[:, 1], lows, ints[:, 2])

    def _apply(self, plans) -> tuple:
        return apply_slot_writes(plans, self.write_kernel)

    def _decode(self, layer, k_new, v_new, pos_new, valid, stats, state, li):
        plans = self._decode_plans(
            [layer], [k_new], [v_new], pos_new, valid, [stats], state, first_layer=li
        )
        return self._apply(plans)[0]

    def _decode_plans(self, layers, k_new, v_new, pos_new, valid, stats, state, first_layer=0):
        """Each layer after score updates and any budget shrink, and its pending slot writes
        (layers[i] is layer first_layer + i)."""
        cur3 = pos_new[:, 0][:, None, None]
        b = pos_new.shape[0]
        lis = [first_layer + j for j in range(len(layers))]  # first_layer may be traced
        if not self.frozen_in_decode:
            scored = zip(layers, stats, lis, strict=True)
            layers = [self._scored(ly, st, cur3, state, li) for ly, st, li in scored]
        budgets = [self.ranked_budget(state, li, b)[:, None] for li in lis]  # [B, 1] each
        layers, region_stats = self._shrink(layers, budgets, cur3, lis)
        return [
            self._decode_plan(ly, k, v, pos_new, valid, st, state, li, budget, now)
            for ly, k, v, st, li, budget, now in zip(
                layers, k_new, v_new, stats, lis, budgets, region_stats, strict=True
            )
        ]

    def _decode_plan(
        self, layer, k_new, v_new, pos_new, valid, stats, state, li, budget, now, leaving=None
    ):
        """A layer's pending slot writes, given its ranked region's `slot_stats` after the
        shrink (`now`), its ranked budget [B, 1] and the ring token it pushes out (`leaving`,
        [B, H, 1] Tokens; None: read here)."""
        b, _, h, _ = k_new.shape
        w = self.ring
        cur = pos_new[:, 0]
        cur3 = cur[:, None, None]
        live, free, lowest_prio, lowest = now
        new = Tokens(
            k=jnp.swapaxes(k_new, 1, 2),
            v=jnp.swapaxes(v_new, 1, 2),
            pos=jnp.broadcast_to(pos_new[:, None, :], (b, h, 1)),
            score=self.init_score(stats.new_mass, pos_new[:, None, :], state, li),
        )
        ring_slot = jnp.broadcast_to((cur % w)[:, None, None], (b, h, 1))
        # The token the new one pushes out, read from the whole arrays (a slice of the ring
        # would reshard a slot-split cache: context-parallel, each device reads its own slots).
        if leaving is None:
            fields = (layer.k, layer.v, layer.pos, layer.score)
            leaving = Tokens(*take_slots(fields, ring_slot))
        leaving = self._leaving(leaving, state)
        leave_prio = self._prio(leaving, cur3, li)[..., 0]
        if self.frozen_in_decode:
            leave_prio = jnp.full_like(leave_prio, -_INF)
        m = self._ranked(layer).pos.shape[-1]
        target = jnp.where(live < budget, free, jnp.where(leave_prio > lowest_prio, lowest, m))
        target = jnp.where((leaving.pos[..., 0] >= 0) & valid[:, :1], target, m)[..., None]
        ring_slot = jnp.where(valid[:, :, None], ring_slot, layer.capacity)
        if self.int8:
            return layer, SlotWrites(fp=(ring_slot, new), int8=(target, leaving.quantized()))
        # leaving and new tokens go to different slots (ranked region vs ring): one write of 2
        new = new.replace(k=new.k.astype(layer.k.dtype), v=new.v.astype(layer.v.dtype))
        ranked_slot = jnp.where(target < m, target + w, layer.capacity)
        slots = jnp.concatenate([ranked_slot, ring_slot], axis=-1)
        return layer, SlotWrites(fp=(slots, leaving.concat(new)))

    def _shrink(self, layers, budgets, cur3, lis):
        """Evict each layer's lowest-priority ranked tokens down to its budget [B, 1] by
        emptying their slots (pos -1; K/V stay where they are, as holes the next tokens fill).
        Returns the layers and their ranked regions' `slot_stats` after any eviction.

        The eviction (a sort) runs under one lax.cond for all layers, only when some head of
        some layer holds more than its budget (a layer within its budget keeps its positions),
        and the cond returns only the ranked regions' positions and statistics: a cond carrying
        K/V would make XLA copy the whole tier every step (measured on the H200: ~9 ms/step for
        confkv at Llama-3-8B shapes, 32K context, batch 8). The statistics the decode step needs
        come from one fused reduction for all layers, recomputed only after an eviction."""
        ranked = [self._ranked(ly) for ly in layers]
        prios = [self._prio(r, cur3, li) for r, li in zip(ranked, lis, strict=True)]
        sizes = [r.pos.shape[-1] for r in ranked]
        budget = jnp.stack(budgets)  # [L, B, 1]
        # All layers at once: their regions padded to the largest (empty slots, which no
        # statistic counts) and stacked, so a step's statistics and its eviction are a few ops
        # for every layer rather than a few per layer (compile time grew with the layer count).
        now = _stacked_slot_stats(_pad_stack([r.pos for r in ranked], -1), prios, sizes)
        if not self._budget_shrinks():
            return layers, _unstack_stats(now)
        over = jnp.any(now[0][:, 0] > budget, axis=(1, 2))  # [L]: some head is over budget

        def evict(pos):
            pos_all, prio_all = _pad_stack(pos, -1), _pad_stack(prios, jnp.nan)
            need = over[:, None, None, None]
            out = jnp.where(need & ~_keep_top(prio_all, pos_all, budget), -1, pos_all)
            stacked = _stacked_slot_stats(out, prios, sizes, padded_prio=prio_all)
            return [out[i, ..., :m] for i, m in enumerate(sizes)], stacked

        # The statistics cross the cond stacked in two arrays: a branch that passes its operand
        # through costs a device copy per array (the H200 trace: 4 per layer, ~1.5 µs each,
        # plus the host time to launch them after the cond's sync).
        pred = jnp.any(over)
        keep = lambda pos: (pos, now)
        pos_out, stacked = jax.lax.cond(pred, evict, keep, [r.pos for r in ranked])
        stats_out = _unstack_stats(stacked)
        new_layers = []
        for ly, pos in zip(layers, pos_out, strict=True):
            if self.int8:
                ly = ly.replace(int8=ly.int8.replace(pos=pos))
            else:
                ly = ly.replace(
                    pos=jax.lax.dynamic_update_slice_in_dim(ly.pos, pos, self.ring, axis=2)
                )
            new_layers.append(ly)
        return new_layers, stats_out

    def _set_ranked(self, layer, toks: Tokens):
        if self.int8:
            return layer.replace(int8=int8_from_tokens(toks))
        return replace_fp_range(layer, self.ring, toks)

    def merge(self, layer, k_new, v_new, pos_new, valid, stats, state, li):
        """General write of T tokens: rebuild ring and ranked region from all candidates."""
        b, t, h, _ = k_new.shape
        w = self.ring
        last = jnp.max(jnp.where(valid, pos_new, -1), axis=1)  # [B]
        cur3 = last[:, None, None]
        layer = self._scored(layer, stats, cur3, state, li)
        pos = jnp.where(valid, pos_new, -1)[:, None, :]
        new = Tokens(
            k=jnp.swapaxes(k_new, 1, 2),
            v=jnp.swapaxes(v_new, 1, 2),
            pos=jnp.broadcast_to(pos, (b, h, t)),
            score=self.init_score(stats.new_mass, pos, state, li),
        )
        ring = fp_slice(layer, 0, w)
        stays = lambda p: (p >= 0) & (p > cur3 - w)  # among the w most recent
        ranked = self._ranked(layer)
        fresh = ring.concat(new)
        if self.int8:
            fresh = fresh.quantized()
        cands = ranked.concat(fresh)
        # Scores see every token (SnapKV pools votes over all neighbours); then ring leavers and
        # new tokens too old for the ring compete with the ranked region.
        stay = jnp.concatenate([jnp.zeros_like(ranked.pos, bool), stays(fresh.pos)], axis=-1)
        cands = cands.replace(
            score=self.candidate_scores(cands), pos=jnp.where(stay, -1, cands.pos)
        )
        budget = self.ranked_budget(state, li, b)[:, None]
        kept = _select_prefix(cands, self._prio(cands, cur3, li), budget, ranked.pos.shape[-1])
        layer = self._set_ranked(layer, kept)
        slot = jnp.where(stays(new.pos), new.pos % w, layer.capacity)
        return scatter_fp(layer, slot, new)


def slot_stats(pos: Array, prio: Array) -> tuple[Array, Array, Array, Array]:
    """What a decode step needs of a ranked region [B, H, M], in one variadic reduction (one
    kernel on GPU instead of four row reductions, which at decode sizes cost latency, not
    bytes): (live, free, lowest_prio, lowest), each [B, H] — the occupied slots (pos >= 0), the
    first empty slot (0 if none, as jnp.argmax), the lowest priority among occupied slots (+inf
    if none) and its slot (the first on ties, a NaN before any number, 0 if none: as
    jnp.argmin of the occupied priorities with +inf on empty slots)."""
    m = pos.shape[-1]
    idx = jax.lax.broadcasted_iota(jnp.int32, pos.shape, pos.ndim - 1)
    # `pos >= 0` has one use, the priorities' select: the live count and the first free slot
    # come from the sign bit (1 occupied, 0 empty). Shared by three operands, XLA's GPU
    # compiler kept the comparison out of the reduction, one more pass over the positions
    # and a boolean array written and read (24 µs of KVpop's 0.19 ms step on an H100, 32
    # layers, B = 8, 32K: scripts/slot_stats_probe.py).
    live = jax.lax.shift_right_arithmetic(pos, jnp.int32(31)) + 1
    operands = (
        live,
        jnp.maximum(idx, m * live),  # occupied: m (never the first free); empty: its index
        jnp.where(pos >= 0, prio.astype(jnp.float32), _INF),
        idx,
    )
    return reduce_slot_operands(operands, m)


def reduce_slot_operands(operands: tuple[Array, ...], m: int):
    """`slot_stats`' reduction over the last axis of its four operands [..., M]: per slot 1 if
    occupied (else 0), its index if empty (else >= m), its priority (+inf if empty) and its
    index. Returns (live, first free or 0, lowest priority, its slot: the first on ties, a NaN
    before any number)."""

    def combine(a, b):
        (na, fa, va, ia), (nb, fb, vb, ib) = a, b
        nan_a, nan_b = jnp.isnan(va), jnp.isnan(vb)
        a_first = (va < vb) | ((va == vb) & (ia < ib)) | (nan_a & ~nan_b)
        a_first = a_first | (nan_a & nan_b & (ia < ib))
        return (
            na + nb,
            jnp.minimum(fa, fb),
            jnp.where(a_first, va, vb),
            jnp.where(a_first, ia, ib),
        )

    init = (jnp.int32(0), jnp.int32(m), jnp.float32(_INF), jnp.int32(m))
    axis = operands[0].ndim - 1
    live, free, low, lowest = jax.lax.reduce(operands, init, combine, (axis,))
    return live, jnp.where(free == m, 0, free), low, lowest


def _pad_stack(xs: list[Array], fill) -> Array:
    """Arrays [..., M_l] stacked into [L, ..., max M_l], each padded at the end with `fill`."""
    m = max(x.shape[-1] for x in xs)
    pad = lambda x: jnp.pad(
        x, [(0, 0)] * (x.ndim - 1) + [(0, m - x.shape[-1])], constant_values=fill
    )
    return jnp.stack([pad(x) for x in xs])


def _stacked_slot_stats(
    pos: Array, prios: list[Array], sizes: list[int], *, padded_prio: Array | None = None
) -> tuple[Array, Array]:
    """`slot_stats` of every layer's ranked region in one reduction, as two arrays: ints
    [L, 3, B, H] (live, free, lowest) and the lowest priorities [L, B, H].

    Args:
        pos: [L, B, H, M] the regions' positions, each padded to M with EMPTY slots.
        prios: each layer's priorities [B, H, M_l].
        sizes: M_l, each layer's region size.
        padded_prio: `prios` padded and stacked as `pos` (computed here if None).
    """
    prio = _pad_stack(prios, jnp.nan) if padded_prio is None else padded_prio
    live, free, low, lowest = slot_stats(pos, prio)
    # No empty slot among a layer's own M_l: the first free one is 0 (as jnp.argmax).
    m_l = jnp.asarray(sizes, jnp.int32)[:, None, None]
    free = jnp.where(free >= m_l, 0, free)
    return jnp.stack([live, free, lowest], axis=1), low


def _unstack_stats(stacked: tuple[Array, Array]) -> list[tuple[Array, Array, Array, Array]]:
    ints, lows = stacked
    return [(i[0], i[1], low, i[2]) for i, low in zip(ints, lows, strict=True)]


def _keep_top(prio: Array, pos: Array, budget: Array) -> Array:
    """[B, H, N] bool: the occupied slots (pos >= 0) among the `budget` [B, 1] highest
    priorities [B, H, N] (ties: the lower index first)."""
    rank = jnp.argsort(jnp.argsort(-prio, axis=-1, stable=True), axis=-1)
    return (rank < budget[..., None]) & (pos >= 0)


def _select_prefix(cands: Tokens, prio: Array, budget: Array, size: int) -> Tokens:
    """Keep the `budget` [B, 1] highest-priority occupied candidates, in a dense prefix of `size`
    slots ordered by position; the rest of the prefix is EMPTY."""
    n = cands.pos.shape[-1]
    if size > n:
        raise ValueError(f"ranked region ({size}) larger than its candidates ({n})")
    keep = _keep_top(prio, cands.pos, budget)
    # Kept first (by position), then everything else.
    key = jnp.where(keep, cands.pos, jnp.iinfo(jnp.int32).max)
    idx = jnp.argsort(key, axis=-1, stable=True)[..., :size]
    out = cands.take(idx)
    n_keep = jnp.sum(keep, axis=-1, keepdims=True)
    filled = jnp.arange(size)[None, None, :] < n_keep
    return out.replace(pos=jnp.where(filled, out.pos, -1))
