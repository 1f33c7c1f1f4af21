"""Where QEvict's first call goes on the CPU: its scanned decode loop compiled whole, without
the routing event's data movement, and without the event at all (SmolLM2 shapes, budget 256,
1K context, random-init weights; the loop as `scripts/compile_times.py --stacked` builds it).

    .venv/bin/python scripts/qevict_compile_parts.py

The parts are cut out by replacing them for the measurement only: `apply_moves_stacked` by
the layers as they are ("no moves"), and also the event's loop by its initial carry ("no
event"). What is left compiles the same scores, ring writes and attention. One JSON line per
part: `compile_times.py`'s fields (trace + lower and XLA compile CPU seconds, ...) and the
distinct kernels XLA:CPU emitted for the loop (object files in an `--xla_dump_to` folder).
Each part runs in its own process (XLA's flags are read once per process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

PARTS = ("whole", "no moves", "no event")


def _measure(part: str) -> None:
    from unittest import mock

    import jax
    import jax.numpy as jnp
    from compile_times import measure  # this folder's: the same loop, lowering and timers

    import kvjax.policies._qevict as qevict
    from kvjax.models import PRESETS, init_params, stack_params

    jax.config.update("jax_enable_compilation_cache", False)
    patches = []
    if part != "whole":
        patches.append(
            mock.patch.object(qevict, "apply_moves_stacked", lambda job, *a, **k: job.layer)
        )
    if part == "no event":
        loop = jax.lax.while_loop

        def no_event(cond, body, init):
            route = isinstance(init, tuple) and len(init) == 3 and hasattr(init[1], "fp_ledger")
            return init if route else loop(cond, body, init)

        patches.append(mock.patch.object(jax.lax, "while_loop", no_event))
    config = PRESETS["SmolLM2-135M"]
    params = stack_params(init_params(config, jax.random.key(0), dtype=jnp.float32), config)
    for p in patches:
        p.start()
    row = measure(config, params, "qevict", 256, 1024, 1, 4, True)
    print(json.dumps(dict(part=part, **row)))


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--part":
        _measure(sys.argv[2])
        return
    for part in PARTS:
        with tempfile.TemporaryDirectory() as dump:
            env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={dump}")
            print(f"{part} ...", file=sys.stderr, flush=True)
            out = subprocess.run(
                [sys.executable, __file__, "--part", part],
                env=env, capture_output=True, text=True, check=True,
            )  # fmt: skip
            row = json.loads(out.stdout.strip().splitlines()[-1])
            row["kernels"] = sum("jit__decode" in f and "obj-file" in f for f in os.listdir(dump))
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
