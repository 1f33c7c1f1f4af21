"""The Mosaic TPU kernels lower for TPU (jax.export with platforms=["tpu"]) at real tile sizes:
D=128, 512-slot blocks over a capacity that is not a multiple of them, INT8, 2- and 4-bit pages."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from kvjax.eval._kernel_ir import abstract_tiers
from kvjax.pallas_kernels.decode_attention import decode_attention

B, HKV, G, D, C, CQ, P, TP, VG = 2, 2, 4, 128, 1000, 512, 20, 32, 32
i32 = jnp.int32
sds = jax.ShapeDtypeStruct


def _tiers(bits: int, dtype):
    return abstract_tiers(B, HKV, D, C, CQ, P, TP, VG, bits, dtype)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kernels_export_for_tpu(bits, dtype):
    full, int8, lowbit = _tiers(bits, dtype)
    f = functools.partial(
        decode_attention, bits=bits, scale=D**-0.5, backend="tpu", return_logits=True
    )
    fn = jax.jit(lambda q, qp, a, b, c: f(q, qp, full=a, int8=b, lowbit=c))
    q = sds((B, HKV, G, D), dtype)
    exp = jax.export.export(fn, platforms=["tpu"])(q, sds((B,), i32), full, int8, lowbit)
    text = exp.mlir_module()
    assert text.count("tpu_custom_call") == 3  # one Mosaic kernel per tier
    assert [o.shape for o in exp.out_avals[:2]] == [(B, HKV, G, D), (B, HKV, G)]
