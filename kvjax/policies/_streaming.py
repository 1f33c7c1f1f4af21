"""StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language Models with Attention Sinks"):
the first `sinks` tokens plus the most recent `budget - sinks` tokens (the current one included),
optionally with the paper's positions within the cache (§3.2)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax.policies._base import PositionalPolicy, cached_tokens


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamingPolicy(PositionalPolicy):
    """Attention sinks + sliding window; `budget` is StreamingLLM's cache size: tokens attended
    per step, sinks and the current token included (the cache keeps `budget - 1`).

    Positions. By default every key keeps the RoPE position it was written at, so a sink is
    attended at its true distance t − j from the query at position t: past the model's trained
    context that distance is one the model never saw. StreamingLLM (§3.2, "positions within
    the cache") numbers positions by index in the cache instead: with the cache holding sinks
    j = 0..s−1 and the R = budget − 1 − s most recent tokens, the query sits at cache position
    s + R, the recent tokens keep their true distances and sink j is at distance (s + R) − j,
    never more than the cache size. `position_shift=True` does that over our post-RoPE cache
    without touching attention: once the cache is full, before the attention of the query at
    position t, sink j's slot holds its key turned to position j + Δ with
    Δ = max(0, t − (budget − 1)). Each sink's key as first written is kept in float32 in
    `LayerCache.aux` ([B, Hkv, sinks, D]) and every call writes rotate(key, Δ) from it (RoPE
    is a rotation), so no rounding accumulates over a long stream; values never change.
    Δ is set for the first query of each model call: exact for one token per call (decode,
    `score_tokens` with `chunk=1`); the later queries of a multi-token call see the sinks
    further away by their offset in the call (q − first query), and sinks written in that same
    call are attended at their own positions. Needs a RoPE model (not GPT-2).

    Attributes:
        budget: total tokens attended per step per KV head; must exceed `sinks`.
        sinks: leading tokens never evicted (default 4, as in the paper).
        position_shift: StreamingLLM's positions within the cache (default False: every key
            at its original position).
    """

    name = "streaming"
    budget: int
    sinks: int = 4
    position_shift: bool = False

    def __post_init__(self) -> None:
        if self.sinks < 0:
            raise ValueError(f"StreamingPolicy.sinks must be >= 0, got {self.sinks}")
        if self.budget <= self.sinks:
            raise ValueError(
                f"StreamingPolicy.budget ({self.budget}) must be larger than sinks "
                f"({self.sinks}): no room is left for the recent window"
            )
        if not isinstance(self.position_shift, bool):
            raise ValueError(
                f"StreamingPolicy.position_shift must be True or False, got {self.position_shift!r}"
            )
        if self.position_shift and self.sinks == 0:
            raise ValueError(
                "StreamingPolicy.position_shift moves the sinks' positions; with sinks=0 there "
                "is nothing to move (use position_shift=False, or sinks > 0)"
            )

    @property
    def _recent(self) -> int:
        """Recent tokens cached (the current one is attended on top)."""
        return cached_tokens(self.budget) - self.sinks

    def capacity(self, max_len: int) -> int:
        del max_len
        return self.sinks + max(1, self._recent)  # no recent tokens: one slot stays empty

    def slot_of(self, pos, capacity):
        ring = capacity - self.sinks
        return jnp.where(pos < self.sinks, pos, self.sinks + (pos - self.sinks) % ring)

    def survives(self, pos, last_pos, capacity):
        del capacity
        recent = (pos > last_pos - self._recent) & jnp.bool_(self._recent > 0)
        return (pos < self.sinks) | recent

    def init_layer_aux(self, spec):
        if not self.position_shift:
            return None
        shape = (spec.batch, spec.num_kv_heads, self.sinks, spec.head_dim)
        return tuple(jnp.zeros(shape, jnp.float32) for _ in range(spec.num_layers))

    def write(self, layer, k_new, v_new, pos_new, valid, stats, state, *, layer_index):
        out = super().write(
            layer, k_new, v_new, pos_new, valid, stats, state, layer_index=layer_index
        )
        if not self.position_shift:
            return out
        # Sink j (slot j) as first written, kept in float32 for every later rotation.
        b, _, h, _ = k_new.shape
        j = jnp.where(valid & (pos_new < self.sinks), pos_new, self.sinks)  # [B, T]
        bi = jnp.arange(b)[:, None, None]
        hi = jnp.arange(h)[None, None, :]
        aux = layer.aux.at[bi, hi, j[:, :, None]].set(k_new.astype(jnp.float32), mode="drop")
        return out.replace(aux=aux)

    def repositions_keys(self) -> bool:
        return self.position_shift

    def reposition_keys(self, layer, next_pos, rotate):
        if not self.position_shift:
            return layer
        delta = jnp.maximum(next_pos - cached_tokens(self.budget), 0)  # [B]
        b, h, s, d = layer.aux.shape
        by = jnp.broadcast_to(delta[:, None], (b, s)).astype(jnp.int32)
        sinks = rotate(jnp.swapaxes(layer.aux, 1, 2), by)  # [B, S, Hkv, D] float32
        sinks = jnp.swapaxes(sinks, 1, 2).astype(layer.k.dtype)  # [B, Hkv, S, D]
        return layer.replace(k=layer.k.at[:, :, :s].set(sinks))
