"""The ranked region's per-step statistics (`slot_stats`: live slots, first free slot, lowest
priority and its slot) over a stacked region of Llama-3-8B decode shapes, in two forms, on the
current device: µs a call and the kernels XLA compiled for it. A kernel-development aid for the
ranked policies' step (`RankedPolicy._shrink_stacked`).

    python scripts/slot_stats_probe.py [L B H M]        # default 32 8 8 6521 (KVpop at 32K)

Forms: "shared-compare", the form before 2026-12-07: `pos >= 0` shared by the live count, the
first free slot and the priorities' select, the priorities as `RankedPolicy._prio_of` gives them
(empty slots -inf, a second select); "engine", `slot_stats` as it is (the live count and the
first free slot from the positions' sign bit, so that `pos >= 0` has one use) on the
priorities of `RankedPolicy._prio_kept` (no empty-slot select). Both must agree exactly."""

from __future__ import annotations

import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.policies._ranked import _INF, reduce_slot_operands, slot_stats

SINKS, DECAY = 4, 0.005


def _prio(score, pos, empty_select: bool):
    p = score + DECAY * pos.astype(jnp.float32)
    p = jnp.where(pos < SINKS, _INF, p)
    return jnp.where(pos >= 0, p, -_INF) if empty_select else p


def shared_compare(pos, prio):
    """`slot_stats` as it was before 2026-12-07: `pos >= 0` shared by three operands."""
    m = pos.shape[-1]
    idx = jax.lax.broadcasted_iota(jnp.int32, pos.shape, pos.ndim - 1)
    occupied = pos >= 0
    operands = (
        occupied.astype(jnp.int32),
        jnp.where(occupied, m, idx),
        jnp.where(occupied, prio.astype(jnp.float32), _INF),
        idx,
    )
    return reduce_slot_operands(operands, m)


FORMS = {
    "shared-compare": lambda pos, score: shared_compare(pos, _prio(score, pos, True)),
    "engine": lambda pos, score: slot_stats(pos, _prio(score, pos, False)),
}


def main() -> None:
    shape = tuple(int(x) for x in sys.argv[1:5]) if len(sys.argv) > 1 else (32, 8, 8, 6521)
    rng = np.random.default_rng(0)
    pos = rng.integers(0, 32768, shape).astype(np.int32)
    pos[..., ::97] = -1  # some empty slots
    pos, score = jnp.asarray(pos), jnp.asarray(rng.random(shape, np.float32))
    want = None
    for name, form in FORMS.items():
        f = jax.jit(form)
        kernels = len(
            re.findall(
                r"^\s*(?:ROOT )?%\S+ = \S+ fusion\(", f.lower(pos, score).compile().as_text(), re.M
            )
        )
        got = jax.block_until_ready(f(pos, score))
        if want is None:
            want = got
        same = all(bool(jnp.array_equal(a, b)) for a, b in zip(got, want, strict=True))
        loop = jax.jit(
            lambda p, s, f=form: jax.lax.fori_loop(
                0, 50, lambda i, acc: acc + f(p + (i % 2), s)[2].sum(), jnp.float32(0)
            )
        )
        jax.block_until_ready(loop(pos, score))
        times = []
        for _ in range(5):
            t = time.perf_counter()
            jax.block_until_ready(loop(pos, score))
            times.append((time.perf_counter() - t) / 50 * 1e6)
        print(
            f"{name:14s} {np.median(times):8.1f} us a call  fusions {kernels}  "
            f"same as the first: {same}",
            flush=True,
        )


if __name__ == "__main__":
    main()
