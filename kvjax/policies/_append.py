"""Append-only slots after a one-time compression (kvpress's protocol): the context was
compressed once before the question; the question and answer then append into the free slots
and never evict a context token."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

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
        slots: slots per KV head of each layer (the kept context plus the room).
    """

    name = "append"
    uses_attention_mass: ClassVar[bool] = False
    slots: tuple[int, ...]

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

    def write(self, layer, k_new, v_new, pos_new, valid, stats, state, *, layer_index):
        del stats, state, layer_index
        live = jnp.sum(layer.pos >= 0, axis=-1, dtype=jnp.int32)  # [B, H]
        rank = jnp.cumsum(valid, axis=1, dtype=jnp.int32) - 1  # [B, T]
        slots = live[:, None, :] + rank[:, :, None]  # [B, T, H]
        c = layer.capacity
        slots = jnp.where(valid[:, :, None] & (slots < c), slots, c)
        return write_slots(layer, k_new, v_new, pos_new, slots)
