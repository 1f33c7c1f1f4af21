"""The low-bit kernel's inline-PTX code conversion (`asm_unpack`): the PTX program emulated
instruction by instruction over every byte value (here, on CPU), and the compiled kernel with it
against the float64 oracle and the jnp conversion (GPU only)."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_cases import Case, make_tiers, oracle

from kvjax.pallas_kernels.decode_attention import combine
from kvjax.pallas_kernels.decode_attention._triton import decode_attention_triton
from kvjax.pallas_kernels.decode_attention._triton_lowbit import (
    asm_unpack_applies,
    decode_attention_lowbit_triton,
    unpack_asm,
    unpack_int8_asm,
)

BF16 = {jnp.dtype(jnp.bfloat16): "bf16", jnp.dtype(jnp.float16): "f16"}


def _half(bits: np.ndarray, ty: str) -> np.ndarray:
    """16-bit patterns [N] of a half type as float64."""
    dt = jnp.bfloat16 if ty == "bf16" else jnp.float16
    return np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(bits, jnp.uint16), dt), np.float64)


def _to_half(x: np.ndarray, ty: str) -> np.ndarray:
    dt = jnp.bfloat16 if ty == "bf16" else jnp.float16
    return np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(x, dt), jnp.uint16), np.uint32)


def _run_ptx(asm: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Runs the PTX subset the unpack programs emit (mov, prmt, shr, and, lop3,
    fma.rn.bf16x2/f16x2) on 32-bit input registers [N]; returns every register. Unknown
    instructions fail the test."""
    regs = {r: x.astype(np.uint32) for r, x in inputs.items()}
    like = next(iter(regs.values()))
    val = lambda t: regs[t] if t in regs else np.full_like(like, int(t, 0), np.uint32)
    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        a = [t.strip() for t in args.split(",")]
        if op == "mov.b32":
            regs[a[0]] = val(a[1])
        elif op == "prmt.b32":  # default mode: result byte n = byte sel_n of {b, a}
            src, other, sel = val(a[1]), val(a[2]), int(a[3], 0)
            wide = src.astype(np.uint64) | (other.astype(np.uint64) << 32)
            out = np.zeros_like(like, np.uint32)
            for n in range(4):
                s = (sel >> (4 * n)) & 0xF
                assert s < 8, "sign-replicating selectors are not used"
                out |= (((wide >> (8 * s)) & 0xFF).astype(np.uint32)) << (8 * n)
            regs[a[0]] = out
        elif op == "shr.b32":
            regs[a[0]] = val(a[1]) >> np.uint32(int(a[2], 0))
        elif op == "and.b32":
            regs[a[0]] = val(a[1]) & val(a[2])
        elif op == "lop3.b32":
            assert a[4] == "0xEA", "only (a & b) | c is emulated"
            regs[a[0]] = (val(a[1]) & val(a[2])) | val(a[3])
        elif op.startswith("fma.rn."):
            ty = op.split(".")[-1][:-2]  # bf16 / f16
            halves = []
            for sh in (0, 16):
                h = lambda t, sh=sh, ty=ty: _half((val(t) >> np.uint32(sh)) & np.uint32(0xFFFF), ty)
                r = h(a[1]) * h(a[2]) + h(a[3])  # exact here: small integers
                halves.append(_to_half(r, ty) << np.uint32(sh))
            regs[a[0]] = halves[0] | halves[1]
        else:
            raise AssertionError(f"unexpected instruction {line!r}")
    return regs


def _emulate(asm: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """unpack_asm's program on 32-bit inputs x [N] as $2: ($0, $1)."""
    regs = _run_ptx(asm, {"$2": x})
    return regs["$0"], regs["$1"]


@pytest.mark.parametrize("cdt", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("bits", [2, 4])
def test_unpack_asm_emulated_over_every_byte(bits, cdt):
    """Element k of the 4 packed bytes (byte k of $2) must come out as sub-block i's code of
    that byte, (byte >> i·bits) & mask, in half k % 2 of register $(k // 2): every byte value
    at every position."""
    ty = BF16[jnp.dtype(cdt)]
    rng = np.random.default_rng(0)
    byte = np.concatenate([np.arange(256), rng.integers(0, 256, 256)]).astype(np.uint32)
    pos = [np.roll(byte, 37 * k) for k in range(4)]  # a different byte at each position
    x = pos[0] | (pos[1] << 8) | (pos[2] << 16) | (pos[3] << 24)
    for i in range(8 // bits):
        r0, r1 = _emulate(unpack_asm(bits, i, cdt), x)
        for k, reg in enumerate((r0, r0, r1, r1)):
            got = _half((reg >> np.uint32(16 * (k % 2))) & np.uint32(0xFFFF), ty)
            want = (pos[k] >> (i * bits)) & ((1 << bits) - 1)
            np.testing.assert_array_equal(got, want, err_msg=f"sub-block {i}, element {k}")


def _emulate_int8(asm: str, x: np.ndarray) -> np.ndarray:
    """unpack_int8_asm's program on x [N] as $1: $0."""
    return _run_ptx(asm, {"$1": x})["$0"]


@pytest.mark.parametrize("bits", [2, 4])
def test_unpack_int8_asm_emulated_over_every_byte(bits):
    """Byte k of $0 must be sub-block i's code of byte k of $1, (byte >> i·bits) & mask, for
    every byte value at every position (the int8 codes of `int8_qk`)."""
    rng = np.random.default_rng(1)
    byte = np.concatenate([np.arange(256), rng.integers(0, 256, 256)]).astype(np.uint32)
    pos = [np.roll(byte, 41 * k) for k in range(4)]
    x = pos[0] | (pos[1] << 8) | (pos[2] << 16) | (pos[3] << 24)
    for i in range(8 // bits):
        r = _emulate_int8(unpack_int8_asm(bits, i), x)
        for k in range(4):
            got = (r >> np.uint32(8 * k)) & np.uint32(0xFF)
            want = (pos[k] >> (i * bits)) & ((1 << bits) - 1)
            np.testing.assert_array_equal(got, want, err_msg=f"sub-block {i}, byte {k}")


def test_int8_qk_needs_the_stacked_kernel_and_low_bit_codes():
    case = Case(dtype="bfloat16", tiers="fp+int4", ratio=4, head_dim=64)
    q, q_pos, _, _, lowbit = make_tiers(case, 3)
    kw = dict(scale=0.125, interpret=True, int8_qk=True)
    with pytest.raises(ValueError, match="int8_qk is a knob of the stacked low-bit kernel"):
        decode_attention_lowbit_triton(q, lowbit, q_pos, bits=4, stack_pages=False, **kw)
    case8 = Case(dtype="bfloat16", tiers="fp+int8b", ratio=2, head_dim=64)
    q, q_pos, _, _, lowbit8 = make_tiers(case8, 3)
    with pytest.raises(ValueError, match="int8_qk needs 2- or 4-bit codes"):
        decode_attention_lowbit_triton(q, lowbit8, q_pos, bits=8, stack_pages=True, **kw)


def test_asm_unpack_applies_to_2_4_bit_half_codes_on_4_byte_widths():
    assert asm_unpack_applies(4, jnp.bfloat16, [64, 32])
    assert asm_unpack_applies(2, jnp.float16, [32, 16])
    assert not asm_unpack_applies(8, jnp.bfloat16, [64])  # 128 + code leaves bf16's ulp of 1
    assert not asm_unpack_applies(4, jnp.float32, [64])
    assert not asm_unpack_applies(4, jnp.bfloat16, [64, 2])


CASES = [
    Case(dtype="bfloat16", tiers="fp+int4", ratio=4, head_dim=128),
    Case(dtype="bfloat16", tiers="fp+int2", ratio=3, head_dim=128),
    Case(dtype="float16", tiers="fp+int4", ratio=1, head_dim=64),
    Case(dtype="float16", tiers="fp+int2", ratio=4, head_dim=64),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.tiers}-{c.dtype}-g{c.ratio}")
def test_asm_unpack_matches_float64_and_the_jnp_conversion(case):
    """The stacked kernel with inline-PTX conversion (compiled: GPU only; interpreted, the flag
    falls back to jnp and must change nothing) against the float64 oracle, and equal to the
    kernel converting with jnp: both hand the dots the same exact codes."""
    interpret = jax.default_backend() != "gpu"
    q, q_pos, full, _, lowbit = make_tiers(case, zlib.crc32(repr(("asm", case)).encode()))
    scale = q.shape[-1] ** -0.5
    kw = dict(bits=case.bits, scale=scale, num_splits=2, return_logits=True, stack_pages=True)
    run = lambda asm: decode_attention_lowbit_triton(
        q, lowbit, q_pos, asm_unpack=asm, interpret=interpret, **kw
    )
    fast, plain = run(True), run(False)
    for a, b in zip(fast, plain, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    full_part = decode_attention_triton(
        q, full, q_pos, scale=scale, num_splits=2, block_k=16, interpret=interpret
    )
    out, lse, _, _ = oracle(q, q_pos, full, None, lowbit, case.bits, scale)
    got_out, got_lse = combine([full_part, fast])
    got = np.asarray(got_out, np.float64)
    tol = {"bfloat16": 2e-2, "float16": 4e-3}[case.dtype]
    assert np.linalg.norm(got - out) / np.linalg.norm(out) < tol
    np.testing.assert_allclose(np.asarray(got_lse), lse, atol=10 * tol)
