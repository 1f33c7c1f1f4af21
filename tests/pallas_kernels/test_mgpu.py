"""Mosaic GPU decode kernels vs the float64 oracle, compiled on a GPU and interpreted on CPU.

`TestMgpu` compiles the `plgpu` kernels (skipped without a GPU); `TestMgpuInterpret` reruns it in
the Mosaic GPU interpreter. Capacities are block multiples (the kernels' contract) but extents
are not: one head stops early, slots have holes and future positions, splits see uneven shares.
Also: bad input gets one clear error, and every variant lowers for an H200 without one.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_cases import Case, make_tiers, oracle

from kvjax.eval._kernel_ir import H200, abstract_tiers
from kvjax.pallas_kernels.decode_attention import (
    TUNINGS,
    combine,
    decode_attention,
    tuning_for,
)
from kvjax.pallas_kernels.decode_attention._mgpu import decode_attention_mgpu

TOL = {"bfloat16": 2e-2, "float16": 4e-3}
CAP = 128  # two 64-slot blocks


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def _dense(case: Case, seed: int):
    """(q, q_pos, tier, oracle tiers (full, int8)) with capacity CAP and the int8 tier alone."""
    q, q_pos, full, int8, _ = make_tiers(dataclasses.replace(case, cap=CAP + 7), seed)
    cut = lambda t, n: type(t)(*[x[:, :, :n] if x.ndim >= 3 else jnp.minimum(x, n) for x in t])
    full = cut(full, CAP)
    if int8 is None:
        return q, q_pos, full, (full, None)
    int8 = cut(int8, CAP)
    empty = full._replace(pos=jnp.full_like(full.pos, -1))
    return q, q_pos, int8, (empty, int8)


CASES = [
    Case(dtype="bfloat16", tiers="fp", ratio=4, head_dim=128),
    Case(dtype="float16", tiers="fp", ratio=3, head_dim=64),
    Case(dtype="bfloat16", tiers="fp+int8", ratio=4, head_dim=64),
    Case(dtype="bfloat16", tiers="fp+int8", ratio=1, head_dim=128),
]


class TestMgpu:
    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _needs_device(self):
        if not self.INTERPRET and jax.default_backend() != "gpu":
            pytest.skip("compiled Mosaic GPU kernels need a GPU; the Interpret class covers CPU")

    @pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.tiers}-{c.dtype}-g{c.ratio}")
    def test_matches_float64(self, case):
        q, q_pos, tier, (full, int8) = _dense(case, _seed(case, self.INTERPRET))
        scale = q.shape[-1] ** -0.5
        splits = 3 if case.tiers == "fp" else 1
        res = decode_attention_mgpu(
            q, tier, q_pos, scale=scale, block_k=64, stages=2, num_splits=splits,
            return_logits=True, interpret=self.INTERPRET,
        )  # fmt: skip
        out, lse = combine([res])
        want, want_lse, logits, seen = oracle(q, q_pos, full, int8, None, None, scale)
        tol = TOL[case.dtype]
        got = np.asarray(out, np.float64)
        assert np.all(np.isfinite(got))
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < tol
        np.testing.assert_allclose(np.asarray(lse), want_lse, atol=10 * tol)
        vis = np.broadcast_to(seen[-1][:, :, None], logits[-1].shape)
        np.testing.assert_allclose(
            np.asarray(res.logits)[vis], logits[-1][vis], atol=10 * tol, rtol=tol
        )

    def test_nothing_visible_gives_zero_and_minus_inf(self):
        case = Case(dtype="bfloat16", tiers="fp", ratio=4, head_dim=64)
        q, q_pos, full, _ = _dense(case, _seed("empty", self.INTERPRET))
        full = full._replace(pos=jnp.full_like(full.pos, -1))
        res = decode_attention_mgpu(
            q, full, q_pos, scale=0.125, block_k=64, num_splits=2, interpret=self.INTERPRET
        )
        out, lse = combine([res])
        assert np.all(np.asarray(out) == 0)
        assert np.all(np.asarray(lse) == -np.inf)


class TestMgpuInterpret(TestMgpu):
    INTERPRET = True


def test_unsupported_input_gets_one_clear_error():
    case = Case(dtype="bfloat16", tiers="fp", ratio=4, head_dim=64)
    q, q_pos, full, _ = _dense(case, 0)
    with pytest.raises(ValueError, match="no multiple of block_k"):
        decode_attention_mgpu(q, full, q_pos, scale=0.1, block_k=256, interpret=True)
    f32 = full._replace(k=full.k.astype(jnp.float32), v=full.v.astype(jnp.float32))
    with pytest.raises(ValueError, match="q dtype float32"):
        decode_attention_mgpu(q.astype(jnp.float32), f32, q_pos, scale=0.1, interpret=True)
    case8 = Case(dtype="float16", tiers="fp+int8", ratio=4, head_dim=64)
    q, q_pos, int8, _ = _dense(case8, 0)
    with pytest.raises(ValueError, match="for the INT8 tier"):
        decode_attention_mgpu(q, int8, q_pos, scale=0.1, interpret=True)


@pytest.mark.parametrize("logits", [False, True])
@pytest.mark.parametrize("tier", ["bf16", "int8"])
def test_kernels_lower_for_h200(tier, logits):
    b, hkv, g, d, cap = 2, 8, 4, 128, 1024
    full, int8, _ = abstract_tiers(b, hkv, d, cap, cap, 8, 32, 32, 2, jnp.bfloat16)
    q = jax.ShapeDtypeStruct((b, hkv, g, d), jnp.bfloat16)
    q_pos = jax.ShapeDtypeStruct((b,), jnp.int32)
    fn = functools.partial(
        decode_attention_mgpu, scale=d**-0.5, num_splits=4, block_k=64, stages=3,
        return_logits=logits,
    )  # fmt: skip
    with jax.sharding.use_abstract_mesh(H200):
        exp = jax.export.export(jax.jit(fn), platforms=["cuda"])(
            q, int8 if tier == "int8" else full, q_pos
        )
    assert exp.mlir_module().count("@mosaic_gpu_v2") == 1


def _kernels_traced(backend: str, block_k: int) -> list[str]:
    case = Case(dtype="bfloat16", tiers="fp+int8", ratio=4, head_dim=64, cap=CAP)
    q, q_pos, full, int8, _ = make_tiers(case, 3)  # int8 holds CAP - 7 slots: no block multiple

    def f(q):
        return decode_attention(
            q, q_pos, full=full, int8=int8, scale=0.1, backend=backend, block_k=block_k,
            interpret=True,
        ).out  # fmt: skip

    text = str(jax.make_jaxpr(f)(q))
    names = ("kvjax_decode_full_mgpu", "kvjax_decode_int8_mgpu", "kvjax_decode_bf16_mgpu_tm")
    return [n for n in names if n in text]


def test_dispatch_picks_mosaic_where_it_applies_and_triton_elsewhere(monkeypatch):
    # mosaic: the full tier (128 slots) runs Mosaic GPU, the 121-slot INT8 tier falls back
    assert _kernels_traced("mosaic", 64) == ["kvjax_decode_full_mgpu"]
    assert _kernels_traced("mosaic", 16) == []  # block_k 16: no Mosaic GPU block
    kind = jax.devices()[0].device_kind
    for tiers, want in [
        ((), []),
        (("full",), ["kvjax_decode_full_mgpu"]),
        (("full-tm",), ["kvjax_decode_bf16_mgpu_tm"]),  # the slots-on-M kernel
    ]:
        monkeypatch.setitem(TUNINGS, kind, dataclasses.replace(tuning_for(), mgpu_tiers=tiers))
        assert _kernels_traced("triton", 64) == want  # the device's Tuning decides
