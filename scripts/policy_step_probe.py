"""Times the policy's own decode write (all layers, no model) at Llama-3-8B shapes, and the cost
of data-dependent control flow inside a jitted loop on this backend. A debugging aid for the
end-to-end decode benchmark. Usage: python scripts/policy_step_probe.py LAYERS POLICY:BUDGET...
(POLICY@xla / POLICY@pallas: that write_kernel; PROBE_POLICY_ONLY=1 skips the control-flow
timings; PROBE_BATCH=B sets the batch, default 8; PROBE_STACKED=1 times the layer scan's write
over a stacked cache, `write_stack`, instead of the per-layer writes; PROBE_TRACE=DIR also
traces 32 more steps with the JAX profiler and prints each kernel's device time per step and
one step's timeline, `kvjax.eval._profile`; the timeline's marker is the one-launch slot
write, write_kernel pallas)."""

import dataclasses
import os
import sys

import jax
import jax.numpy as jnp

from kvjax.eval._bench import (
    fill_random,
    policy_from_spec,
    policy_seconds_per_step,
    second_call_seconds,
)
from kvjax.eval._profile import device_kernel_times, find_trace, kernel_table, step_timeline
from kvjax.generate import new_cache
from kvjax.models import PRESETS


def control_flow(n_layers: int, steps: int = 64) -> None:
    """ms per step of n_layers small elementwise updates, plain / under a cond / in a while."""
    x = jnp.zeros((n_layers, 8, 8, 12650), jnp.float32)

    def layer_plain(a):
        return a * 0.5 + 1.0

    def layer_cond(a):
        return jax.lax.cond(jnp.any(a > 1e30), lambda y: y * 2.0, layer_plain, a)

    def layer_while(a):
        n = jnp.sum(a > 1e30).astype(jnp.int32)  # 0 rounds, known only on the device
        return jax.lax.fori_loop(0, n, lambda _, y: y * 2.0, layer_plain(a))

    for name, fn in (("plain", layer_plain), ("cond", layer_cond), ("while", layer_while)):
        loop = jax.jit(
            lambda x, fn=fn: jax.lax.fori_loop(
                0, steps, lambda _, x: jnp.stack([fn(x[i]) for i in range(n_layers)]), x
            )
        )
        _, sec = second_call_seconds(loop, x)
        print(f"control flow: {n_layers} layers, {name:6s}: {sec / steps * 1e3:.3f} ms/step")


def main() -> None:
    n_layers = int(sys.argv[1])
    if not os.environ.get("PROBE_POLICY_ONLY"):  # (set under a profiler: the policy's kernels)
        control_flow(n_layers)
    cfg = dataclasses.replace(PRESETS["Llama-3-8B"], num_layers=n_layers)
    for spec in sys.argv[2:]:
        name, budget = spec.split(":")
        pol = policy_from_spec(
            name, int(budget), num_layers=n_layers, sets=os.environ.get("PROBE_SET")
        )
        batch = int(os.environ.get("PROBE_BATCH", "8"))
        stacked = bool(os.environ.get("PROBE_STACKED"))
        cache = new_cache(
            cfg, pol, batch=batch, max_len=32768 + 128, dtype=jnp.bfloat16, stacked=stacked
        )
        cache, key = fill_random(pol, cache, 32768, 2048, jax.random.key(0))
        cache, sec = policy_seconds_per_step(pol, 16, cache, key)
        ms = sec * 1e3
        print(
            f"{name} budget {budget}: {n_layers} layers, batch {batch}, stacked {stacked}, "
            f"policy alone {ms:.3f} ms/step",
            flush=True,
        )
        if os.environ.get("PROBE_TRACE"):
            log_dir = os.path.join(os.environ["PROBE_TRACE"], spec.replace(":", "_"))
            with jax.profiler.trace(log_dir, create_perfetto_trace=True):
                cache, _ = policy_seconds_per_step(pol, 16, cache, key)
            # (the traced call runs the loop twice: second_call_seconds' warm-up and its timing)
            times = device_kernel_times(find_trace(log_dir))
            print(kernel_table(times, steps=32), flush=True)
            if not stacked:  # one step in time order: where the device idles (launch gaps, the
                # cond's sync); the stacked write has no per-layer slot-write kernel to mark it
                print(step_timeline(find_trace(log_dir), "kvjax_slot_write"), flush=True)


if __name__ == "__main__":
    main()
