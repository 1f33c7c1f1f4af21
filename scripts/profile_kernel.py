"""Runs one `kvjax bench kernel` row a few times, for a profiler to catch (a debugging aid).

Usage: python scripts/profile_kernel.py ROW [BATCH CONTEXT] [KNOB=V ...]
e.g. ncu --clock-control none -k regex:kvjax_decode python scripts/profile_kernel.py pallas-int8
With TRACE=DIR it also traces `bench kernel`'s timed loop (16 calls in one jitted fori_loop)
with the JAX profiler and prints every kernel's device time per call (the kernel and what XLA
runs around it: padding, the split combine), `kvjax.eval._profile`.
"""

import os
import sys

import jax
import jax.numpy as jnp

from kvjax.eval._bench_kernel import ROWS, _cases, _timed
from kvjax.eval._profile import device_kernel_times, find_trace, kernel_table

args = sys.argv[1:]
if not args or args[0] not in ROWS or args[0] == "copy":
    raise SystemExit(
        f"usage: profile_kernel.py ROW [BATCH CONTEXT] [KNOB=V ...]; ROW one of {ROWS}"
    )
row, rest = args[0], args[1:]
nums = [a for a in rest if "=" not in a]
batch, context = (int(nums[0]), int(nums[1])) if nums else (8, 32768)
knobs = {k: int(v) for k, v in (a.split("=") for a in rest if "=" in a)}
# PAGE / VALUE_GROUP: the low-bit rows' page size and value group (`bench kernel --page`,
# `--value-group`; QEvict's shape is PAGE=8 VALUE_GROUP=128)
page, group = int(os.environ.get("PAGE", 32)), int(os.environ.get("VALUE_GROUP", 32))
fn, data, nbytes = _cases(batch, context, 32, 8, 128, page, group, jax.random.key(0))[row]()
q = jax.random.normal(jax.random.key(1), (batch, 32, 128), jnp.bfloat16)
f = jax.jit(lambda q, data: fn(q, knobs, data))
for _ in range(3):
    q = f(q, data).astype(q.dtype)
jax.block_until_ready(q)
print(f"{row} B={batch} S={context} {knobs}: ran 3 calls, {nbytes / 1e9:.3f} GB read each")
if os.environ.get("TRACE"):
    calls = 16
    with jax.profiler.trace(os.environ["TRACE"], create_perfetto_trace=True):
        sec, _ = _timed(lambda q, data: fn(q, knobs, data), q, data, iters=calls, repeats=1)
    # (_timed runs its loop twice: a warm-up and the timed call)
    print(f"{sec * 1e6:.1f} us per call under the profiler")
    print(kernel_table(device_kernel_times(find_trace(os.environ["TRACE"])), steps=2 * calls))
