"""Pallas calls under `shard_map`: kernels do not partition themselves, so on a mesh each device
runs them on its own (sequence, KV head) blocks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.sharding._axes import Axis, Names
from kvjax.sharding._place import active_layout

Array = jax.Array


def map_slot_writes(kernel: Callable[..., Any], writes: tuple[Any, ...], **knobs: Any) -> Any:
    """`kernel(*writes, **knobs)` (the slot-write kernel, `kvjax.pallas_kernels.slot_write`),
    per device when a layout is active.

    Each write is a SlotWrite(slots [B, H, N] int32, arrays [B, H, C(, D)], rows [B, H, N(, D)]).
    With the slot axis split (context-parallel) every device shifts the global slot indices to
    its own range; rows aimed at another device's slots are dropped (the kernel drops indices
    outside [0, C)), so each row is written exactly once, where its slot lives.
    """
    layout = active_layout()
    if layout is None:
        return kernel(*writes, **knobs)
    b, h, c = Axis.BATCH, Axis.KV_HEADS, Axis.SLOTS
    spec = lambda x, slot: layout.spec(Names((b, h, c if slot else None) + (None,) * (x.ndim - 3)))
    in_specs = tuple(
        type(w)(
            spec(w.slots, False),
            tuple(spec(a, True) for a in w.arrays),
            tuple(spec(r, False) for r in w.rows),
        )
        for w in writes
    )
    out_specs = tuple(tuple(spec(a, True) for a in w.arrays) for w in writes)
    seq = layout.mesh_axis(c)

    def local(*ws):
        if seq is not None:
            ws = tuple(
                w._replace(slots=_local_slots(w.slots, w.arrays[0].shape[2], seq)) for w in ws
            )
        return kernel(*ws, **knobs)

    return jax.shard_map(
        local, mesh=layout.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
    )(*writes)


def _local_slots(slots: Array, local_capacity: int, axis: str) -> Array:
    """Global slot indices → this device's (local_capacity = out of range: dropped)."""
    s = slots - jax.lax.axis_index(axis).astype(jnp.int32) * local_capacity
    return jnp.where((s >= 0) & (s < local_capacity), s, local_capacity)


def slots_sharded() -> bool:
    """Whether the code being traced splits the cache's slot axis over devices."""
    layout = active_layout()
    return layout is not None and layout.axis_size(Axis.SLOTS) > 1


def take_slots(arrays: tuple[Array, ...], slots: Array) -> tuple[Array, ...]:
    """`a[b, h, slots[b, h, n]]` of each array [B, H, C(, ...)] (slots [B, H, N] int32 in
    [0, C)), as rows [B, H, N(, ...)].

    With the slot axis split (context-parallel) each device reads the rows its own slots hold
    (zeros elsewhere) and one psum over the slot axis merges them: only the N rows cross
    devices, never a slot shard (a plain gather there would reshard the arrays first).
    """
    # (slots in range: a "clip" gather needs no bounds mask, a simpler kernel to compile)
    take = lambda a, idx: jnp.take_along_axis(
        a, idx.reshape(idx.shape + (1,) * (a.ndim - 3)), 2, mode="clip"
    )
    if not slots_sharded():
        return tuple(take(a, slots) for a in arrays)
    layout = active_layout()
    seq = layout.mesh_axis(Axis.SLOTS)
    b, h, c = Axis.BATCH, Axis.KV_HEADS, Axis.SLOTS
    spec = lambda x, slot: layout.spec(Names((b, h, c if slot else None) + (None,) * (x.ndim - 3)))

    def local(slots, *arrays):
        width = arrays[0].shape[2]
        s = slots - jax.lax.axis_index(seq).astype(jnp.int32) * width
        mine = (s >= 0) & (s < width)
        s = jnp.clip(s, 0, width - 1)
        rows = []
        for a in arrays:
            row = take(a, s)
            rows.append(jnp.where(mine.reshape(mine.shape + (1,) * (a.ndim - 3)), row, 0))
        return tuple(jax.lax.psum(r, seq) for r in rows)

    return jax.shard_map(
        local,
        mesh=layout.mesh,
        in_specs=(spec(slots, False),) + tuple(spec(a, True) for a in arrays),
        out_specs=tuple(spec(a, False) for a in arrays),
        check_vma=False,
    )(slots, *arrays)
