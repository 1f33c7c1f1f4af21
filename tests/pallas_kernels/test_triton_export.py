"""The Triton kernels lower for an H200 without one: jax.export with platforms=["cuda"] under an
abstract H200 device runs the Pallas → Triton lowering of every kernel variant at Llama-3-8B
decode sizes (D=128, G=4, a capacity that is no multiple of any block). It catches an operation
or shape Pallas cannot lower for Triton before any GPU time is spent; PTX compilation and
timing still need the GPU (`scripts/gpu_bench.sh kernel`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from kvjax.eval._kernel_ir import abstract_tiers, export_cuda
from kvjax.pallas_kernels.decode_attention import (
    PooledTier,
    decode_attention_lowbit_triton,
    decode_attention_pooled_triton,
    decode_attention_triton,
)
from kvjax.pallas_kernels.slot_write import SlotWrite, write_slots

B, HKV, G, D, C, P, TP, VG = 2, 8, 4, 128, 1000, 20, 32, 32
sds = jax.ShapeDtypeStruct
f32, i32 = jnp.float32, jnp.int32


def _q(dtype=jnp.bfloat16):
    return sds((B, HKV, G, D), dtype), sds((B,), i32)


def _tiers(bits: int = 2, dtype=jnp.bfloat16):
    return abstract_tiers(B, HKV, D, C, C, P, TP, VG, bits, dtype)


KNOBS = dict(scale=D**-0.5, num_splits=4, num_warps=4, num_stages=2)


@pytest.mark.parametrize("logits", [False, True])
@pytest.mark.parametrize("tier", ["bf16", "fp16", "int8", "int8_qk", "int8_vw", "int8_qk_vw"])
def test_dense_kernels_lower_for_h200(tier, logits):
    dtype = jnp.float16 if tier == "fp16" else jnp.bfloat16
    q, q_pos = _q(dtype)
    full, int8, _ = _tiers(dtype=dtype)
    data = int8 if tier.startswith("int8") else full
    extra = dict(int8_qk="_qk" in tier, v_words="_vw" in tier) if data is int8 else {}
    fn = functools.partial(
        decode_attention_triton, block_k=64, return_logits=logits, **KNOBS, **extra
    )
    text = export_cuda(fn, q, data, q_pos)
    assert text.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("kernel", ["dequant", "stacked", "tokens_m"])
@pytest.mark.parametrize("bits", [2, 4])
def test_lowbit_kernels_lower_for_h200(bits, kernel):
    q, q_pos = _q()
    variant = dict(dequant=dict(stack_pages=False), stacked=dict(stack_pages=True))
    fn = functools.partial(
        decode_attention_lowbit_triton, bits=bits, block_k=64 if kernel == "dequant" else None,
        **variant.get(kernel, dict(tokens_m=True, asm_unpack=True)),
        return_logits=True, **KNOBS,
    )  # fmt: skip
    assert export_cuda(fn, q, _tiers(bits)[2], q_pos).count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("logits", [False, True])
def test_pooled_kernel_lowers_for_h200(logits):
    """adakv's pool (Hkv·C slots, owner ids) at the same sizes: one Triton launch."""
    q, q_pos = _q()
    p = HKV * C
    pool = PooledTier(sds((B, 1, p, D), jnp.bfloat16), sds((B, 1, p, D), jnp.bfloat16),
                      sds((B, 1, p), i32), sds((B, 1, p), i32), sds((B, 1), i32))  # fmt: skip
    fn = functools.partial(
        decode_attention_pooled_triton, block_k=64, return_logits=logits, **KNOBS
    )
    assert export_cuda(fn, q, pool, q_pos).count("__gpu$xla.gpu.triton") == 1


def test_slot_write_lowers_for_h200_with_every_array_aliased():
    ring = SlotWrite(
        sds((B, HKV, 1), i32),
        (sds((B, HKV, 64, D), jnp.bfloat16), sds((B, HKV, 64, D), jnp.bfloat16),
         sds((B, HKV, 64), i32), sds((B, HKV, 64), f32)),
        (sds((B, HKV, 1, D), jnp.bfloat16), sds((B, HKV, 1, D), jnp.bfloat16),
         sds((B, HKV, 1), i32), sds((B, HKV, 1), f32)),
    )  # fmt: skip
    t = _tiers()[1]
    ranked = SlotWrite(
        sds((B, HKV, 1), i32),
        (t.k, t.v, t.pos, t.k_scale, t.v_scale),
        (sds((B, HKV, 1, D), jnp.int8), sds((B, HKV, 1, D), jnp.int8), sds((B, HKV, 1), i32),
         sds((B, HKV, 1), f32), sds((B, HKV, 1), f32)),
    )  # fmt: skip
    text = export_cuda(lambda a, b: write_slots(a, b), ranked, ring)
    assert text.count("__gpu$xla.gpu.triton") == 1
    # the 9 cache arrays are outputs aliased to their inputs: one launch, no copies
    assert text.count("#stablehlo.output_operand_alias<") == 9
