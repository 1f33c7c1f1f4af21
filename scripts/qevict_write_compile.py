"""Compile QEvict's stacked write alone at SmolLM2-135M shapes on the CPU: lower and compile CPU
seconds of `jax.jit(write_stack)` (QEvictPolicy(budget=256), 30 layers, batch 1, one decode
token, zero inputs; no persistent compilation cache) and the fusions, scatters and HLO
instructions of the compiled module, as one JSON line.

    PYTHONPATH=$W .venv/bin/python -P scripts/qevict_write_compile.py
    PYTHONPATH=$W .venv/bin/python -P scripts/qevict_write_compile.py --kernels DIR
    PYTHONPATH=$W .venv/bin/python -P scripts/qevict_write_compile.py --kernels DIR --loop
    PYTHONPATH=$W .venv/bin/python -P scripts/qevict_write_compile.py --kernels DIR --loop --top 30

With --kernels it compiles in a child process under XLA's own timers (`TF_CPP_VMODULE`) and an
HLO dump in DIR, and prints, per computation of the compiled module (the routing event's
branch, the move loop's body, ...), the distinct kernels XLA:CPU compiled for it and their
MLIR + LLVM milliseconds (identical fusions are compiled once; library calls such as the
matmuls and sorts are not kernels). --loop does this for the whole scanned decode loop instead
(`scripts/compile_times.py --preset SmolLM2-135M --budget 256 --context 1024 --stacked
--policy qevict`, module `jit__decode`). --top N then lists the N costliest kernels, each with
its milliseconds, output shape and the JAX operation XLA named it after.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import re
import subprocess
import sys
import time

LOOP = [
    "scripts/compile_times.py", "--preset", "SmolLM2-135M", "--budget", "256", "--context",
    "1024", "--stacked", "--policy", "qevict",
]  # fmt: skip


def measure() -> dict:
    import jax
    import jax.numpy as jnp

    from kvjax.attention import AttnStats
    from kvjax.generate import new_cache
    from kvjax.models import PRESETS
    from kvjax.policies import QEvictPolicy

    jax.config.update("jax_enable_compilation_cache", False)
    policy = QEvictPolicy(budget=256)
    cache = new_cache(
        PRESETS["SmolLM2-135M"], policy, batch=1, max_len=1024, dtype=jnp.float32, stacked=True
    )
    layers = cache.layers
    nl, b, h, c = layers.pos.shape
    k_new = jnp.zeros((nl, b, 1, h, layers.k.shape[-1]))
    stats = AttnStats(
        slot_mass=jnp.zeros((nl, b, h, c)), new_mass=jnp.zeros((nl, b, h, 1)),
        lse=jnp.zeros((nl, b, 1, 9)), lowbit_mass=jnp.zeros(layers.lowbit.pos.shape),
    )  # fmt: skip
    args = (layers, k_new, k_new, jnp.zeros((b, 1), jnp.int32), jnp.ones((b, 1), bool), stats)
    write = jax.jit(lambda *a: policy.write_stack(*a, None))
    c0 = time.process_time()
    lowered = write.lower(*args)
    c1 = time.process_time()
    text = lowered.compile().as_text()
    c2 = time.process_time()
    return dict(
        lower_cpu_s=round(c1 - c0, 2),
        compile_cpu_s=round(c2 - c1, 2),
        total_cpu_s=round(c2 - c0, 2),
        fusions=len(re.findall(r"^\s*(?:ROOT )?%?\S+ = \S+ fusion\(", text, re.M)),
        scatters=len(re.findall(r" scatter\(", text)),
        hlo_ops=len(re.findall(r"^\s*(?:ROOT )?%?[\w.\-]+ = ", text, re.M)),
    )


def kernels(dump: str, loop: bool, top: int = 0) -> None:
    env = dict(
        os.environ,
        XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} "
        "--xla_dump_hlo_pass_re=^$",
        TF_CPP_MIN_LOG_LEVEL="0",
        TF_CPP_VMODULE="fusion_compiler=1,ir_compiler=1,cpu_compiler=1",
    )  # fmt: skip
    command, module_name = (LOOP, "jit__decode") if loop else ([__file__], "jit__lambda")
    run = subprocess.run(
        [sys.executable, "-P", *command], env=env, capture_output=True, text=True, check=True
    )
    print(run.stdout.strip())
    (path,) = glob.glob(f"{dump}/*{module_name}.cpu_after_optimizations.txt")
    owner, comp, what = {}, None, {}  # instruction -> its computation; -> (shape, op)
    with open(path) as f:
        text = f.read().splitlines()
    for line in text:
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m and not line.startswith(" "):
            comp = m.group(1)
            continue
        m = re.match(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+) ", line)
        if m:
            owner.setdefault(m.group(1), comp)
            op = re.search(r'op_name="([^"]+)"', line)
            what.setdefault(m.group(1), (m.group(2), op.group(1).split("/")[-1] if op else ""))
    ms, module = collections.defaultdict(float), None
    for line in run.stderr.splitlines():
        m = re.search(r"cpu_compiler.cc:\d+\] Compiling: (\S+)", line)
        if m:
            module = m.group(1)
        m = re.search(r"Compiled (?:MLIR|LLVM) module: (\S+) time: ([\d.]+) (ms|s|us)", line)
        if m and module == module_name:
            name = m.group(1)
            for part in ("__compute_module_", "_kernel_module", "_elemental"):
                name = name.replace(part, "")
            ms[name] += float(m.group(2)) * {"ms": 1, "s": 1000, "us": 1e-3}[m.group(3)]
    per = collections.defaultdict(lambda: [0, 0.0])
    for name, t in ms.items():
        row = per[owner.get(name, "(outside the module's text)")]
        row[0] += 1
        row[1] += t
    for comp, (n, t) in sorted(per.items(), key=lambda x: -x[1][1]):
        print(f"{n:4d} kernels {t:8.1f} ms  {comp}")
    print(f"{len(ms):4d} kernels {sum(ms.values()):8.1f} ms  total")
    for name, t in sorted(ms.items(), key=lambda x: -x[1])[:top]:
        shape, op = what.get(name, ("?", "?"))
        print(f"{t:8.1f} ms  {name}  {shape}  {op}  ({owner.get(name, '?')})")


def _cli(args: list[str]) -> tuple[str, bool, int] | None:
    """(dump dir, --loop, --top N) of `--kernels DIR [--loop] [--top N]`, else None."""
    if len(args) < 2 or args[0] != "--kernels":
        return None
    dump, rest, top = args[1], args[2:], 0
    loop = rest[:1] == ["--loop"]
    rest = rest[1:] if loop else rest
    if rest[:1] == ["--top"] and len(rest) == 2 and rest[1].isdigit():
        top, rest = int(rest[1]), []
    return None if rest else (dump, loop, top)


if __name__ == "__main__":
    if (cli := _cli(sys.argv[1:])) is not None:
        kernels(cli[0], loop=cli[1], top=cli[2])
    elif len(sys.argv) == 1:
        print(json.dumps(measure()), flush=True)
    else:
        sys.exit(__doc__)
