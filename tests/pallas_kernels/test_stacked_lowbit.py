"""The token-major low-bit Triton kernel reading one layer of a stacked cache in place (`layer=`),
in each of its kernel bodies: equal to the same kernel on that layer sliced out and to the
float64 oracle, with the layer a traced index (a layer scan's loop counter); `decode_attention`
hands it the stack; it lowers for the H200; bad stacks get one clear error, and a stack whose
codes the kernel cannot index whole is read as the layer's slice."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_cases import Case, make_tiers, oracle, stack_layers

from kvjax.eval._kernel_ir import abstract_tiers, export_cuda, pallas_calls
from kvjax.pallas_kernels.decode_attention import (
    LowBitTier,
    combine,
    decode_attention,
    decode_attention_lowbit_triton,
)

L = 3
KERNELS = {  # the kernel bodies: `_kernel`, `_kernel_stacked` (also with int8 QK), tokens_m
    "dequant": dict(stack_pages=False),
    "stacked": dict(stack_pages=True, int8_qk=False),  # (Hopper's Tuning turns int8 QK on)
    "tokens_m": dict(tokens_m=True),
    "stacked-int8qk": dict(stack_pages=True, int8_qk=True),
}
# float32 is exact up to summation order; bfloat16 rounds q, p once; int8 QK also rounds each
# q⊙(key scale) row to int8 (<= max/254 an element), here on low-bit slots alone
TOL = {"float32": 1e-5, "bfloat16": 2e-2, "int8qk": 4e-2}


def _layers(case: Case):
    """(q, q_pos, the L layers' low-bit tiers sharing layer 1's extent, their stack)."""
    made = [make_tiers(case, 10 + seed) for seed in range(L)]
    q, q_pos = made[1][0], made[1][1]
    # every layer's extent is layer 1's, so the stack can carry one extent
    layers = [m[4]._replace(extent=made[1][4].extent) for m in made]
    return q, q_pos, layers, stack_layers(layers), made[1][2]


PARAMS = [
    pytest.param(k, bits, logits, id=f"{k}-int{bits}-{'logits' if logits else 'out'}")
    for k in ("dequant", "stacked", "tokens_m")
    for bits in (2, 4)
    for logits in (False, True)
] + [pytest.param("stacked-int8qk", 4, False, id="stacked-int8qk-int4-out")]


@pytest.mark.parametrize(("kernel", "bits", "logits"), PARAMS)
def test_stacked_lowbit_layer_equals_the_sliced_layer_and_float64(kernel, bits, logits):
    # G = 3 (a GQA group that fills no tile), 2 value groups, 3 pages of 16 tokens whose
    # extents differ by head, with holes and a dormant page (`make_tiers`).
    dtype = "float32" if bits == 2 else "bfloat16"
    q, q_pos, layers, stacked, full = _layers(Case(dtype, f"fp+int{bits}", ratio=3, head_dim=64))
    interpret = jax.default_backend() != "gpu"  # compiled on a GPU, interpreted elsewhere
    kw = dict(bits=bits, scale=0.3, num_splits=2, return_logits=logits, interpret=interpret)
    kw |= KERNELS[kernel]
    run = jax.jit(lambda i: decode_attention_lowbit_triton(q, stacked, q_pos, i, **kw))
    got = run(jnp.int32(1))
    want = decode_attention_lowbit_triton(q, layers[1], q_pos, **kw)
    np.testing.assert_array_equal(np.asarray(got.out), np.asarray(want.out))
    np.testing.assert_array_equal(np.asarray(got.lse), np.asarray(want.lse))
    # the oracle's full tier left empty: only the low-bit slots are attended
    empty = full._replace(pos=jnp.full_like(full.pos, -1), extent=0 * full.extent)
    o64, lse64, logits64, seen = oracle(q, q_pos, empty, None, layers[1], bits, 0.3)
    tol = TOL["int8qk"] if kernel.endswith("int8qk") else TOL[dtype]
    if logits:  # equal where visible (elsewhere the kernel leaves them arbitrary, as documented)
        vis = np.broadcast_to(seen[-1][:, :, None], got.logits.shape)
        np.testing.assert_array_equal(np.asarray(got.logits)[vis], np.asarray(want.logits)[vis])
        np.testing.assert_allclose(
            np.asarray(got.logits)[vis], logits64[-1][vis], atol=10 * tol, rtol=tol
        )
    out, lse = combine([got])
    err = np.linalg.norm(np.asarray(out, np.float64) - o64) / np.linalg.norm(o64)
    assert err < tol
    np.testing.assert_allclose(np.asarray(lse), lse64, rtol=0, atol=10 * tol)
    other = run(jnp.int32(2))  # another layer really is another answer
    assert not np.allclose(np.asarray(other.out), np.asarray(got.out))


def test_decode_attention_reads_a_stacked_lowbit_tier_in_place():
    """`decode_attention(..., layer=)` with the full and low-bit tiers both stacked equals it on
    the layer's own tiers, and hands the low-bit kernel the stack (no slice of it)."""
    case = Case("float32", "fp+int2", ratio=2, head_dim=32)
    made = [make_tiers(case, 20 + seed) for seed in range(L)]
    q, q_pos, full1, _, low1 = made[1]
    fulls = [m[2]._replace(extent=full1.extent) for m in made]
    lows = [m[4]._replace(extent=low1.extent) for m in made]
    kw = dict(bits=2, scale=0.3, return_logits=True, interpret=True, block_k=16, num_splits=2)
    stacked = lambda i: decode_attention(
        q, q_pos, full=stack_layers(fulls), lowbit=stack_layers(lows), layer=i, **kw
    )
    got = jax.jit(stacked)(jnp.int32(1))
    want = decode_attention(q, q_pos, full=full1, lowbit=low1, **kw)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        # (equal on the CPU; the interpreter on a GPU may fuse the two programs differently)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    [codes] = [
        e for e in pallas_calls(jax.make_jaxpr(stacked)(jnp.int32(1)).jaxpr) if _is_lowbit(e)
    ]
    assert codes.invars[3].aval.shape[0] == L * q.shape[0]  # [L·B, Hkv, ...]: the stack


def _is_lowbit(eqn) -> bool:
    """A pallas_call of the token-major low-bit kernel: uint8 packed codes as its 4th operand."""
    return len(eqn.invars) > 3 and eqn.invars[3].aval.dtype == jnp.uint8


@pytest.mark.parametrize("kernel", ["dequant", "stacked", "tokens_m"])
@pytest.mark.parametrize("bits", [2, 4])
def test_stacked_lowbit_kernels_lower_for_h200(bits, kernel):
    # Triton's lowering takes one indexer per load: the layer views fold their leading indices
    # into each body's loads, the stacked bodies' gathers of page statistics included.
    sds = jax.ShapeDtypeStruct
    _, _, lowbit = abstract_tiers(2, 8, 128, 1000, 1000, 20, 32, 32, bits, jnp.bfloat16)
    grow = lambda f, a: a if f == "extent" else sds((4, *a.shape), a.dtype)
    stack = LowBitTier(**{f: grow(f, a) for f, a in lowbit._asdict().items()})
    variant = dict(dequant=dict(stack_pages=False, block_k=64), stacked=dict(stack_pages=True))
    fn = functools.partial(
        decode_attention_lowbit_triton, bits=bits, scale=0.1, num_splits=4, return_logits=True,
        **variant.get(kernel, dict(tokens_m=True, asm_unpack=True)),
    )  # fmt: skip
    q, q_pos, layer = sds((2, 8, 4, 128), jnp.bfloat16), sds((2,), jnp.int32), sds((), jnp.int32)
    assert export_cuda(fn, q, stack, q_pos, layer).count("__gpu$xla.gpu.triton") == 1


def test_stacked_lowbit_bad_inputs_raise_clear_errors():
    case = Case("float32", "fp+int2", ratio=2, head_dim=32)
    q, q_pos, _, _, lowbit = make_tiers(case, 0)
    kw = dict(bits=2, scale=0.3, interpret=True)
    with pytest.raises(ValueError, match="LowBitTier.k"):  # a per-layer tier given a layer
        decode_attention_lowbit_triton(q, lowbit, q_pos, jnp.int32(0), **kw)
    stacked = stack_layers([lowbit, lowbit])
    with pytest.raises(ValueError, match=r"leading \[L\] axis.*v 1"):
        decode_attention_lowbit_triton(
            q, stacked._replace(v=stacked.v[:1]), q_pos, jnp.int32(0), **kw
        )
    with pytest.raises(ValueError, match=r"leading \[L\] axis.*v_scale 2.*pos 3"):
        bad = stacked._replace(pos=jnp.concatenate([stacked.pos, stacked.pos[:1]]))
        decode_attention_lowbit_triton(q, bad, q_pos, jnp.int32(0), **kw)
    for layer in (jnp.zeros((2,), jnp.int32), jnp.float32(0)):
        with pytest.raises(ValueError, match="integer scalar"):
            decode_attention_lowbit_triton(q, stacked, q_pos, layer, **kw)


def test_lowbit_stack_of_2_to_4_gib_of_codes_is_read_as_the_layer_slice():
    """The whole stack is indexed: a stack of 2^31 to 2^32 code bytes (32 layers × B 8 × 8 heads
    × 1024 pages × 32 tokens × 32 bytes; KIVI INT2's at 32K has 1,027 pages) would overflow the
    kernel's 32-bit offsets, so the kernel refuses it by name and `decode_attention` slices the
    layer out for it instead (abstract shapes, no memory)."""
    sds = jax.ShapeDtypeStruct
    full, _, lowbit = abstract_tiers(8, 8, 128, 64, 64, 1024, 32, 32, 2, jnp.bfloat16)
    grow = lambda t: type(t)(
        **{f: a if f == "extent" else sds((32, *a.shape), a.dtype) for f, a in t._asdict().items()}
    )
    stack = grow(lowbit)
    assert stack.k.size == 2**31
    q, q_pos, layer = sds((8, 8, 4, 128), jnp.bfloat16), sds((8,), jnp.int32), sds((), jnp.int32)
    fn = functools.partial(decode_attention_lowbit_triton, bits=2, scale=0.1)
    with pytest.raises(
        ValueError, match=r"LowBitTier.k: 2147483648 bytes of codes in the layer stack"
    ):
        jax.eval_shape(fn, q, stack, q_pos, layer)
    api = lambda q, q_pos, f, lb, i: decode_attention(
        q, q_pos, full=f, lowbit=lb, bits=2, scale=0.1, layer=i
    )
    jaxpr = jax.make_jaxpr(api)(q, q_pos, grow(full), stack, layer).jaxpr
    [codes] = [e for e in pallas_calls(jaxpr) if _is_lowbit(e)]
    assert codes.invars[3].aval.shape[:2] == (8, 8)  # one layer's [B, Hkv, ...]: the slice
