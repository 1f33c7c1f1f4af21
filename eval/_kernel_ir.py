"""The decode kernels as a GPU compiler sees them, without a GPU (a kernel-development aid).

`export_cuda` lowers a function for CUDA under an abstract H200 (jax.export), which runs the
Pallas → Triton lowering of every kernel in it; `triton_ir` also returns the Triton IR (TTIR)
modules that lowering produced; `pallas_calls` finds a traced program's kernel calls and the
operands each is handed (whether a kernel gets a whole layer stack or a slice of it, say).
`sass_loop_stats` reads a kernel's compiled SASS (from
`scripts/kernel_sass.py`, which compiles the TTIR with the `triton` package for sm_90) and
counts the instructions of its main loop per token: on the H200 that count times tokens, heads
and warps matched ncu's executed instructions within 6% for the INT4 and INT8 kernels
(docs/benchmarks.md), so variants can be compared before any GPU time is spent.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import export

from kvjax.pallas_kernels.decode_attention import FullTier, Int8Tier, LowBitTier

H200 = jax.sharding.AbstractMesh(
    (1,),
    ("x",),
    abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"
    ),
)


def abstract_tiers(
    b, hkv, d, cap, int8_cap, pages, page, value_group, bits, dtype, stat_dtype=jnp.float32
):
    """ShapeDtypeStructs of a layer's full (cap slots, `dtype`), INT8 (int8_cap slots) and packed
    low-bit (pages × page tokens at `bits`, statistics in `stat_dtype`) tiers, for lowering
    (jax.export)."""
    sds, f32, i32 = jax.ShapeDtypeStruct, jnp.float32, jnp.int32
    full = FullTier(
        sds((b, hkv, cap, d), dtype),
        sds((b, hkv, cap, d), dtype),
        sds((b, hkv, cap), i32),
        sds((b, hkv), i32),
    )
    int8 = Int8Tier(
        sds((b, hkv, int8_cap, d), jnp.int8),
        sds((b, hkv, int8_cap, d), jnp.int8),
        sds((b, hkv, int8_cap), f32),
        sds((b, hkv, int8_cap), f32),
        sds((b, hkv, int8_cap), i32),
        sds((b, hkv), i32),
    )
    dp, groups = d * bits // 8, d // value_group
    lowbit = LowBitTier(
        sds((b, hkv, pages, page, dp), jnp.uint8),
        sds((b, hkv, pages, page, dp), jnp.uint8),
        sds((b, hkv, pages, d), stat_dtype),
        sds((b, hkv, pages, d), stat_dtype),
        sds((b, hkv, pages, page, groups), stat_dtype),
        sds((b, hkv, pages, page, groups), stat_dtype),
        sds((b, hkv, pages, page), i32),
        sds((b, hkv), i32),
    )
    return full, int8, lowbit  # fmt: skip


def export_cuda(fn: Callable, *args) -> str:
    """StableHLO text of fn exported for CUDA on an abstract H200; the Triton custom call is
    allowed explicitly."""
    with jax.sharding.use_abstract_mesh(H200):
        exp = export.export(
            jax.jit(fn),
            platforms=["cuda"],
            disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
        )(*args)
    return exp.mlir_module()


def triton_ir(fn: Callable, *args) -> list[dict]:
    """Every Pallas kernel that exporting fn for CUDA lowers, in order: dict(name, num_warps,
    num_stages, ttir) with ttir the Triton IR text.

    Reads the TTIR at JAX's Pallas → Triton lowering step (a private JAX module; a clear error
    if it moved) and the launch knobs from the exported custom calls."""
    try:
        from jax._src.pallas.triton import pallas_call_registration as reg
    except ImportError as e:  # pragma: no cover - depends on the JAX version
        raise RuntimeError(f"this JAX has no Pallas Triton lowering to read: {e}") from e
    lower = reg.lowering.lower_jaxpr_to_triton_module
    seen: list[str] = []

    def capture(*a, **k):
        res = lower(*a, **k)
        seen.append(res.module.operation.get_asm(enable_debug_info=False))
        return res

    reg.lowering.lower_jaxpr_to_triton_module = capture
    try:
        text = export_cuda(fn, *args)
    finally:
        reg.lowering.lower_jaxpr_to_triton_module = lower
    calls = re.findall(r'name = "([^"]+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32', text)
    if len(calls) != len(seen):
        raise RuntimeError(f"{len(seen)} kernels lowered but {len(calls)} Triton calls exported")
    return [
        dict(name=n, num_warps=int(w), num_stages=int(st), ttir=ir)
        for (n, st, w), ir in zip(calls, seen, strict=True)
    ]


def pallas_calls(jaxpr) -> list:
    """Every pallas_call equation of a jaxpr (`jax.make_jaxpr(f)(...).jaxpr`), those in nested
    jaxprs (jit, scan, cond, while bodies) included, in program order; each equation's
    `invars[i].aval` is the shape and dtype of its kernel's i-th operand."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found.append(eqn)
            continue
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's, or a Jaxpr
                if hasattr(inner, "eqns"):
                    found += pallas_calls(inner)
    return found


_INSTR = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)(.*)$")
_BRANCH_TARGET = re.compile(r"\b(?:BRA|JMP)\b[^;]*?0x([0-9a-f]+)")


def sass_loop_stats(sass: str, tokens_per_iteration: int) -> dict:
    """Instructions of the kernel's main loop (the longest backward branch) per token.

    Args:
        sass: `cuobjdump -sass` text of one kernel.
        tokens_per_iteration: tokens one loop iteration covers (the kernel's block_k).

    Returns:
        dict(instructions=in the loop, per_token=instructions / token, ops={opcode: per token}).
    """
    instrs = []  # (address, opcode, rest of the line)
    for line in sass.splitlines():
        m = _INSTR.match(line)
        if m:
            instrs.append((int(m.group(1), 16), m.group(2), m.group(3)))
    loop = None
    for addr, op, rest in instrs:
        t = _BRANCH_TARGET.search(op + rest)
        if op in ("BRA", "JMP") and t:
            target = int(t.group(1), 16)
            if target < addr and (loop is None or addr - target > loop[1] - loop[0]):
                loop = (target, addr)
    if loop is None:
        raise ValueError("no backward branch (loop) in this SASS")
    body = [op for addr, op, _ in instrs if loop[0] <= addr <= loop[1]]
    ops = collections.Counter(body)
    per = lambda n: n / tokens_per_iteration
    return dict(
        instructions=len(body),
        per_token=per(len(body)),
        ops={op: per(n) for op, n in ops.most_common()},
    )
