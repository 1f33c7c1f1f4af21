"""The Mosaic GPU kernel with slots on the wgmma M axis (`decode_attention_mgpu_tm`), over a
bfloat16 full tier and over an INT8 tier, against the float64 oracle, compiled on a GPU and
interpreted on CPU, lowered for an H200, and its input checks.

Slots have holes, one head's extent stops inside a block, sequence 1 has half its positions in
its future (the `decode_cases` tiers); the INT8 tiers' capacities are mostly no multiple of 64
(nor of 4).
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_cases import Case, make_tiers, oracle, stack_layers
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.eval._kernel_ir import H200
from kvjax.pallas_kernels.decode_attention import (
    FullTier,
    Int8Tier,
    combine,
    decode_attention_mgpu_tm,
)

TOL = 1e-2  # bfloat16 operands

CASES = [
    Case(dtype="bfloat16", tiers="fp", ratio=4, head_dim=128, cap=256),
    Case(dtype="bfloat16", tiers="fp", ratio=1, head_dim=64, cap=192),
    Case(dtype="bfloat16", tiers="fp", ratio=3, head_dim=128, cap=128),
    Case(dtype="bfloat16", tiers="fp", ratio=16, head_dim=64, cap=256, kv_heads=1),
]


# INT8 tiers (`make_tiers` gives them cap - 7 slots): one block exactly, 121 and 185 slots (the
# last block starting at C - 64, inside the block before), 249.
INT8_CASES = [
    Case(dtype="bfloat16", tiers="fp+int8", ratio=4, head_dim=128, cap=71),
    Case(dtype="bfloat16", tiers="fp+int8", ratio=1, head_dim=64, cap=128),
    Case(dtype="bfloat16", tiers="fp+int8", ratio=3, head_dim=128, cap=192),
    Case(dtype="bfloat16", tiers="fp+int8", ratio=16, head_dim=64, cap=256, kv_heads=1),
]


def _int8_alone(case: Case, seed: int):
    """(q, q_pos, Int8Tier, the oracle's (full, int8) tiers: the full tier empty)."""
    q, q_pos, full, int8, _ = make_tiers(case, seed)
    return q, q_pos, int8, (full._replace(pos=jnp.full_like(full.pos, -1)), int8)


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def _ids(x):
    return f"g{x.ratio}-d{x.head_dim}-c{x.cap}" if isinstance(x, Case) else str(x)


class TestMgpuTm:
    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _needs_device(self):
        if not self.INTERPRET and jax.default_backend() != "gpu":
            pytest.skip("compiled Mosaic GPU kernels need a GPU; the Interpret class covers CPU")

    @pytest.mark.parametrize("splits", [1, 3])
    @pytest.mark.parametrize("case", CASES, ids=_ids)
    def test_matches_float64(self, case, splits):
        q, q_pos, full, _, _ = make_tiers(case, _seed(case, splits, self.INTERPRET))
        scale = q.shape[-1] ** -0.5
        logits = splits == 3  # with and without
        res = decode_attention_mgpu_tm(
            q, full, q_pos, scale=scale, num_splits=splits, stages=2, return_logits=logits,
            interpret=self.INTERPRET,
        )  # fmt: skip
        out, lse = combine([res])
        want, want_lse, want_logits, seen = oracle(q, q_pos, full, None, None, 2, scale)
        got = np.asarray(out, np.float64)
        assert np.all(np.isfinite(got))
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < TOL
        np.testing.assert_allclose(np.asarray(lse), want_lse, atol=10 * TOL)
        if logits:
            vis = np.broadcast_to(seen[0][:, :, None, :], want_logits[0].shape)
            got_l = np.asarray(res.logits, np.float64)
            np.testing.assert_allclose(got_l[vis], want_logits[0][vis], atol=0.05, rtol=0.02)
            cap = got_l.shape[-1]
            inside = np.arange(cap) < np.asarray(full.extent)[:, :, None, None]  # [B, Hkv, 1, C]
            hidden = ~vis & np.broadcast_to(inside, vis.shape)  # read, but not attended
            assert hidden.any() and np.all(got_l[hidden] == -np.inf)
        else:
            assert res.logits is None

    @pytest.mark.parametrize("kind", ["bf16", "int8"])
    def test_a_stacked_layer_read_in_place_equals_its_slice(self, kind):
        """layer=: the slot arrays as stacks [L, ...] read at the layer in place (its own
        extent); bit for bit the one layer's result, outputs and every read logit."""
        if kind == "bf16":
            layers = [make_tiers(CASES[0], _seed("stack", i, self.INTERPRET)) for i in range(3)]
        else:
            layers = [_int8_alone(INT8_CASES[2], _seed("stack8", i, self.INTERPRET))
                      for i in range(3)]  # fmt: skip
        q, q_pos = layers[0][0], layers[0][1]
        tiers = [t[2] for t in layers]
        stack = stack_layers(tiers)._replace(extent=tiers[1].extent)
        run = functools.partial(
            decode_attention_mgpu_tm, scale=0.1, num_splits=2, stages=2, return_logits=True,
            interpret=self.INTERPRET,
        )  # fmt: skip
        got = run(q, stack, q_pos, layer=jnp.int32(1))
        want = run(q, tiers[1], q_pos)
        for g, w in zip(got[:2], want[:2], strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        # logits: the read slots' (past them undefined): the bf16 kernel reads whole blocks up
        # to the extent, the INT8 kernel's last block ends at C
        ext = np.asarray(tiers[1].extent)[:, :, None, None]
        read = np.arange(got.logits.shape[-1]) < (-(-ext // 64) * 64 if kind == "bf16" else ext)
        read = np.broadcast_to(read, got.logits.shape)
        np.testing.assert_array_equal(np.asarray(got.logits)[read], np.asarray(want.logits)[read])

    def test_nothing_visible_gives_zero_and_minus_inf(self):
        q, q_pos, full, _, _ = make_tiers(CASES[0], _seed("empty", self.INTERPRET))
        full = full._replace(pos=jnp.full_like(full.pos, -1))
        res = decode_attention_mgpu_tm(
            q, full, q_pos, scale=0.1, num_splits=2, interpret=self.INTERPRET
        )
        out, lse = combine([res])
        assert np.all(np.asarray(out) == 0)
        assert np.all(np.asarray(lse) == -np.inf)

    @pytest.mark.parametrize("splits", [1, 3])
    @pytest.mark.parametrize("case", INT8_CASES, ids=_ids)
    def test_int8_matches_float64(self, case, splits):
        """Codes converted in the kernel, each slot's key and value scale, the last block
        overlapping the one before (121 and 185 slots)."""
        q, q_pos, tier, (full, int8) = _int8_alone(case, _seed("int8", case, splits,
                                                               self.INTERPRET))  # fmt: skip
        scale = q.shape[-1] ** -0.5
        res = decode_attention_mgpu_tm(
            q, tier, q_pos, scale=scale, num_splits=splits, stages=2, return_logits=True,
            interpret=self.INTERPRET,
        )  # fmt: skip
        out, lse = combine([res])
        want, want_lse, want_logits, seen = oracle(q, q_pos, full, int8, None, None, scale)
        got = np.asarray(out, np.float64)
        assert np.all(np.isfinite(got))
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < TOL
        np.testing.assert_allclose(np.asarray(lse), want_lse, atol=10 * TOL)
        vis = np.broadcast_to(seen[1][:, :, None, :], want_logits[1].shape)
        got_l = np.asarray(res.logits, np.float64)
        np.testing.assert_allclose(got_l[vis], want_logits[1][vis], atol=0.05, rtol=0.02)
        inside = np.arange(tier.pos.shape[-1]) < np.asarray(tier.extent)[:, :, None, None]
        hidden = ~vis & np.broadcast_to(inside, vis.shape)  # read, but not attended
        assert hidden.any() and np.all(got_l[hidden] == -np.inf)

    def test_int8_nothing_visible_gives_zero_and_minus_inf(self):
        q, q_pos, tier, _ = _int8_alone(INT8_CASES[2], _seed("empty8", self.INTERPRET))
        tier = tier._replace(pos=jnp.full_like(tier.pos, -1))
        res = decode_attention_mgpu_tm(
            q, tier, q_pos, scale=0.1, num_splits=2, interpret=self.INTERPRET
        )
        out, lse = combine([res])
        assert np.all(np.asarray(out) == 0)
        assert np.all(np.asarray(lse) == -np.inf)


class TestMgpuTmInterpret(TestMgpuTm):
    INTERPRET = True


@settings(max_examples=8, deadline=None)
@given(
    cap=st.integers(64, 330),
    splits=st.integers(1, 4),
    ratio=st.sampled_from([1, 2, 4, 8]),
    seed=st.integers(0, 2**16),
)
def test_int8_any_capacity_and_split_count_matches_float64(cap, splits, ratio, seed):
    """Interpreted: whatever the capacity (the last block starting at C - 64 mostly inside the
    one before), split count and GQA ratio, the output, lse and every attended slot's logit
    equal the float64 oracle's, and no slot is counted twice (the lse would grow)."""
    case = Case(dtype="bfloat16", tiers="fp+int8", ratio=ratio, head_dim=64, cap=cap + 7)
    q, q_pos, tier, (full, int8) = _int8_alone(case, seed)
    scale = 0.125
    res = decode_attention_mgpu_tm(
        q, tier, q_pos, scale=scale, num_splits=splits, stages=2, return_logits=True,
        interpret=True,
    )  # fmt: skip
    out, lse = combine([res])
    want, want_lse, want_logits, seen = oracle(q, q_pos, full, int8, None, None, scale)
    got = np.asarray(out, np.float64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < TOL
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=10 * TOL)
    vis = np.broadcast_to(seen[1][:, :, None, :], want_logits[1].shape)
    np.testing.assert_allclose(
        np.asarray(res.logits, np.float64)[vis], want_logits[1][vis], atol=0.05, rtol=0.02
    )


def test_unsupported_input_gets_one_clear_error():
    q, q_pos, full, _, _ = make_tiers(CASES[0], 1)
    run = functools.partial(decode_attention_mgpu_tm, scale=0.1, interpret=True)
    with pytest.raises(ValueError, match="needs a bfloat16 q"):
        run(q.astype(jnp.float16), full._replace(k=full.k.astype(jnp.float16),
            v=full.v.astype(jnp.float16)), q_pos)  # fmt: skip
    with pytest.raises(ValueError, match="capacity 200"):
        cut = lambda a: a[:, :, :200]
        run(q, full._replace(k=cut(full.k), v=cut(full.v), pos=cut(full.pos)), q_pos)
    q8, qp8, small, _ = _int8_alone(Case("bfloat16", "fp+int8", 4, 128, cap=70), 3)
    with pytest.raises(ValueError, match="capacity 63 \\(the INT8 tier needs at least 64"):
        run(q8, small, qp8)
    with pytest.raises(ValueError, match="needs a bfloat16 q"):
        run(q8.astype(jnp.float16), _int8_alone(INT8_CASES[0], 3)[2], qp8)
    with pytest.raises(ValueError, match="must be a FullTier"):
        run(q, (full.k, full.v), q_pos)
    with pytest.raises(ValueError, match="query heads per KV head"):
        q17 = jnp.concatenate([q] * 5, axis=2)[:, :, :17]
        run(q17, full, q_pos)
    q48, qp48, f48, _, _ = make_tiers(Case("bfloat16", "fp", 4, 48, cap=128), 2)
    with pytest.raises(ValueError, match="head dim 48"):
        run(q48, f48, qp48)
    with pytest.raises(ValueError, match="pos must be \\[B, Hkv, C\\], got \\(2, 256\\)"):
        run(q, full, q_pos, layer=jnp.int32(0))  # a layer, not a stack: its views lack an axis
    with pytest.raises(ValueError, match="one leading \\[L\\] axis"):
        run(q, full._replace(pos=full.pos[None]), q_pos, layer=jnp.int32(0))  # k, v not stacked


@pytest.mark.parametrize("g", [4, 3])  # 3: the INT8 logits' rows are loaded two by two
@pytest.mark.parametrize("logits", [False, True])
@pytest.mark.parametrize("tier", ["bf16", "int8"])
def test_kernel_lowers_for_h200(logits, tier, g):
    b, hkv, d, cap = 2, 8, 128, 1024
    sds = jax.ShapeDtypeStruct
    pos, ext = sds((b, hkv, cap - 7), jnp.int32), sds((b, hkv), jnp.int32)
    if tier == "int8":  # a capacity no multiple of 64 (nor of 4)
        kv, sc = sds((b, hkv, cap - 7, d), jnp.int8), sds((b, hkv, cap - 7), jnp.float32)
        tier = Int8Tier(kv, kv, sc, sc, pos, ext)
    else:
        kv = sds((b, hkv, cap, d), jnp.bfloat16)
        tier = FullTier(kv, kv, sds((b, hkv, cap), jnp.int32), ext)
    fn = functools.partial(decode_attention_mgpu_tm, scale=0.1, num_splits=4, return_logits=logits)
    with jax.sharding.use_abstract_mesh(H200):
        exp = jax.export.export(jax.jit(fn), platforms=["cuda"])(
            sds((b, hkv, g, d), jnp.bfloat16), tier, sds((b,), jnp.int32)
        )
    assert exp.mlir_module().count("@mosaic_gpu_v2") == 1


def test_dispatch_reads_a_stack_through_the_kernel_when_the_tuning_lists_it(monkeypatch):
    """ "full-tm" in the Tuning's mgpu_tiers: `decode_attention(..., layer=)` runs the stacked
    full tier through this kernel (in place), with the Triton kernel's result."""
    import dataclasses

    from kvjax.pallas_kernels.decode_attention import TUNINGS, decode_attention, tuning_for

    case = CASES[2]
    layers = [make_tiers(case, 40 + i) for i in range(2)]
    q, q_pos = layers[0][0], layers[0][1]
    tiers = [t[2] for t in layers]
    stack = FullTier(*(jnp.stack([getattr(t, f) for t in tiers]) for f in ("k", "v", "pos")),
                     tiers[1].extent)  # fmt: skip

    def run(q):
        return decode_attention(
            q, q_pos, full=stack, scale=0.1, interpret=True, layer=jnp.int32(1)
        ).out

    want = run(q)  # the Triton kernel (interpreted)
    kind = jax.devices()[0].device_kind
    monkeypatch.setitem(TUNINGS, kind, dataclasses.replace(tuning_for(), mgpu_tiers=("full-tm",)))
    assert "kvjax_decode_bf16_mgpu_tm" in str(jax.make_jaxpr(run)(q))
    np.testing.assert_allclose(np.asarray(run(q)), np.asarray(want), atol=2e-2, rtol=2e-2)
