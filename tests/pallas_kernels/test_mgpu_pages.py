"""The Mosaic GPU kernel over a token-major low-bit tier of 8-token pages
(`decode_attention_pages_mgpu`, QEvict's INT2/INT4 windows) against the float64 oracle of the
dequantized tier, compiled on a GPU and interpreted on CPU, lowered for an H200, and its input
checks.

Pages have holes, a dormant page sits in the middle of one head, one head's extent stops early,
sequence 1 has half its positions in its future (the `decode_cases` tiers); 16, 24 and 32
pages (a hypothesis test: 8-48): the last block's statistics copy reads 8 pages past the end
(TMA's zeros).
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
    LowBitTier,
    combine,
    decode_attention_lowbit_triton,
    decode_attention_pages_mgpu,
)

TOL = 1e-2  # bfloat16 keys, q and probabilities

# (bits, GQA ratio, head dim, capacity: pages = capacity // 8)
CASES = [
    Case(dtype="bfloat16", tiers="fp+int2", ratio=4, head_dim=128, cap=128),
    Case(dtype="bfloat16", tiers="fp+int2", ratio=1, head_dim=64, cap=192),
    Case(dtype="bfloat16", tiers="fp+int4", ratio=3, head_dim=128, cap=256),
    Case(dtype="bfloat16", tiers="fp+int4", ratio=16, head_dim=64, cap=128, kv_heads=1),
]


def _pages_alone(case: Case, seed: int):
    """(q, q_pos, LowBitTier of 8-token pages and one value group, the oracle's full tier:
    empty)."""
    q, q_pos, full, _, low = make_tiers(case, seed, page=8, value_group=case.head_dim)
    return q, q_pos, low, full._replace(pos=jnp.full_like(full.pos, -1))


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def _ids(x):
    return f"int{x.bits}-g{x.ratio}-d{x.head_dim}-p{x.cap // 8}" if isinstance(x, Case) else str(x)


def _check(res, q, q_pos, tier, empty, bits, scale, logits=True):
    """out, lse and every attended slot's logit against float64; slots read but not
    attended -inf."""
    out, lse = combine([res])
    want, want_lse, want_logits, seen = oracle(q, q_pos, empty, None, tier, bits, scale)
    got = np.asarray(out, np.float64)
    assert np.all(np.isfinite(got))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < TOL
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=10 * TOL)
    if not logits:
        assert res.logits is None
        return
    vis = np.broadcast_to(seen[1][:, :, None, :], want_logits[1].shape)
    got_l = np.asarray(res.logits, np.float64)
    np.testing.assert_allclose(got_l[vis], want_logits[1][vis], atol=0.05, rtol=0.02)
    tokens = np.asarray(tier.extent)[:, :, None, None] * 8
    inside = np.arange(got_l.shape[-1]) < tokens  # the read pages
    hidden = ~vis & np.broadcast_to(inside, vis.shape)
    assert hidden.any() and np.all(got_l[hidden] == -np.inf)


class TestMgpuPages:
    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _needs_device(self):
        if not self.INTERPRET and jax.default_backend() != "gpu":
            pytest.skip("compiled Mosaic GPU kernels need a GPU; the Interpret class covers CPU")

    @pytest.mark.parametrize("splits", [1, 3])
    @pytest.mark.parametrize("case", CASES, ids=_ids)
    def test_matches_float64(self, case, splits):
        q, q_pos, tier, empty = _pages_alone(case, _seed(case, splits, self.INTERPRET))
        scale = q.shape[-1] ** -0.5
        logits = splits == 3 or case.ratio == 3  # with and without; G = 3 reads an odd row
        res = decode_attention_pages_mgpu(
            q, tier, q_pos, bits=case.bits, scale=scale, num_splits=splits, stages=2,
            return_logits=logits, interpret=self.INTERPRET,
        )  # fmt: skip
        _check(res, q, q_pos, tier, empty, case.bits, scale, logits)

    def test_equals_the_triton_kernel(self):
        """The same tier through the Triton low-bit kernel (the fallback): the same attention
        within bfloat16 rounding."""
        case = CASES[0]
        q, q_pos, tier, _ = _pages_alone(case, _seed("triton", self.INTERPRET))
        kw = dict(bits=2, scale=0.1, return_logits=True, interpret=self.INTERPRET)
        ours = decode_attention_pages_mgpu(q, tier, q_pos, num_splits=2, **kw)
        theirs = decode_attention_lowbit_triton(q, tier, q_pos, **kw)
        a, b = combine([ours]), combine([theirs])
        np.testing.assert_allclose(np.asarray(a[0]), np.asarray(b[0]), atol=2e-2, rtol=2e-2)
        np.testing.assert_allclose(np.asarray(a[1]), np.asarray(b[1]), atol=2e-2)

    def test_a_stacked_layer_read_in_place_equals_its_slice(self):
        """layer=: every array a stack [L, ...] read at the layer in place (its own extent);
        bit for bit the one layer's result, outputs and every read logit."""
        layers = [_pages_alone(CASES[2], _seed("stack", i, self.INTERPRET)) for i in range(3)]
        q, q_pos = layers[0][0], layers[0][1]
        tiers = [t[2] for t in layers]
        stack = stack_layers(tiers)._replace(extent=tiers[1].extent)
        run = functools.partial(
            decode_attention_pages_mgpu, bits=4, scale=0.1, num_splits=2, stages=2,
            return_logits=True, interpret=self.INTERPRET,
        )  # fmt: skip
        got = run(q, stack, q_pos, layer=jnp.int32(1))
        want = run(q, tiers[1], q_pos)
        for g, w in zip(got[:2], want[:2], strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        ext = np.asarray(tiers[1].extent)[:, :, None, None] * 8
        read = np.broadcast_to(np.arange(got.logits.shape[-1]) < ext, got.logits.shape)
        np.testing.assert_array_equal(np.asarray(got.logits)[read], np.asarray(want.logits)[read])

    def test_nothing_visible_gives_zero_and_minus_inf(self):
        q, q_pos, tier, _ = _pages_alone(CASES[0], _seed("empty", self.INTERPRET))
        tier = tier._replace(pos=jnp.full_like(tier.pos, -1))
        res = decode_attention_pages_mgpu(
            q, tier, q_pos, bits=2, scale=0.1, num_splits=2, interpret=self.INTERPRET
        )
        out, lse = combine([res])
        assert np.all(np.asarray(out) == 0)
        assert np.all(np.asarray(lse) == -np.inf)


class TestMgpuPagesInterpret(TestMgpuPages):
    INTERPRET = True


@settings(max_examples=6, deadline=None)
@given(
    pages=st.sampled_from([8, 16, 24, 40, 48]),
    splits=st.integers(1, 4),
    ratio=st.sampled_from([1, 2, 4, 8]),
    bits=st.sampled_from([2, 4]),
    seed=st.integers(0, 2**16),
)
def test_any_page_and_split_count_matches_float64(pages, splits, ratio, bits, seed):
    """Interpreted: whatever the page count, split count, GQA ratio and code width, the
    output, lse and every attended slot's logit equal the float64 oracle's."""
    case = Case(dtype="bfloat16", tiers=f"fp+int{bits}", ratio=ratio, head_dim=64, cap=8 * pages)
    q, q_pos, tier, empty = _pages_alone(case, seed)
    res = decode_attention_pages_mgpu(
        q, tier, q_pos, bits=bits, scale=0.125, num_splits=splits, stages=2,
        return_logits=True, interpret=True,
    )  # fmt: skip
    _check(res, q, q_pos, tier, empty, bits, 0.125)


def test_unsupported_input_gets_one_clear_error():
    q, q_pos, tier, _ = _pages_alone(CASES[0], 1)
    run = functools.partial(decode_attention_pages_mgpu, bits=2, scale=0.1, interpret=True)
    cut = lambda n: tier._replace(**{f: getattr(tier, f)[:, :, :n] for f in tier._fields[:7]})
    with pytest.raises(ValueError, match="12 pages \\(needs a positive multiple of 8\\)"):
        run(q, cut(12), q_pos)
    with pytest.raises(ValueError, match="needs bfloat16\\)"):
        run(q.astype(jnp.float16), tier, q_pos)
    with pytest.raises(ValueError, match="k_scale float32"):
        run(q, tier._replace(k_scale=tier.k_scale.astype(jnp.float32)), q_pos)
    q16, qp16, _, _, wide = make_tiers(CASES[0], 2, page=16, value_group=128)
    with pytest.raises(ValueError, match="pages of 16 tokens \\(needs 8\\)"):
        run(q16, wide, qp16)
    q4, qp4, _, _, groups = make_tiers(CASES[0], 3, page=8, value_group=32)
    with pytest.raises(ValueError, match="4 value groups \\(needs one a token\\)"):
        run(q4, groups, qp4)
    with pytest.raises(ValueError, match="8-bit codes \\(needs 2 or 4\\)"):
        codes = tier.k.reshape(*tier.k.shape[:-1], -1)
        wide8 = jnp.concatenate([codes] * 4, axis=-1)  # 128 one-byte codes a token
        run(q, tier._replace(k=wide8, v=wide8), q_pos, bits=8)
    with pytest.raises(ValueError, match="must be a LowBitTier"):
        run(q, tuple(tier), q_pos)
    with pytest.raises(ValueError, match="query heads per KV head"):
        q17 = jnp.concatenate([q] * 5, axis=2)[:, :, :17]
        run(q17, tier, q_pos)


@pytest.mark.parametrize("g", [4, 3])
@pytest.mark.parametrize("logits", [False, True])
@pytest.mark.parametrize("bits", [2, 4])
def test_kernel_lowers_for_h200(bits, logits, g):
    b, hkv, d, p = 2, 8, 128, 64
    sds = jax.ShapeDtypeStruct
    dp = d * bits // 8
    codes = sds((b, hkv, p, 8, dp), jnp.uint8)
    stats, vstats = sds((b, hkv, p, d), jnp.bfloat16), sds((b, hkv, p, 8, 1), jnp.bfloat16)
    tier = LowBitTier(
        codes, codes, stats, stats, vstats, vstats, sds((b, hkv, p, 8), jnp.int32),
        sds((b, hkv), jnp.int32),
    )  # fmt: skip
    fn = functools.partial(
        decode_attention_pages_mgpu, bits=bits, scale=0.1, num_splits=4, return_logits=logits
    )
    with jax.sharding.use_abstract_mesh(H200):
        exp = jax.export.export(jax.jit(fn), platforms=["cuda"])(
            sds((b, hkv, g, d), jnp.bfloat16), tier, sds((b,), jnp.int32)
        )
    assert exp.mlir_module().count("@mosaic_gpu_v2") == 1


def test_dispatch_reads_a_stack_through_the_kernel_when_the_tuning_lists_it(monkeypatch):
    """ "pages" in the Tuning's mgpu_tiers: `decode_attention(..., layer=)` runs a stacked
    token-major low-bit tier of 8-token pages through this kernel (in place), with the Triton
    low-bit kernel's result and logits; a tier it does not take (16-token pages) stays with
    Triton, with a warning that names why."""
    import dataclasses

    from kvjax.pallas_kernels.decode_attention import (
        TUNINGS,
        KernelFallbackWarning,
        decode_attention,
        tuning_for,
    )

    case = CASES[0]
    layers = [_pages_alone(case, 50 + i) for i in range(2)]
    q, q_pos, _, empty = layers[0]
    stack = stack_layers([t[2] for t in layers])._replace(extent=layers[1][2].extent)
    full = jax.tree.map(lambda a: jnp.stack([a, a]), empty)._replace(extent=empty.extent)

    def run(q, lowbit=stack):
        return decode_attention(
            q, q_pos, full=full, lowbit=lowbit, bits=2, scale=0.1, interpret=True,
            return_logits=True, layer=jnp.int32(1),
        )  # fmt: skip

    want = run(q)  # the Triton low-bit kernel (interpreted)
    kind = jax.devices()[0].device_kind
    monkeypatch.setitem(TUNINGS, kind, dataclasses.replace(tuning_for(), mgpu_tiers=("pages",)))
    assert "kvjax_decode_int2_pages_mgpu" in str(jax.make_jaxpr(run)(q))
    got = run(q)
    np.testing.assert_allclose(np.asarray(got.out), np.asarray(want.out), atol=2e-2, rtol=2e-2)
    seen = np.isfinite(np.asarray(want.logits[-1]))
    np.testing.assert_allclose(
        np.asarray(got.logits[-1])[seen], np.asarray(want.logits[-1])[seen], atol=0.05, rtol=0.02
    )
    q16, qp16, _, _, wide = make_tiers(case, 2, page=16, value_group=128)
    wide = stack_layers([wide, wide])
    with pytest.warns(KernelFallbackWarning, match=r"'pages'.*pages of 16 tokens \(needs 8\)"):
        jaxpr = str(jax.make_jaxpr(lambda q: run(q, wide))(q16))
    assert "pages_mgpu" not in jaxpr
