"""Decode GEMMs of a layer scan: XLA's dot on each layer's slice of the stacked weights against
a Pallas (Triton) weight-streaming GEMM that reads the stack in place (`_kernel` below: each
program streams [block_k, block_n] tiles of its columns against the rows padded to 16, splits
of K summed by XLA after the launch). The kernel lost to cuBLAS at every shape and stays here,
an experiment; what the probe showed instead is that fused weights (q|k|v, gate|up) stream
faster than separate ones (docs/lab/2026-12-06-h100-decode-gemms.md).

Usage: python scripts/decode_matmul_probe.py [ROWS] [KNOB=V,V ...]
For each weight of a Llama-3-8B layer (q, k, v, o, gate, up, down; and q|k|v, gate|up
concatenated), 32 layers stacked in bfloat16, times a `lax.scan` over the layers that multiplies
ROWS rows (default 8) by each layer's weight: µs of device kernels a layer (from a profiler
trace: the scan's own overhead left out) and the weight's TB/s, XLA's dot first,
then the kernel at every setting of the KNOB grid (block_n, block_k, num_splits, num_warps,
num_stages; e.g. block_n=64,128 num_splits=1,4). Run with the layer scan's XLA flags (cuBLAS:
`XLA_FLAGS=--xla_gpu_enable_triton_gemm=false`). Prints a table, then JSON on the last line.
"""

import functools
import itertools
import json
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kvjax.eval._profile import device_kernel_times, find_trace
from kvjax.pallas_kernels.decode_attention._triton import whole_spec

LAYERS = 32
ROWS = 16  # the rows a program multiplies (Triton's smallest dot): M is padded to it


def _kernel(layer_ref, x_ref, w_ref, o_ref, *, block_k: int, block_n: int, per_split: int):
    # layer_ref [] int32; x_ref [ROWS, K] (whole); w_ref [L, K, N] (whole, read at the layer);
    # o_ref [1, ROWS, block_n] float32: this program's partial of its columns
    lay = layer_ref[()]
    n0 = pl.program_id(0) * block_n
    k_first = pl.program_id(1) * per_split

    def step(i, acc):
        k0 = pl.multiple_of(k_first + i * block_k, block_k)
        xb = x_ref[:, pl.ds(k0, block_k)]  # [ROWS, block_k]
        wb = w_ref[lay, pl.ds(k0, block_k), pl.ds(n0, block_n)]  # [block_k, block_n]
        return acc + jnp.dot(xb, wb, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, per_split // block_k, step, jnp.zeros((ROWS, block_n), jnp.float32))
    o_ref[0] = acc


@functools.partial(
    jax.jit,
    static_argnames=("block_k", "block_n", "num_splits", "num_warps", "num_stages", "interpret"),
)
def _launch(x, w, layer, *, block_k, block_n, num_splits, num_warps, num_stages, interpret):
    m, k = x.shape
    n = w.shape[2]
    xp = jnp.pad(x, ((0, ROWS - m), (0, 0)))
    lay = jnp.asarray(layer, jnp.int32)
    part = pl.pallas_call(
        functools.partial(_kernel, block_k=block_k, block_n=block_n, per_split=k // num_splits),
        grid=(n // block_n, num_splits),
        in_specs=[whole_spec(lay), whole_spec(xp), whole_spec(w)],
        out_specs=pl.BlockSpec((1, ROWS, block_n), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((num_splits, ROWS, n), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="kvjax_decode_matmul",
    )(lay, xp, w)
    return part.sum(axis=0)[:m] if num_splits > 1 else part[0, :m]


SHAPES = {  # name: (K, N)
    "q": (4096, 4096), "k": (4096, 1024), "v": (4096, 1024), "o": (4096, 4096),
    "gate": (4096, 14336), "up": (4096, 14336), "down": (14336, 4096),
    "qkv": (4096, 6144), "gate_up": (4096, 28672),
}  # fmt: skip
DEFAULTS = {"block_n": 64, "block_k": 128, "num_splits": 0, "num_warps": 4, "num_stages": 4}


def splits_for(k: int, n: int, block_n: int, block_k: int) -> int:
    """Splits of K giving at least 2 programs a multiprocessor (132)."""
    s = 1
    while (n // block_n) * s < 264 and k // (2 * s) >= block_k and (k // (2 * s)) % block_k == 0:
        s *= 2
    return s


def timed(fn, *args, reps: int = 5) -> float:
    """Seconds of device kernels a call (a profiler trace of `reps` calls): the scan's own
    per-layer overhead (its loop, launch gaps) is left out, as it is the same for both."""
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(reps):
                jax.block_until_ready(fn(*args))
        times = device_kernel_times(find_trace(d))
    return sum(us for us, _ in times.values()) / reps / 1e6


def main() -> None:
    args = sys.argv[1:]
    rows = int(args[0]) if args and "=" not in args[0] else 8
    grid = {
        k: [int(v) for v in vs.split(",")] for k, vs in (a.split("=") for a in args if "=" in a)
    }
    knobs = {k: grid.get(k, [v]) for k, v in DEFAULTS.items()}
    only = os.environ.get("SHAPES", "").split(",") if os.environ.get("SHAPES") else list(SHAPES)
    print(f"{jax.devices()[0].device_kind}, rows {rows}, {LAYERS} layers", flush=True)
    x = jax.random.normal(jax.random.key(0), (rows, 14336), jnp.float32).astype(jnp.bfloat16)
    out = []
    for name in only:
        k, n = SHAPES[name]
        w = jax.random.normal(jax.random.key(1), (LAYERS, k, n), jnp.bfloat16)
        xk = x[:, :k]
        gb = LAYERS * k * n * 2 / 1e9

        @jax.jit
        def xla(xk, w):
            def body(c, wl):
                return c, jnp.einsum("mk,kn->mn", xk, wl, preferred_element_type=jnp.float32)

            return jax.lax.scan(body, 0, w)[1]

        sec = timed(xla, xk, w)
        ref = xla(xk, w)
        row = {"name": name, "K": k, "N": n, "impl": "xla", "us_layer": sec / LAYERS * 1e6,
               "TBps": gb / sec / 1e3}  # fmt: skip
        us, tb = row["us_layer"], row["TBps"]
        print(f"{name:8s} K={k:5d} N={n:5d} xla      {us:8.2f} us {tb:.2f} TB/s", flush=True)
        out.append(row)
        for vals in itertools.product(*knobs.values()):
            kn = dict(zip(knobs, vals, strict=True))
            if n % kn["block_n"] or k % kn["block_k"]:
                continue
            kn["num_splits"] = kn["num_splits"] or splits_for(k, n, kn["block_n"], kn["block_k"])
            if (k // kn["num_splits"]) % kn["block_k"]:
                continue

            @jax.jit
            def pal(xk, w, kn=kn):
                def body(c, layer):
                    return c, _launch(xk, w, layer, interpret=False, **kn)

                return jax.lax.scan(body, 0, jnp.arange(LAYERS))[1]

            try:
                sec = timed(pal, xk, w)
                err = float(jnp.abs(pal(xk, w) - ref).max() / jnp.abs(ref).max())
            except Exception as e:  # noqa: BLE001 (a setting that does not compile: say so)
                print(f"{name:8s} {kn}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            row = {"name": name, "K": k, "N": n, "impl": "pallas", **kn}
            row.update(us_layer=sec / LAYERS * 1e6, TBps=gb / sec / 1e3, rel_err=err)
            print(f"{name:8s} K={k:5d} N={n:5d} pallas   {row['us_layer']:8.2f} us "
                  f"{row['TBps']:.2f} TB/s err {err:.1e} {kn}", flush=True)  # fmt: skip
            out.append(row)
        del w
    print(json.dumps(out))


if __name__ == "__main__":
    main()
