"""Compile seconds of the decode loop per policy (random-init model shapes, no cache fill).

    .venv/bin/python scripts/compile_times.py --preset SmolLM2-135M --budget 256 --context 1024 \
        --policy full window qevict confkv-l=512

(NAME=BUDGET gives one policy its own budget; NAME@KERNEL picks a ranked policy's write kernel;
--stacked runs the layers in a scan over a stacked cache, `new_cache(stacked=True)`.)

For each policy: trace + lower seconds, XLA compile seconds (wall and this process's CPU
seconds, which a busy machine disturbs less) of `bench decode`'s decode loop (`_decode`), the
instruction count of its compiled HLO and of the StableHLO it was lowered from. The persistent
compilation cache is not used (each compile is a real one). One JSON line per policy on stdout.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

import jax
import jax.numpy as jnp

from kvjax.eval._bench import _decode, policy_from_spec
from kvjax.generate import new_cache
from kvjax.models import PRESETS, init_params, stack_params

ALL = [
    "full", "window", "streaming", "h2o", "tova", "snapkv", "random", "confkv", "confkv-l=512",
    "kivi", "kvpop", "qevict",
]  # fmt: skip


def _count(text: str) -> int:
    return len(re.findall(r"^\s*(?:ROOT )?%?[\w.\-]+ = ", text, flags=re.M))


def measure(config, params, spec: str, budget: int, context: int, batch: int, steps: int, stacked):
    spec, _, own = spec.partition("=")  # NAME=BUDGET: this policy at its own budget
    budget = int(own) if own else budget
    policy = policy_from_spec(spec, budget, config.num_layers)
    cache = new_cache(
        config, policy, batch=batch, max_len=context, dtype=jnp.float32, stacked=stacked
    )
    tok = jnp.zeros((batch,), jnp.int32)
    t0, c0 = time.perf_counter(), time.process_time()
    lowered = _decode.lower(config, policy, steps, "xla", params, cache, tok)
    t1, c1 = time.perf_counter(), time.process_time()
    compiled = lowered.compile()
    t2, c2 = time.perf_counter(), time.process_time()
    return dict(
        policy=spec,
        budget=budget,
        stacked=stacked,
        lower_s=round(t1 - t0, 2),
        lower_cpu_s=round(c1 - c0, 2),
        compile_s=round(t2 - t1, 2),
        compile_cpu_s=round(c2 - c1, 2),
        total_s=round(t2 - t0, 2),
        total_cpu_s=round(c2 - c0, 2),
        stablehlo_ops=len(re.findall(r"^\s*(?:%\S+ = )?\"?\w+\.\w+", lowered.as_text(), re.M)),
        hlo_ops=_count(compiled.as_text()),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="SmolLM2-135M")
    p.add_argument("--policy", nargs="+", default=ALL)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--stacked", action="store_true", help="layer scan over a stacked cache")
    a = p.parse_args()
    jax.config.update("jax_enable_compilation_cache", False)
    config = PRESETS[a.preset]
    params = init_params(config, jax.random.key(0), dtype=jnp.float32)
    if a.stacked:
        params = stack_params(params, config)
    for spec in a.policy:
        row = measure(config, params, spec, a.budget, a.context, a.batch, a.steps, a.stacked)
        print(json.dumps(row), flush=True)
        print(f"{spec}: compile {row['compile_s']} s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
