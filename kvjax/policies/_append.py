"""Append-only slots after a one-time compression (kvpress's protocol): the context was
compressed once before the question; the question and answer then append into the free slots
and never evict a context token. Per-head slots, or one pool per layer shared by the KV heads
(`pooled`, after adakv: each new token takes one pool slot per KV head)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax.numpy as jnp

from kvjax.cache import write_slots
from kvjax.policies._base import Policy


@dataclasses.dataclass(frozen=True, kw_only=True)
class AppendPolicy(Policy):
    """Writes each new token into the next free slot; nothing is ever evicted.

    Slots hold a dense prefix of live tokens (the compressed context first). A cache sized
    with room for the question and every answer token never fills; past that, tokens that find
    no free slot are not cached (the caller sizes the room: `press_context`).

    Attributes:
        slots: slots per KV head of each layer (the kept context plus the room); pooled: the
            pool of a layer holds Hkv × its slots, the heads' shares unequal.
        pooled: one slot pool per layer (`CacheSpec.pooled`), live slots a dense prefix.
    """

    name = "append"
    uses_attention_mass: ClassVar[bool] = False
    slots: tuple[int, ...]
    pooled: bool = False

    def __post_init__(self) -> None:
        if not self.slots or min(self.slots) < 1:
            raise ValueError(f"AppendPolicy.slots must be >= 1 per layer, got {self.slots}")

    def capacity(self, max_len: int) -> int:
        del max_len
        return self.slots[0]

    def capacities(self, num_layers: int, max_len: int) -> tuple[int, ...]:
        del max_len
        if num_layers != len(self.slots):
            raise ValueError(
                f"AppendPolicy has slots for {len(self.slots)} layers, the model has {num_layers}"
            )
        return self.slots

    def cache_spec(self, *, batch, num_layers, num_kv_heads, head_dim, max_len, dtype) -> Any:
        spec = super().cache_spec(
            batch=batch, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
            max_len=max_len, dtype=dtype,
        )  # fmt: skip
        return dataclasses.replace(spec, pooled=True) if self.pooled else spec

    def write(self, layer, k_new, v_new, pos_new, valid, stats, state, *, layer_index):
        del stats, state, layer_index
        if layer.head is not None:
            return _append_pooled(layer, k_new, v_new, pos_new, valid)
        live = jnp.sum(layer.pos >= 0, axis=-1, dtype=jnp.int32)  # [B, H]
        rank = jnp.cumsum(valid, axis=1, dtype=jnp.int32) - 1  # [B, T]
        slots = live[:, None, :] + rank[:, :, None]  # [B, T, H]
        c = layer.capacity
        slots = jnp.where(valid[:, :, None] & (slots < c), slots, c)
        return write_slots(layer, k_new, v_new, pos_new, slots)


def _append_pooled(layer, k_new, v_new, pos_new, valid):
    """Token t's KV head h into pool slot live + rank(t)·Hkv + h (live = the occupied prefix);
    tokens past the pool are not cached."""
    b, t, h, d = k_new.shape
    p = layer.capacity
    live = jnp.sum(layer.pos[:, 0] >= 0, axis=-1, dtype=jnp.int32)  # [B]
    rank = jnp.cumsum(valid, axis=1, dtype=jnp.int32) - 1  # [B, T]
    heads = jnp.arange(h, dtype=jnp.int32)
    slot = live[:, None, None] + rank[:, :, None] * h + heads[None, None, :]  # [B, T, H]
    slot = jnp.where(valid[:, :, None] & (slot < p), slot, p).reshape(b, t * h)
    bi = jnp.arange(b)[:, None]
    put = lambda a, x: a.at[bi, slot].set(x.reshape(b, t * h, *x.shape[3:]), mode="drop")
    return layer.replace(
        k=put(layer.k[:, 0], k_new.astype(layer.k.dtype))[:, None],
        v=put(layer.v[:, 0], v_new.astype(layer.v.dtype))[:, None],
        pos=put(layer.pos[:, 0], jnp.broadcast_to(pos_new[:, :, None], (b, t, h)))[:, None],
        head=put(layer.head[:, 0], jnp.broadcast_to(heads[None, None, :], (b, t, h)))[:, None],
    )
