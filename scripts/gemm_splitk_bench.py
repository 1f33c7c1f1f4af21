"""Device time of a decode GEMM (few rows x a bfloat16 weight, float32 result) as XLA runs it,
against a split-K form written in jnp (the weight viewed as [S, K/S, N], one batched dot, then
the sum over S): do the projections whose N or K starve the chip of tiles go faster split?
A debugging aid for the decode step's GEMMs (Llama-3-8B's shapes by default).

Usage: python scripts/gemm_splitk_bench.py [ROWS] (default 8). One JSON line per (K, N, S):
µs per call from a jitted loop of 100 calls, and the weight's read bandwidth.
"""

import json
import sys
import time

import jax
import jax.numpy as jnp

CALLS = 100
SHAPES = ((4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096))  # q/o, k/v, gate/up, down


def project(x, w, splits: int):
    if splits == 1:
        return jnp.einsum("mk,kn->mn", x, w, preferred_element_type=jnp.float32)
    k, n = w.shape
    xs = x.reshape(x.shape[0], splits, k // splits)
    parts = jnp.einsum("msk,skn->msn", xs, w.reshape(splits, k // splits, n),
                       preferred_element_type=jnp.float32)  # fmt: skip
    return parts.sum(axis=1)


def us_per_call(x, w, splits: int) -> float:
    def loop(x, w):
        def body(_, acc):
            y = project((x + acc[:, :1].astype(x.dtype)), w, splits)
            return acc + 1e-30 * y[:, : acc.shape[1]]

        return jax.lax.fori_loop(0, CALLS, body, jnp.zeros((x.shape[0], 8), jnp.float32))

    run = jax.jit(loop)
    run(x, w).block_until_ready()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        run(x, w).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return best / CALLS * 1e6


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    for k, n in SHAPES:
        w = jax.random.normal(jax.random.key(k + n), (k, n), jnp.bfloat16)
        x = jax.random.normal(jax.random.key(1), (rows, k), jnp.bfloat16)
        for splits in (1, 2, 4, 8):
            us = us_per_call(x, w, splits)
            tbps = k * n * 2 / us / 1e6
            row = dict(rows=rows, k=k, n=n, splits=splits, us=round(us, 2), tbps=round(tbps, 3))
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
