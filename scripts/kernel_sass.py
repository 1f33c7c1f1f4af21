"""Compiles one decode-kernel row for an H200 without a GPU and counts its main loop's SASS
instructions per token (a kernel-development aid: compare variants before spending GPU time).

Usage: python scripts/kernel_sass.py ROW [KNOB=V ...] [--dump FILE]
  ROW: pallas-bf16, pallas-int8, pallas-int4 or pallas-int2 (B=8, S=32768, Hq 32, Hkv 8,
  D 128, the bench's shapes); KNOB: block_k, num_warps, num_stages, int8_qk, v_words, stack_pages,
  asm_unpack, tokens_m (default: the H200 tuning); value_group (the cache's channels per value
  group, default 32) and bf16_stats=1 (the low-bit statistics in bfloat16, as the cache stores
  them since 2026-12-01; default float32, as the calibration ran): layout options, not kernel
  knobs. --dump FILE also writes the kernel's whole SASS to FILE and its Triton GPU IR (the
  layouts Triton chose) to FILE.ttgir.
  ROW api-bf16 [BATCH]: every Triton kernel `decode_attention` launches for a lone bfloat16 full
  tier (the attention kernel and `combine_triton`) at batch BATCH (default 8), each compiled and
  its resources printed (registers, shared memory, SASS instructions).
Needs a second Python with the `triton` package (its compiler targets sm_90 with no GPU), named
by TRITON_PYTHON, e.g.: python3.12 -m venv /tmp/tv && /tmp/tv/bin/pip install triton==3.9.0;
TRITON_PYTHON=/tmp/tv/bin/python python scripts/kernel_sass.py pallas-int4 stack_pages=1
"""

import functools
import json
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp

from kvjax.eval._kernel_ir import abstract_tiers, sass_loop_stats, triton_ir
from kvjax.pallas_kernels.decode_attention import (
    decode_attention_lowbit_triton,
    decode_attention_triton,
)
from kvjax.pallas_kernels.decode_attention._triton_lowbit import stacked_block_k
from kvjax.pallas_kernels.decode_attention._tuning import num_splits, tuning_for

# Runs in TRITON_PYTHON: TTIR file → cubin → SASS (cuobjdump ships with triton) on stdout.
_COMPILE = """
import os, subprocess, sys, tempfile, triton
from triton.backends.compiler import GPUTarget
path, warps, stages = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
k = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=warps, num_stages=stages))
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
    f.write(k.asm["cubin"])
res = subprocess.run([tool, "-res-usage", "-sass", f.name], capture_output=True, text=True)
print(res.stdout)
print("SHARED_BYTES", k.metadata.shared)
with open(path + ".ttgir", "w") as f:
    f.write(k.asm["ttgir"])
"""

B, HKV, G, D, S, PAGE, VG = 8, 8, 4, 128, 32768, 32, 32
ROWS = {"pallas-bf16": None, "pallas-int8": 8, "pallas-int4": 4, "pallas-int2": 2}

args = sys.argv[1:]


def _compile(kernel: dict) -> tuple[str, str]:
    """(SASS, path of its Triton IR file) of one kernel of `triton_ir`, compiled by
    TRITON_PYTHON's triton (the Triton GPU IR it chose is written beside that file)."""
    with tempfile.NamedTemporaryFile("w", suffix=".ttir", delete=False) as kf:
        kf.write(kernel["ttir"])
    python = os.environ.get("TRITON_PYTHON", "python3")
    out = subprocess.run(
        [python, "-c", _COMPILE, kf.name, str(kernel["num_warps"]), str(kernel["num_stages"])],
        capture_output=True,
        text=True,
    )
    if out.returncode:
        raise SystemExit(f"compiling with {python} (needs `triton`) failed:\n{out.stderr[-2000:]}")
    return out.stdout, kf.name


if args and args[0] == "api-bf16":
    from kvjax.pallas_kernels.decode_attention import decode_attention

    batch = int(args[1]) if len(args) > 1 else B
    full = abstract_tiers(batch, HKV, D, S, S, S // PAGE, PAGE, VG, 2, jnp.bfloat16)[0]
    q = jax.ShapeDtypeStruct((batch, HKV, G, D), jnp.bfloat16)
    q_pos = jax.ShapeDtypeStruct((batch,), jnp.int32)
    api = lambda q, tier, p: decode_attention(q, p, full=tier, scale=D**-0.5)
    for kernel in triton_ir(api, q, full, q_pos):
        sass = _compile(kernel)[0]
        res = [line.strip() for line in sass.splitlines() if "REG:" in line][:1]
        count = len(re.findall(r"^\s*/\*[0-9a-f]{4}\*/", sass, re.M))
        print(json.dumps(dict(kernel=kernel["name"], batch=batch, resources=res, sass=count)))
    raise SystemExit(0)
dump = None
if "--dump" in args:
    at = args.index("--dump")
    if at + 1 >= len(args):
        raise SystemExit("--dump needs a FILE")
    dump = args.pop(at + 1)
    args.pop(at)
if not args or args[0] not in ROWS:
    raise SystemExit(f"usage: kernel_sass.py ROW [KNOB=V ...]; ROW one of {list(ROWS)}")
row, bits = args[0], ROWS[args[0]]
knobs = {k: int(v) for k, v in (a.split("=", 1) for a in args[1:])}
tune = tuning_for("NVIDIA H200")
q = jax.ShapeDtypeStruct((B, HKV, G, D), jnp.bfloat16)
q_pos = jax.ShapeDtypeStruct((B,), jnp.int32)
vg = knobs.pop("value_group", VG)
stat_dt = jnp.bfloat16 if knobs.pop("bf16_stats", 0) else jnp.float32
full, int8, lowbit = abstract_tiers(
    B, HKV, D, S, S, S // PAGE, PAGE, vg, bits or 2, jnp.bfloat16, stat_dtype=stat_dt
)
kw = dict(scale=D**-0.5, num_warps=knobs.pop("num_warps", tune.num_warps))
if bits in (2, 4):
    tm = bool(knobs.pop("tokens_m", tune.lowbit_tokens_m))
    stack = bool(knobs.pop("stack_pages", tune.lowbit_stack_pages and not tm))
    kw["tokens_m"] = tm
    kw["asm_unpack"] = bool(knobs.pop("asm_unpack", tune.lowbit_asm_unpack))
    block = knobs.pop(
        "block_k",
        stacked_block_k(PAGE, G, tune.lowbit_stacked_pages) if stack else tune.lowbit_block_k,
    )
    stages = knobs.pop("num_stages", tune.lowbit_num_stages)
    kw |= dict(bits=bits, stack_pages=stack, num_stages=stages)
    fn, tier = decode_attention_lowbit_triton, lowbit
else:
    block = knobs.pop("block_k", tune.block_k)
    kw |= dict(num_stages=knobs.pop("num_stages", tune.num_stages))
    if bits == 8:
        kw["int8_qk"] = bool(knobs.pop("int8_qk", tune.int8_qk))
        kw["v_words"] = bool(knobs.pop("v_words", tune.int8_v_words))
    fn, tier = decode_attention_triton, (int8 if bits == 8 else full)
if knobs:
    raise SystemExit(f"unknown or inapplicable knobs for {row}: {sorted(knobs)}")
kw |= dict(block_k=block, num_splits=num_splits(B, HKV, -(-S // block), tune.target_programs))
[kernel] = triton_ir(functools.partial(fn, **kw), q, tier, q_pos)
sass, ttir_path = _compile(kernel)
if dump:  # the SASS, and the Triton GPU IR (layouts chosen) beside it
    with open(dump, "w") as f:
        f.write(sass)
    os.replace(f"{ttir_path}.ttgir", f"{dump}.ttgir")
res = [line.strip() for line in sass.splitlines() if "REG:" in line]
stats = sass_loop_stats(sass, block)
top = {k: round(v, 2) for k, v in list(stats["ops"].items())[:40]}
report = dict(
    row=row,
    knobs=kw | {"block_k": block, "value_group": vg, "stats": jnp.dtype(stat_dt).name},
    resources=res[:1],
    shared_bytes=int(sass.split("SHARED_BYTES")[-1]),
    loop_instructions=stats["instructions"],
    per_token=round(stats["per_token"], 2),
    ops_per_token=top,
)
print(json.dumps(report, indent=1))
