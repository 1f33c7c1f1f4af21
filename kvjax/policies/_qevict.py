"""QEvict: three recoverable tiers over windows of tokens, under a byte budget, with a write-once
quantization ledger (see METHODS.md, "QEvict").

The history after the sinks is cut into windows of ω tokens. Sinks and the local band (the most
recent tokens) stay in full precision and are never ranked. When a window leaves the band (every
ω decode steps) a routing event ranks every resident window by its cumulative attention mass
(H2O-style column sums, summed over the query heads of the KV head) and routes it to full
precision, to the low-bit tier (INT2 by default, still attended: the attention dequantizes it) or
out of the cache for good. A window is quantized once, at its first demotion; its codes (the
ledger) are kept while the window lives and reused by every later demotion. A promoted window's
full-precision copy is its ledger dequantized, and the ledger entry stays (dormant, counted in
live bytes), so nothing is ever re-quantized. Positions are never renumbered.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import CacheSpec, lowbit_page_bytes, write_slots
from kvjax.policies._base import Policy, cached_tokens
from kvjax.policies._lowbit_layout import check_layout, lowbit_layout
from kvjax.policies._qevict_move import MoveJob, apply_moves, apply_moves_stacked
from kvjax.policies._qevict_route import Layout, QEvictAux, RouteState, empty_plan, route
from kvjax.policies._ranked import apply_slot_writes, check_write_kernel
from kvjax.policies._regions import SlotWrites, Tokens
from kvjax.quant import BITS

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class QEvictPolicy(Policy):
    """Windows routed between full precision, write-once low-bit codes and eviction.

    Attributes:
        budget: the byte budget per KV head and layer, in full-precision tokens (M = budget ·
            2·D·itemsize bytes) attended per step; the current token, the sinks and the local
            band are paid from it.
        window: ω, tokens per window (8; 16 for RULER-length runs).
        sinks: first tokens always kept in full precision.
        band: recent tokens always in full precision (a multiple of ω); None: min(128,
            budget/4) rounded down to a multiple of ω.
        quant_share: q, the share of the routed budget the low-bit tier takes under pressure.
        bits: code width of the low-bit tier (2, 4 or 8).
        value_group: channels per value scale/zero (None: one group per token, as the paper).
        lowbit_layout: the pages' layout in the cache (`CacheSpec.lowbit_layout`): "token",
            "kernel" (the Mosaic GPU low-bit kernel's own: 64-token pages, 2 or 4 bits),
            "words" (the same kernel's codes in its dot registers' order: 64-token pages, 2 or
            4 bits, head_dim·bits a multiple of 256) or "auto", the default: the device
            Tuning's choice where the shapes allow (Hopper: "words" for bfloat16 caches at
            those shapes, "kernel" where only that fits), else "token".
        moves: windows an event quantizes, and windows it brings into full precision, per round
            and KV head; an event runs as many rounds as its busiest head needs, each reading
            only the windows it moves. None: one round over every candidate (same result).
        position_shift: attend every key at its position within the cache (StreamingLLM
            §3.2 over the kept set): the key of rank r among the n tokens attended from the
            cache, over the full-precision and low-bit tiers together, at position r, the
            query at n (`RankedPolicy`'s docstring has the rule and what is exact). Low-bit
            keys are turned after dequantization, so this takes the XLA attention; windows
            out of the cache are not attended and not counted. Default False.
        write_kernel: a one-token call's ring write (key, value, position and score of the
            new token, every layer of a stacked cache): "pallas", one slot-write kernel
            launch (`kvjax.pallas_kernels.slot_write`); "xla", XLA scatters (one per array);
            "auto" (default), "pallas" on GPU, "xla" elsewhere. Calls of several tokens take
            XLA's scatters.
    """

    name = "qevict"
    budget: int
    window: int = 8
    sinks: int = 4
    band: int | None = None
    quant_share: float = 0.5
    bits: int = 2
    value_group: int | None = None
    moves: int | None = 16
    position_shift: bool = False
    lowbit_layout: str = "auto"
    write_kernel: str = "auto"

    def __post_init__(self) -> None:
        check_write_kernel("QEvictPolicy", self.write_kernel)
        if not isinstance(self.position_shift, bool):
            raise ValueError(
                f"QEvictPolicy.position_shift must be True or False, got {self.position_shift!r}"
            )
        check_layout("QEvictPolicy", self.lowbit_layout)
        if self.window < 1:
            raise ValueError(f"QEvictPolicy.window must be >= 1, got {self.window}")
        if self.sinks < 0:
            raise ValueError(f"QEvictPolicy.sinks must be >= 0, got {self.sinks}")
        if self.band is not None and (self.band < 0 or self.band % self.window):
            raise ValueError(
                f"QEvictPolicy.band must be a multiple of window ({self.window}) >= 0, "
                f"got {self.band}"
            )
        if not 0.0 <= self.quant_share <= 1.0:
            raise ValueError(f"QEvictPolicy.quant_share must be in [0, 1], got {self.quant_share}")
        if self.moves is not None and self.moves < 1:
            raise ValueError(f"QEvictPolicy.moves must be >= 1 or None, got {self.moves}")
        if self.bits not in BITS:
            raise ValueError(f"QEvictPolicy.bits must be one of {BITS}, got {self.bits}")
        if cached_tokens(self.budget) <= self.sinks + self.local_band + self.window:
            raise ValueError(
                f"QEvictPolicy.budget ({self.budget}) must exceed the current token + sinks + "
                f"band + window (1 + {self.sinks} + {self.local_band} + {self.window}): no room "
                "for ranked windows"
            )

    def shifts_key_positions(self) -> bool:
        return self.position_shift

    @property
    def local_band(self) -> int:
        if self.band is not None:
            return self.band
        return min(128, self.budget // 4) // self.window * self.window

    def layout(self, head_dim: int, dtype) -> Layout:
        """Static sizes of one layer's cache for this head dim and full-precision dtype."""
        vg = head_dim if self.value_group is None else self.value_group
        if vg <= 0 or head_dim % vg:
            raise ValueError(
                f"QEvictPolicy.value_group ({self.value_group}) must divide head_dim {head_dim}"
            )
        tok = 2 * head_dim * np.dtype(dtype).itemsize
        ring = self.local_band + self.window
        budget_bytes = (cached_tokens(self.budget) - self.sinks - ring) * tok
        fp_w = self.window * tok
        page = lowbit_page_bytes(head_dim, self.window, self.bits, vg)
        if budget_bytes < min(fp_w, page):
            raise ValueError(
                f"QEvictPolicy.budget {self.budget} leaves {budget_bytes} bytes after sinks and "
                f"band: not one window fits (full precision {fp_w} B, low-bit {page} B)"
            )
        if budget_bytes >= 2**28:
            raise ValueError(f"QEvictPolicy.budget {self.budget} is too large ({budget_bytes} B)")
        return Layout(
            sinks=self.sinks,
            ring=ring,
            window=self.window,
            fp_windows=budget_bytes // fp_w,
            pages=max(1, budget_bytes // page),
            budget_bytes=budget_bytes,
            quant_bytes=math.floor(self.quant_share * budget_bytes),
            fp_window_bytes=fp_w,
            page_bytes=page,
        )

    def capacity(self, max_len: int) -> int:
        """Full-precision slots per KV head: sinks, the ring (band + one window) and the routed
        full-precision windows, ⌊(budget − 1 − sinks − ring) / ω⌋ of them (budget − 1 are cached:
        the current token is attended on top; the byte budget and a window's bytes both scale
        with 2·D·itemsize, so the count depends on neither). The
        low-bit tier's pages are extra (`cache_spec`); max_len does not matter (bounded)."""
        del max_len
        ring = self.local_band + self.window
        room = cached_tokens(self.budget) - self.sinks - ring
        return self.sinks + ring + room // self.window * self.window

    def cache_spec(self, *, batch, num_layers, num_kv_heads, head_dim, max_len, dtype):
        del max_len
        lay = self.layout(head_dim, dtype)
        vg = head_dim if self.value_group is None else self.value_group
        return CacheSpec(
            batch=batch,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            capacities=(lay.capacity,) * num_layers,
            dtype=dtype,
            lowbit_pages=(lay.pages,) * num_layers,
            lowbit_page_size=self.window,
            lowbit_bits=self.bits,
            lowbit_value_group=vg,
            lowbit_layout=lowbit_layout(
                self.lowbit_layout,
                page=self.window,
                head_dim=head_dim,
                bits=self.bits,
                value_group=vg,
                dtype=dtype,
            ),
        )

    def live_bytes_bound(self, spec: CacheSpec) -> int:
        tok = 2 * spec.head_dim * np.dtype(spec.dtype).itemsize
        return spec.batch * spec.num_kv_heads * spec.num_layers * self.budget * tok

    def init_layer_aux(self, spec: CacheSpec) -> tuple[QEvictAux, ...]:
        shape = (spec.batch, spec.num_kv_heads, self.layout(spec.head_dim, spec.dtype).fp_windows)
        # One buffer per layer: the cache is donated, and a buffer may be donated only once.
        return tuple(
            QEvictAux(fp_ledger=jnp.full(shape, -1, jnp.int32)) for _ in range(spec.num_layers)
        )

    def _left(self, n: Array) -> Array:
        """Windows that have left the band once n tokens are cached."""
        return jnp.maximum(n - self.sinks - self.local_band, 0) // self.window

    def write(self, layer, k_new, v_new, pos_new, valid, stats, state, *, layer_index):
        del layer_index
        return self.write_layers([layer], [k_new], [v_new], pos_new, valid, [stats], state)[0]

    def write_layers(self, layers, k_new, v_new, pos_new, valid, stats, state):
        """Every layer's write: each layer's scores and ring first, then one routing cond
        for all layers (their small arrays stacked, one ranking for every layer: the event
        depends on positions only, so all layers route on the same steps) and one
        data-movement loop for all layers (`apply_moves`). Per layer this equals `write`;
        the cond and the loop cost one device-side trip count each a step, not one each per
        layer, and the ranking compiles once rather than once per layer."""
        del state
        pres = [
            self._before_route(layer, k, v, pos_new, valid, st)
            for layer, k, v, st in zip(layers, k_new, v_new, stats, strict=True)
        ]
        routed = self._route_all(pres)
        jobs = [self._job(pre, st, plan) for pre, (st, plan) in zip(pres, routed, strict=True)]
        return apply_moves(jobs, moves=self.moves)

    def write_stack(self, layers, k_new, v_new, pos_new, valid, stats, state):
        """`write_layers` over a stacked cache (leading [L] axis): the per-layer parts vmapped
        over the stack (the scatters write the stacked buffers in place) and, as unrolled, one
        routing event for all layers (here a loop of at most one trip, its small arrays updated
        in place) and one move loop (`apply_moves_stacked`)."""
        del state
        lay = self.layout(layers.k.shape[-1], layers.k.dtype)
        pre = jax.vmap(
            lambda layer, k, v, st: self._before_route(layer, k, v, pos_new, valid, st)._replace(
                lay=None
            )
        )(layers, k_new, v_new, stats)
        n, b, h, kk = pre.nwin.shape
        win, event = pre.win[0], pre.event[0]  # positions only: equal in every layer
        one = self._router(lay, win, event)
        empty = empty_plan(b, h, lay, kk, self.moves)
        stack = lambda x: jnp.broadcast_to(x, (n, *x.shape))
        # The routing event in a loop of at most one trip: its carry (every layer's small
        # arrays, positions and scores of every slot among them) is updated in place, where a
        # cond passed them through on the steps without an event, a copy of each a step.

        def route_all(carry):
            _, st, _ = carry
            return (jnp.bool_(False), *jax.vmap(one)(st, pre.new_score))

        init = (jnp.any(event), pre.st, jax.tree.map(stack, empty))
        _, st, plan = jax.lax.while_loop(lambda c: c[0], route_all, init)
        jobs = jax.vmap(self._job)(pre, st, plan._replace(counts=None))
        return apply_moves_stacked(jobs, lay, plan.counts, moves=self.moves)

    def _router(self, lay, win, event):
        """`route` of one layer's (small arrays, leaving windows' scores)."""
        return lambda st, score: route(st, lay, score, win, event, moves=self.moves)

    def _before_route(self, layer, k_new, v_new, pos_new, valid, stats) -> _PreRoute:
        """One layer's write up to its routing event: scores, this call's tokens in the ring,
        the windows leaving the ring and the small arrays the event reads."""
        lay = self.layout(layer.k.shape[-1], layer.k.dtype)
        b, t, h, d = k_new.shape
        w, r, s = self.window, lay.ring, self.sinks
        lb = layer.lowbit
        layer = layer.replace(
            score=layer.score + stats.slot_mass,
            lowbit=lb.replace(score=lb.score + jnp.sum(stats.lowbit_mass, axis=-1)),
        )
        n0 = pos_new[:, 0]
        n1 = n0 + jnp.sum(valid, axis=1, dtype=jnp.int32)
        l0, l1 = self._left(n0), self._left(n1)
        # Windows leaving the band in this call, gathered from the ring or this call's tokens.
        kk = t // w + 1
        j = l0[:, None] + jnp.arange(kk, dtype=jnp.int32)[None, :]  # [B, K]
        win = jnp.where(j < l1[:, None], j, -1)
        tok_pos = s + j[..., None] * w + jnp.arange(w, dtype=jnp.int32)[None, None, :]  # [B, K, ω]
        old = (tok_pos < n0[:, None, None])[:, None, :, :, None]
        ring_idx = (s + (tok_pos - s) % r).reshape(b, 1, kk * w)
        new_idx = jnp.clip(tok_pos - n0[:, None, None], 0, t - 1).reshape(b, 1, kk * w)
        # (Indices in range: "clip" gathers need no bounds mask, a simpler kernel.)
        take = lambda a, i: jnp.take_along_axis(a, i, axis=2, mode="clip")
        from_ring = lambda a: take(a, ring_idx[..., None])
        from_new = lambda a: take(jnp.swapaxes(a, 1, 2), new_idx[..., None])
        shape = (b, h, kk, w, d)
        new_k = jnp.where(old, from_ring(layer.k).reshape(shape), from_new(k_new).reshape(shape))
        new_v = jnp.where(old, from_ring(layer.v).reshape(shape), from_new(v_new).reshape(shape))
        sc_ring = take(layer.score, ring_idx).reshape(b, h, kk, w)
        sc_new = take(stats.new_mass, new_idx).reshape(b, h, kk, w)
        new_score = jnp.where(old[..., 0], sc_ring, sc_new)
        # The leaving windows are read out of the ring before this call's tokens overwrite it
        # (else XLA would keep the old ring alive by copying the whole tier).
        new_k, new_v, new_score, layer = jax.lax.optimization_barrier(
            (new_k, new_v, new_score, layer)
        )
        # This call's tokens: sinks, or ring slots if their window has not left yet.
        base_after = s + l1 * w  # [B] first position still in the ring
        ring_slot = s + (pos_new - s) % r
        sink = pos_new < s
        keep = valid & (sink | (pos_new >= base_after[:, None]))
        slot = jnp.where(keep, jnp.where(sink, pos_new, ring_slot), layer.capacity)
        if t == 1:  # a decode step: the write of `write_kernel`
            toks = Tokens(
                k=jnp.swapaxes(k_new, 1, 2),
                v=jnp.swapaxes(v_new, 1, 2),
                pos=jnp.broadcast_to(pos_new[:, None, :], (b, h, t)),
                score=stats.new_mass,
            )
            writes = SlotWrites(fp=(jnp.broadcast_to(slot[:, None, :], (b, h, t)), toks))
            (layer,) = apply_slot_writes([(layer, writes)], self.write_kernel)
        else:
            layer = write_slots(
                layer,
                k_new,
                v_new,
                pos_new,
                jnp.broadcast_to(slot[:, :, None], (b, t, h)),
                jnp.swapaxes(stats.new_mass, 1, 2),
            )
        # (The ring slots of the windows that left are emptied by the routing event, which
        # runs exactly when a window leaves: a step without one does not touch them.)
        lb = layer.lowbit
        st = RouteState(layer.pos, layer.score, lb.pos, lb.score, lb.held, layer.aux.fp_ledger)
        nwin = jnp.broadcast_to(win[:, None, :], (b, h, kk))
        return _PreRoute(layer, lay, st, new_k, new_v, new_score, win, l1 > l0, nwin)

    def _route_all(self, pres: list[_PreRoute]) -> list[tuple[RouteState, Any]]:
        """Every layer's routing event under one cond on small arrays: (new small arrays,
        MovePlan) per layer. The ranking (sorts) is vmapped over the stacked layers; the K/V
        and codes move outside the cond, in place (a loop of zero rounds without an event)."""
        lay, win, event = pres[0].lay, pres[0].win, pres[0].event
        if any(p.lay != lay for p in pres):
            raise ValueError("QEvict's layers must share one layout (head_dim and dtype)")
        b, h, kk = pres[0].nwin.shape
        n = len(pres)
        one = self._router(lay, win, event)

        def run(ops):
            sts, scores = ops
            stack = lambda *xs: jnp.stack(xs)
            new, plan = jax.vmap(one)(jax.tree.map(stack, *sts), jnp.stack(scores))
            return [jax.tree.map(lambda x, i=i: x[i], (new, plan)) for i in range(n)]

        def skip(ops):
            return [(st, empty_plan(b, h, lay, kk, self.moves)) for st in ops[0]]

        ops = ([p.st for p in pres], [p.new_score for p in pres])
        return jax.lax.cond(jnp.any(event), run, skip, ops)

    def _job(self, pre: _PreRoute, st: RouteState, plan) -> MoveJob:
        """A layer with its routing event's small arrays applied, and its data movement."""
        lb = pre.layer.lowbit
        layer = pre.layer.replace(
            pos=st.pos,
            score=st.score,
            lowbit=lb.replace(pos=st.page_pos, score=st.page_score, held=st.held),
            aux=QEvictAux(fp_ledger=st.fp_ledger),
        )
        return MoveJob(layer, pre.lay, plan, pre.new_k, pre.new_v)


class _PreRoute(NamedTuple):
    """One layer's state between its ring write and its routing event (see `_before_route`)."""

    layer: Any
    lay: Layout
    st: RouteState
    new_k: Array
    new_v: Array
    new_score: Array
    win: Array
    event: Array
    nwin: Array
