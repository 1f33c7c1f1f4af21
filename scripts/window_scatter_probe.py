"""Times the ways to write whole windows of rows into a large cache array on this device (the
QEvict move loop's K/V writes): n windows of w rows [w, D] bf16 into [R, D] at sorted,
distinct row starts, a few dropped (start R). A debugging aid.

Usage: python scripts/window_scatter_probe.py [N_WINDOWS] [ROWS]  (default 32768, 13.4M)
Variants: rows (one index a row), windows (one index a window), windows with
indices_are_sorted/unique_indices, and the same over the rows seen as uint32 pairs.
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

W, D = 8, 128


def scatter_windows(a, start, x, sorted_unique=False):
    dn = jax.lax.ScatterDimensionNumbers(
        update_window_dims=(1, 2), inserted_window_dims=(), scatter_dims_to_operand_dims=(0,)
    )
    return jax.lax.scatter(
        a, start[:, None], x, dn, mode="drop",
        indices_are_sorted=sorted_unique, unique_indices=sorted_unique,
    )  # fmt: skip


def as_u32(x):
    return jax.lax.bitcast_convert_type(x.reshape(*x.shape[:-1], D // 2, 2), jnp.uint32)


def variants():
    def rows(a, start, x):
        r = (start[:, None] + jnp.arange(W)[None, :]).reshape(-1)
        return a.at[r].set(x.reshape(-1, D), mode="drop")

    return {
        "rows": rows,
        "windows": scatter_windows,
        "windows+sorted": lambda a, s, x: scatter_windows(a, s, x, True),
        "u32 windows": lambda a, s, x: scatter_windows(a, s, x),
        "u32 windows+sorted": lambda a, s, x: scatter_windows(a, s, x, True),
    }


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
    r = int(sys.argv[2]) if len(sys.argv) > 2 else 13_410_304
    rng = np.random.default_rng(0)
    start = np.sort(rng.choice(r // W - 1, n, replace=False)) * W
    start[-n // 16 :] = r  # dropped entries, at the end as the move loop's are
    start = jnp.asarray(start, jnp.int32)
    x = jnp.asarray(rng.standard_normal((n, W, D)), jnp.bfloat16)
    for name, fn in variants().items():
        u32 = name.startswith("u32")
        a = jnp.zeros((r, D // 2), jnp.uint32) if u32 else jnp.zeros((r, D), jnp.bfloat16)
        xs = as_u32(x) if u32 else x
        step = jax.jit(lambda a, s, x, fn=fn: fn(a, s, x), donate_argnums=0)
        a = step(a, start, xs)
        jax.block_until_ready(a)
        t = time.perf_counter()
        for _ in range(20):
            a = step(a, start, xs)
        jax.block_until_ready(a)
        us = (time.perf_counter() - t) / 20 * 1e6
        mb = n * W * D * 2 / 1e6
        print(f"{name:20s} {us:8.1f} us  ({mb / us:.2f} TB/s of updates)", flush=True)


if __name__ == "__main__":
    main()
