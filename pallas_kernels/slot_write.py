"""Writes a few token rows per (sequence, KV head) into several cache arrays in one launch.

A decode step of a ranked policy writes one token into the INT8 tier (codes, scales, position,
score: six arrays) and one into the full-precision ring (four arrays). As XLA scatters that is
ten kernels per layer, each moving a few hundred bytes; on the GPU the step is launch-bound
(docs/benchmarks.md). `write_slots` does all of them in one Pallas (Triton) kernel over the
grid (B, Hkv, writes) whose outputs alias the arrays, so nothing but the written rows moves. The
result equals `a.at[b, h, slots].set(rows, mode="drop")` per array (tested against it).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax.pallas_kernels._words import as_words, from_words

Array = jax.Array


class SlotWrite(NamedTuple):
    """Rows to write into arrays that share a slot axis.

    Attributes:
        slots: [B, H, N] int32 slot of each row; outside [0, C) means the row is dropped
            (negative slots too, where a jnp scatter would wrap them). The N slots of a head
            must differ (or be dropped).
        arrays: cache arrays, each [B, H, C] or [B, H, C, D].
        rows: one per array, [B, H, N] or [B, H, N, D], cast to the array's dtype.
    """

    slots: Array
    arrays: tuple[Array, ...]
    rows: tuple[Array, ...]


def _check(writes: tuple[SlotWrite, ...]) -> None:
    if not writes:
        raise ValueError("write_slots needs at least one SlotWrite")
    b, h = writes[0].slots.shape[:2]
    for i, w in enumerate(writes):
        if w.slots.ndim != 3 or w.slots.shape[:2] != (b, h) or w.slots.dtype != jnp.int32:
            raise ValueError(
                f"write {i}: slots must be int32 [B={b}, H={h}, N], got "
                f"{w.slots.dtype}{list(w.slots.shape)}"
            )
        if not w.arrays or len(w.arrays) != len(w.rows):
            raise ValueError(f"write {i}: {len(w.arrays)} arrays but {len(w.rows)} rows")
        n = w.slots.shape[2]
        for j, (a, r) in enumerate(zip(w.arrays, w.rows, strict=True)):
            want = (b, h, n, *a.shape[3:])
            if a.ndim not in (3, 4) or a.shape[:2] != (b, h) or r.shape != want:
                raise ValueError(
                    f"write {i}, array {j}: array {list(a.shape)} must be [B, H, C(, D)] with "
                    f"rows {list(want)}, got rows {list(r.shape)}"
                )


def _kernel(*refs, layout: tuple[tuple[int, int], ...]):
    """refs: per write (slots, arrays..., rows...) inputs, then per write arrays... outputs.

    layout: per write (number of arrays, N). Program (b, h, w) does write w of head (b, h): the
    writes of one head run side by side, not one after another in a single program (32 layers
    of confkv in one program took 69 µs on the H200, docs/lab/2026-12-01-policy-trace.md)."""
    n_in = sum(1 + 2 * k for k, _ in layout)
    ins, outs = refs[:n_in], refs[n_in:]
    i = o = 0
    for w, (k, n) in enumerate(layout):
        slots_ref, row_refs = ins[i], ins[i + 1 + k : i + 1 + 2 * k]

        @pl.when(pl.program_id(2) == w)
        def _(slots_ref=slots_ref, row_refs=row_refs, out_refs=outs[o : o + k], n=n):
            for out_ref, row_ref in zip(out_refs, row_refs, strict=True):
                cap = out_ref.shape[0]
                for r in range(n):  # N is small and static
                    slot = slots_ref[r]
                    ok = (slot >= 0) & (slot < cap)
                    at = pl.ds(jnp.clip(slot, 0, cap - 1), 1)
                    val = row_ref[pl.ds(r, 1)].astype(out_ref.dtype)
                    plgpu.store(out_ref.at[at], val, mask=jnp.broadcast_to(ok, val.shape))

        i += 1 + 2 * k
        o += k


def _head(a: Array) -> pl.BlockSpec:
    """One (sequence, KV head)'s whole slice of a [B, H, ...] array."""
    tail = a.shape[2:]
    return pl.BlockSpec((None, None, *tail), lambda b, h, w: (b, h) + (0,) * len(tail))


@functools.partial(jax.jit, static_argnames=("interpret",))
def write_slots(*writes: SlotWrite, interpret: bool = False) -> tuple[tuple[Array, ...], ...]:
    """Every write's rows into its arrays' slots, all in one kernel; returns the new arrays
    (per write, in order). Donate or drop the old arrays for the update to happen in place.

    Args:
        writes: SlotWrite groups (different groups may have different slot axes).
        interpret: run in the Pallas interpreter (CPU tests).
    """
    _check(writes)
    views = [tuple(_wide(a) for a in w.arrays) for w in writes]
    writes = tuple(
        w._replace(
            arrays=tuple(x for x, _ in v),
            rows=tuple(
                r if x is a else _wide(r.astype(a.dtype))[0]
                for r, (x, a) in zip(w.rows, v, strict=True)
            ),
        )
        for w, v in zip(writes, views, strict=True)
    )
    b, h = writes[0].slots.shape[:2]
    inputs, in_specs, out_specs, out_shape, aliases, layout = [], [], [], [], {}, []
    for w in writes:
        inputs.append(w.slots)
        in_specs.append(_head(w.slots))
        for a in w.arrays:
            aliases[len(inputs)] = len(out_shape)
            inputs.append(a)
            in_specs.append(_head(a))
            out_specs.append(_head(a))
            out_shape.append(jax.ShapeDtypeStruct(a.shape, a.dtype))
        inputs.extend(w.rows)
        in_specs.extend(_head(r) for r in w.rows)
        layout.append((len(w.arrays), w.slots.shape[2]))
    outs = pl.pallas_call(
        functools.partial(_kernel, layout=tuple(layout)),
        grid=(b, h, len(writes)),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="kvjax_slot_write",
    )(*inputs)
    result, o = [], 0
    for v in views:
        result.append(
            tuple(_narrow(x, a) for x, (_, a) in zip(outs[o : o + len(v)], v, strict=True))
        )
        o += len(v)
    return tuple(result)


def _wide(a: Array) -> tuple[Array, Array]:
    """(a view of `a` the kernel indexes safely, `a`): a 1-byte array [..., D] as D/4 int32
    words (or D/2 int16), whose element offsets stay below the lowering's 32-bit limit
    (`kvjax.pallas_kernels._words`); the kernel writes whole rows, so the view is exact."""
    if a.dtype.itemsize != 1 or a.ndim < 4:
        return a, a
    for n in (4, 2):
        if a.shape[-1] % n == 0:
            return as_words(a, n), a
    return a, a


def _narrow(x: Array, a: Array) -> Array:
    """`_wide`'s view back to the array's own dtype and shape."""
    return x if x.dtype == a.dtype else from_words(x, a)
