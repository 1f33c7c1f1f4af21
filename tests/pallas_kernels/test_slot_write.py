"""`write_slots` (one kernel for a decode step's slot writes) against XLA scatters.

Compiled on a GPU, in the Pallas interpreter elsewhere; fresh random inputs per case, slots out of
range (dropped) included, two groups with different slot axes in one launch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvjax.pallas_kernels.slot_write import SlotWrite, write_slots

INTERPRET = jax.default_backend() != "gpu"


def _scatter(a, slots, rows):
    b, h, _ = slots.shape
    bi = jnp.arange(b)[:, None, None]
    hi = jnp.arange(h)[None, :, None]
    return a.at[bi, hi, slots].set(rows.astype(a.dtype), mode="drop")


def _group(key, b, h, cap, n, d, dtypes):
    """A SlotWrite with distinct in-range slots per head, some replaced by out-of-range ones."""
    ks = jax.random.split(key, 2 + 2 * len(dtypes))
    perm = jax.vmap(lambda k: jax.random.permutation(k, cap)[:n])(
        jax.random.split(ks[0], b * h)
    ).reshape(b, h, n)
    drop = jax.random.bernoulli(ks[1], 0.3, (b, h, n))
    # dropped rows point past the end (jnp's scatter would wrap a negative slot, not drop it)
    slots = jnp.where(drop, cap + perm % 3, perm).astype(jnp.int32)
    arrays, rows = [], []
    for i, (dt, has_d) in enumerate(dtypes):
        tail = (d,) if has_d else ()
        a = jax.random.normal(ks[2 + 2 * i], (b, h, cap, *tail)) * 50
        r = jax.random.normal(ks[3 + 2 * i], (b, h, n, *tail)) * 50
        arrays.append(a.astype(dt))
        rows.append(r.astype(jnp.float32 if dt != jnp.int8 else dt))
    return SlotWrite(slots, tuple(arrays), tuple(rows))


RING = ((jnp.bfloat16, True), (jnp.bfloat16, True), (jnp.int32, False), (jnp.float32, False))
INT8 = ((jnp.int8, True), (jnp.int8, True), (jnp.int32, False), (jnp.float32, False))
INT8 += ((jnp.float32, False), (jnp.float32, False))


@pytest.mark.parametrize("b, h, n, caps", [(2, 3, 2, (37, 5)), (1, 2, 1, (8, 64))])
@given(seed=st.integers(0, 2**31 - 1))
def test_equals_xla_scatter(b, h, n, caps, seed):
    k1, k2 = jax.random.split(jax.random.key(seed))
    g1 = _group(k1, b, h, caps[0], n, 32, INT8)
    g2 = _group(k2, b, h, caps[1], 1, 32, RING)
    got = write_slots(g1, g2, interpret=INTERPRET)
    for g, out in zip((g1, g2), got, strict=True):
        assert len(out) == len(g.arrays)
        for a, r, o in zip(g.arrays, g.rows, out, strict=True):
            assert o.dtype == a.dtype and o.shape == a.shape
            np.testing.assert_array_equal(np.asarray(o), np.asarray(_scatter(a, g.slots, r)))


@pytest.mark.parametrize("d", [2, 1])
def test_byte_arrays_of_any_width_equal_xla_scatter(d):
    """1-byte arrays go to the kernel as int32 words (D % 4 == 0, the case above), int16 pairs
    (D % 2 == 0) or as they are: every view writes what the scatter writes (widths a power of
    2, as Triton's lowering needs)."""
    g = _group(jax.random.key(d), 2, 2, 9, 2, d, INT8)
    (out,) = write_slots(g, interpret=INTERPRET)
    for a, r, o in zip(g.arrays, g.rows, out, strict=True):
        assert o.dtype == a.dtype and o.shape == a.shape
        np.testing.assert_array_equal(np.asarray(o), np.asarray(_scatter(a, g.slots, r)))


def test_negative_slots_are_dropped():
    g = _group(jax.random.key(3), 2, 2, 8, 1, 16, RING)
    (out,) = write_slots(g._replace(slots=jnp.full_like(g.slots, -1)), interpret=INTERPRET)
    for a, o in zip(g.arrays, out, strict=True):
        np.testing.assert_array_equal(np.asarray(o), np.asarray(a))


def test_bad_inputs_are_named():
    g = _group(jax.random.key(0), 2, 2, 8, 1, 16, RING)
    with pytest.raises(ValueError, match="at least one SlotWrite"):
        write_slots(interpret=True)
    with pytest.raises(ValueError, match="slots must be int32"):
        write_slots(g._replace(slots=g.slots.astype(jnp.float32)), interpret=True)
    with pytest.raises(ValueError, match="4 arrays but 3 rows"):
        write_slots(g._replace(rows=g.rows[:3]), interpret=True)
    with pytest.raises(ValueError, match=r"array 0: array \[2, 2, 8, 16\] must be"):
        write_slots(g._replace(rows=(g.rows[0][..., :8],) + g.rows[1:]), interpret=True)
