"""Decode kernels vs a float64 oracle over dtypes × tiers × GQA ratios × head dims.

`TestDecodeAttention` compiles the kernels for the GPU (skipped elsewhere); the same class reruns
in the Pallas interpreter on CPU (`TestDecodeAttentionInterpret`). Capacities (45, 38 slots) are
not multiples of any block, slots have holes in the middle, heads have different extents, a page
is dormant, and every test draws fresh random inputs.
"""

from __future__ import annotations

import itertools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_cases import Case, make_tiers, oracle

from kvjax.pallas_kernels.decode_attention import attention_mass, combine, decode_attention

TIERS = ("fp", "fp+int8", "fp+int2", "fp+int4", "fp+int8b")
DTYPES = ("bfloat16", "float16", "float32")
# Every tier × GQA ratio, with dtype and head dim rotating so each pair of them also appears.
CASES = [
    Case(dtype=DTYPES[i % 3], tiers=t, ratio=r, head_dim=(64, 128)[(i // 3) % 2])
    for i, (t, r) in enumerate(itertools.product(TIERS, (1, 3, 4)))
]
# Relative L2 error of out (and absolute error of lse/logits/mass) allowed per dtype: float32
# is exact arithmetic up to summation order; half dtypes round q, p (and q·scale) once.
TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 4e-3}


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


class TestDecodeAttention:
    INTERPRET = False
    BACKEND = "triton"

    @pytest.fixture(autouse=True)
    def _needs_device(self):
        if not self.INTERPRET and jax.default_backend() != "gpu":
            pytest.skip("compiled Triton kernels need a GPU; the Interpret class covers CPU")

    def run(self, q, q_pos, full, int8, lowbit, bits, splits=3):
        return decode_attention(
            q,
            q_pos,
            full=full,
            int8=int8,
            lowbit=lowbit,
            bits=bits or 2,
            scale=q.shape[-1] ** -0.5,
            backend=self.BACKEND,
            return_logits=True,
            interpret=self.INTERPRET,
            block_k=16,
            num_splits=splits,
        )

    @pytest.mark.parametrize(
        "case", CASES, ids=lambda c: f"{c.tiers}-{c.dtype}-g{c.ratio}-d{c.head_dim}"
    )
    def test_matches_float64(self, case):
        q, q_pos, full, int8, lowbit = make_tiers(case, _seed(case, self.INTERPRET))
        res = self.run(q, q_pos, full, int8, lowbit, case.bits)
        out, lse, logits, seen = oracle(
            q, q_pos, full, int8, lowbit, case.bits, q.shape[-1] ** -0.5
        )
        tol = TOL[case.dtype]
        got = np.asarray(res.out, np.float64)
        assert np.all(np.isfinite(got))
        assert np.linalg.norm(got - out) / np.linalg.norm(out) < tol
        np.testing.assert_allclose(np.asarray(res.lse), lse, atol=10 * tol)
        assert len(res.logits) == len(logits)
        w = jnp.array([1.0, 0.5][: q.shape[0]], jnp.float32)
        for got_s, want_s, vis in zip(res.logits, logits, seen, strict=True):
            assert got_s.shape == want_s.shape
            vis4 = np.broadcast_to(vis[:, :, None], want_s.shape)
            np.testing.assert_allclose(
                np.asarray(got_s)[vis4], want_s[vis4], atol=10 * tol, rtol=tol
            )
            mass = attention_mass(got_s, res.lse, jnp.asarray(vis), w)
            want = np.exp(want_s - lse[..., None]).sum(2) * np.asarray(w)[:, None, None]
            np.testing.assert_allclose(np.asarray(mass), want, atol=5 * tol)

    @pytest.mark.parametrize("splits", [1, 2, 5])
    def test_split_count_does_not_change_result(self, splits):
        case = Case(dtype="float32", tiers="fp+int8", ratio=4, head_dim=64, cap=70)
        q, q_pos, full, int8, _ = make_tiers(case, _seed(splits, self.INTERPRET))
        res = self.run(q, q_pos, full, int8, None, None, splits=splits)
        out, lse, _, _ = oracle(q, q_pos, full, int8, None, None, q.shape[-1] ** -0.5)
        np.testing.assert_allclose(np.asarray(res.out), out, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(res.lse), lse, atol=1e-5)

    def test_nothing_visible_gives_zero_and_minus_inf(self):
        case = Case(dtype="bfloat16", tiers="fp+int4", ratio=3, head_dim=64)
        q, q_pos, full, _, lowbit = make_tiers(case, _seed("empty", self.INTERPRET))
        full = full._replace(pos=jnp.full_like(full.pos, -1))
        lowbit = lowbit._replace(pos=jnp.full_like(lowbit.pos, -1))
        res = self.run(q, q_pos, full, None, lowbit, 4)
        assert np.all(np.asarray(res.out) == 0)
        assert np.all(np.asarray(res.lse) == -np.inf)

    def test_slots_after_the_query_and_past_the_extent_are_ignored(self):
        case = Case(dtype="float32", tiers="fp", ratio=1, head_dim=64)
        q, q_pos, full, _, _ = make_tiers(case, _seed("future", self.INTERPRET))
        poisoned = full._replace(
            k=full.k.at[:, :, -3:].set(jnp.nan),
            v=full.v.at[:, :, -3:].set(jnp.nan),
            extent=jnp.minimum(full.extent, full.k.shape[2] - 3),
        )
        later = full._replace(pos=jnp.where(full.pos >= 0, full.pos + 1000, -1))
        res = self.run(q, q_pos, poisoned, None, None, None)
        assert np.all(np.isfinite(np.asarray(res.out)))
        assert np.all(np.asarray(self.run(q, q_pos, later, None, None, None).lse) == -np.inf)

    @pytest.mark.parametrize("tiers", ["fp+int8", "fp+int2"])
    def test_tuned_defaults_at_real_sizes(self, tiers):
        # GPU only: the device's tuned block/split/warp defaults, D=128, capacity 1000 (not a
        # multiple of any block), 32-token pages; the interpreter would take minutes here.
        if self.INTERPRET:
            pytest.skip("real sizes are for the compiled kernels")
        case = Case(dtype="bfloat16", tiers=tiers, ratio=4, head_dim=128, cap=1000)
        q, q_pos, full, int8, lowbit = make_tiers(case, _seed("real", tiers), page=32)
        res = decode_attention(
            q, q_pos, full=full, int8=int8, lowbit=lowbit, bits=case.bits or 2,
            scale=128**-0.5, backend=self.BACKEND, return_logits=True,
        )  # fmt: skip
        out, lse, _, _ = oracle(q, q_pos, full, int8, lowbit, case.bits, 128**-0.5)
        got = np.asarray(res.out, np.float64)
        assert np.linalg.norm(got - out) / np.linalg.norm(out) < TOL["bfloat16"]
        np.testing.assert_allclose(np.asarray(res.lse), lse, atol=0.2)


class TestDecodeAttentionInterpret(TestDecodeAttention):
    INTERPRET = True


class TestDecodeAttentionTpuInterpret(TestDecodeAttention):
    """The Mosaic TPU variant, in the TPU interpreter (it has one split, so any num_splits)."""

    INTERPRET = True
    BACKEND = "tpu"
    test_split_count_does_not_change_result = None  # one split on TPU: nothing to vary


@pytest.mark.parametrize("block_k", [32, 64])
def test_triton_lowbit_block_sizes_agree(block_k):
    # 3 pages of 16 tokens: a 32- or 64-token step straddles pages and overhangs the tier, and
    # page 1 of sequence 1 is dormant.
    from kvjax.pallas_kernels.decode_attention import decode_attention_lowbit_triton

    case = Case(dtype="float32", tiers="fp+int4", ratio=4, head_dim=64)
    q, q_pos, _, _, lowbit = make_tiers(case, _seed("blocks", block_k))
    run = lambda bk: decode_attention_lowbit_triton(
        q, lowbit, q_pos, bits=4, scale=0.125, num_splits=2, block_k=bk,
        return_logits=True, interpret=True,
    )  # fmt: skip
    one, many = run(16), run(block_k)
    for a, b in zip(combine([many]), combine([one]), strict=True):  # splits differ: combine
        # float32, up to the summation order of the two block shapes (as the logits below)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    seen = np.asarray(lowbit.pos).reshape(*one.logits.shape[:2], 1, -1) >= 0
    seen = np.broadcast_to(seen, one.logits.shape)
    # float32 logits: equal up to the dots' summation order on the two block shapes
    np.testing.assert_allclose(
        np.asarray(many.logits)[seen], np.asarray(one.logits)[seen], rtol=1e-5, atol=1e-6
    )


LOWBIT_STEP_CASES = [
    Case(dtype=dt, tiers=t, ratio=r, head_dim=hd)
    for dt, t, r, hd in [
        ("float32", "fp+int4", 4, 64),
        ("bfloat16", "fp+int2", 3, 128),
        ("float16", "fp+int8b", 1, 64),
        ("bfloat16", "fp+int4", 4, 128),
        ("float32", "fp+int2", 1, 128),
        ("bfloat16", "fp+int4", 16, 64),  # stacked: 2 pages × 16 rows = a 32-row tile
        ("bfloat16", "fp+int8b", 2, 64),  # 8-bit codes
    ]
]


# (case, block_k, kernel): tokens_m (2- and 4-bit codes) at its default step only (2 pages,
# 1 with 16 query heads).
STEP_KERNELS = [(b, k) for b in (16, 32, None) for k in ("dequant", "stacked")]
STEP_PARAMS = [
    pytest.param(c, b, k, id=f"{c.tiers}-{c.dtype}-g{c.ratio}-{b}-{k}")
    for c in LOWBIT_STEP_CASES
    for b, k in STEP_KERNELS
    + ([(None, "tokens_m"), (16, "stacked-int8qk"), (None, "stacked-int8qk")] if c.bits < 8 else [])
]
KERNEL_KW = {
    "dequant": dict(stack_pages=False),
    "stacked": dict(stack_pages=True),
    "tokens_m": dict(tokens_m=True),
    "stacked-int8qk": dict(stack_pages=True, int8_qk=True),
}


@pytest.mark.parametrize(("case", "block_k", "kernel"), STEP_PARAMS)
def test_triton_lowbit_loop_steps_match_float64(case, block_k, kernel):
    """The low-bit kernel at one and two pages per loop step (compiled on a GPU, interpreted
    elsewhere), dequantizing keys, with the step's pages stacked on the query rows, or stacked
    with tokens on the QK dot's M axis (tokens_m), against the float64 oracle with the tolerance
    of the main class; block 32 spans two pages and overhangs the tier; None is the default
    (stacked, tokens_m: as many pages as fit 16 rows, up to 2)."""
    from kvjax.pallas_kernels.decode_attention import (
        decode_attention_lowbit_triton,
        decode_attention_triton,
    )

    interpret = jax.default_backend() != "gpu"
    q, q_pos, full, _, lowbit = make_tiers(case, _seed("lowbit_steps", case, block_k))
    scale = q.shape[-1] ** -0.5
    kw = dict(scale=scale, num_splits=2, return_logits=True, interpret=interpret)
    parts = [
        decode_attention_triton(q, full, q_pos, block_k=16, **kw),
        decode_attention_lowbit_triton(
            q,
            lowbit,
            q_pos,
            bits=case.bits,
            block_k=block_k,
            **KERNEL_KW[kernel],
            **kw,
        ),
    ]
    got_out, got_lse = combine(parts)
    out, lse, logits, seen = oracle(q, q_pos, full, None, lowbit, case.bits, scale)
    # int8_qk adds q's int8 rounding (<= max/254 per element), bfloat16's own size
    tol = TOL["bfloat16"] if kernel.endswith("int8qk") else TOL[case.dtype]
    got = np.asarray(got_out, np.float64)
    assert np.all(np.isfinite(got))
    assert np.linalg.norm(got - out) / np.linalg.norm(out) < tol
    np.testing.assert_allclose(np.asarray(got_lse), lse, atol=10 * tol)
    vis4 = np.broadcast_to(seen[-1][:, :, None], logits[-1].shape)
    np.testing.assert_allclose(
        np.asarray(parts[1].logits)[vis4], logits[-1][vis4], atol=10 * tol, rtol=tol
    )


@pytest.mark.parametrize("logits", [False, True])
def test_lowbit_default_stacks_pages_only_without_logits(monkeypatch, logits):
    """With a Tuning that stacks pages (the H200's), the default kernel is the stacked one when
    no logits are returned and the unstacked one when they are (its logits cost 2.5x inside a
    decode step, docs/decisions.md); an explicit stack_pages still wins."""
    import dataclasses

    from kvjax.pallas_kernels.decode_attention import _triton_lowbit

    tune = dataclasses.replace(_triton_lowbit.tuning_for(), lowbit_stack_pages=True)
    monkeypatch.setattr(_triton_lowbit, "tuning_for", lambda: tune)
    traced = []
    for name in ("_kernel", "_kernel_stacked"):
        real = getattr(_triton_lowbit, name)
        spy = lambda *a, real=real, name=name, **k: (traced.append(name), real(*a, **k))[1]
        monkeypatch.setattr(_triton_lowbit, name, spy)
    case = Case(dtype="bfloat16", tiers="fp+int4", ratio=4, head_dim=64)
    q, q_pos, _, _, lowbit = make_tiers(case, _seed("default_stack", logits))
    kw = dict(bits=4, scale=0.125, num_splits=2, return_logits=logits, interpret=True)
    jax.jit(lambda q: _triton_lowbit.decode_attention_lowbit_triton(q, lowbit, q_pos, **kw))(q)
    assert set(traced) == {"_kernel" if logits else "_kernel_stacked"}
    traced.clear()
    _triton_lowbit.decode_attention_lowbit_triton(q, lowbit, q_pos, stack_pages=True, **kw)
    assert set(traced) == {"_kernel_stacked"}


@pytest.mark.parametrize("bits,dtype", [(4, "bfloat16"), (2, "bfloat16"), (4, "float16")])
def test_lowbit_default_int8_qk_by_code_width(monkeypatch, bits, dtype):
    """A Tuning's lowbit_int8_qk_bits picks the stacked kernel's int8 QK by default for the
    listed code widths and a bfloat16 q only; an explicit int8_qk still wins."""
    import dataclasses

    from kvjax.pallas_kernels.decode_attention import _triton_lowbit

    tune = dataclasses.replace(
        _triton_lowbit.tuning_for(), lowbit_stack_pages=True, lowbit_int8_qk_bits=(4,)
    )
    monkeypatch.setattr(_triton_lowbit, "tuning_for", lambda: tune)
    jax.clear_caches()
    seen = []
    real = _triton_lowbit._kernel_stacked
    spy = lambda *a, **k: (seen.append(k["int8_qk"]), real(*a, **k))[1]
    monkeypatch.setattr(_triton_lowbit, "_kernel_stacked", spy)
    case = Case(dtype=dtype, tiers=f"fp+int{bits}", ratio=4, head_dim=64)
    q, q_pos, _, _, lowbit = make_tiers(case, _seed("default_int8_qk", bits, dtype))
    kw = dict(bits=bits, scale=0.125, num_splits=2, interpret=True)
    run = _triton_lowbit.decode_attention_lowbit_triton
    jax.eval_shape(lambda q: run(q, lowbit, q_pos, **kw), q)
    assert seen == [bits == 4 and dtype == "bfloat16"]
    seen.clear()
    jax.eval_shape(lambda q: run(q, lowbit, q_pos, int8_qk=True, **kw), q)
    assert seen == [True]


@pytest.mark.parametrize("logits", [False, True])
def test_lowbit_default_tokens_m_only_without_logits(monkeypatch, logits):
    """A Tuning with lowbit_tokens_m runs `kernel_tokens_m` by default when no logits are
    returned (its logits are the stacked kernel's padded rows), the unstacked kernel when they
    are; tokens_m with stack_pages, or with 8-bit codes, is one clear error."""
    import dataclasses

    from kvjax.pallas_kernels.decode_attention import _triton_lowbit, _triton_lowbit_tm

    tune = dataclasses.replace(_triton_lowbit.tuning_for(), lowbit_tokens_m=True)
    monkeypatch.setattr(_triton_lowbit, "tuning_for", lambda: tune)
    jax.clear_caches()  # a trace cached by another test would skip the kernel choice
    traced = []
    for mod, name in ((_triton_lowbit, "_kernel"), (_triton_lowbit_tm, "kernel_tokens_m")):
        real = getattr(mod, name)
        spy = lambda *a, real=real, name=name, **k: (traced.append(name), real(*a, **k))[1]
        monkeypatch.setattr(mod, name, spy)
    case = Case(dtype="bfloat16", tiers="fp+int4", ratio=4, head_dim=64)
    q, q_pos, _, _, lowbit = make_tiers(case, _seed("default_tokens_m", logits))
    kw = dict(bits=4, scale=0.125, num_splits=2, return_logits=logits, interpret=True)
    run = _triton_lowbit.decode_attention_lowbit_triton
    jax.eval_shape(lambda q: run(q, lowbit, q_pos, **kw), q)
    assert set(traced) == {"_kernel" if logits else "kernel_tokens_m"}
    with pytest.raises(ValueError, match="tokens_m and stack_pages are two different kernels"):
        _triton_lowbit.decode_attention_lowbit_triton(
            q, lowbit, q_pos, tokens_m=True, stack_pages=True, **kw
        )
    q8, q8_pos, _, _, lowbit8 = make_tiers(Case("bfloat16", "fp+int8b", 4, 64), 1)
    with pytest.raises(ValueError, match="tokens_m needs 2- or 4-bit codes, got 8"):
        _triton_lowbit.decode_attention_lowbit_triton(
            q8, lowbit8, q8_pos, tokens_m=True, **{**kw, "bits": 8}
        )


def _bad_inputs():
    """(name, kwargs of decode_attention with one thing wrong, message) from a good fp+int4 case."""
    case = Case(dtype="bfloat16", tiers="fp+int4", ratio=2, head_dim=64)
    q, q_pos, full, _, lowbit = make_tiers(case, _seed("bad"))
    int8 = make_tiers(Case(dtype="bfloat16", tiers="fp+int8", ratio=2, head_dim=64), 1)[3]
    good = dict(q=q, q_pos=q_pos, full=full, lowbit=lowbit, bits=4)
    bad = [
        ("q 3 axes", dict(q=q[0]), r"q must be \[B, Hkv, G, D\]"),
        ("q int", dict(q=q.astype(jnp.int32)), "q has dtype int32"),
        ("q_pos float", dict(q_pos=q_pos.astype(jnp.float32)), "q_pos has dtype float32"),
        ("q_pos batch", dict(q_pos=q_pos[:1]), r"q_pos has shape \(1,\); expected \(2,\)"),
        ("full D", dict(full=full._replace(k=full.k[..., :32])), "FullTier.k has shape"),
        ("k/v dtypes", dict(full=full._replace(v=full.v.astype(jnp.float32))), "differ in dtype"),
        ("full pos", dict(full=full._replace(pos=full.pos[0])), r"FullTier.pos must be \[B"),
        ("extent", dict(full=full._replace(extent=full.extent[0])), "FullTier.extent has shape"),
        ("int8 codes", dict(int8=int8._replace(k=int8.k.astype(jnp.float32))), "Int8Tier.k has"),
        ("int8 type", dict(int8=full), "int8 must be an Int8Tier"),
        ("int8 scale", dict(int8=int8._replace(v_scale=int8.v_scale[..., None])), "v_scale"),
        ("bits 3", dict(bits=3), "bits must be 2, 4 or 8"),
        ("bits vs width", dict(bits=2), "packed width 32 does not hold D=64 channels at 2 bits"),
        ("lowbit codes", dict(lowbit=lowbit._replace(k=lowbit.k.astype(jnp.int8))), "uint8"),
        ("groups", dict(lowbit=lowbit._replace(v_scale=lowbit.v_scale[..., :0])), "value groups"),
        ("lowbit pos", dict(lowbit=lowbit._replace(pos=lowbit.pos[..., :1])), "LowBitTier.pos"),
    ]
    return good, bad


BAD = ("q 3 axes", "q int", "q_pos float", "q_pos batch", "full D", "k/v dtypes", "full pos")
BAD += ("extent", "int8 codes", "int8 type", "int8 scale", "bits 3", "bits vs width")
BAD += ("lowbit codes", "groups", "lowbit pos")


@pytest.mark.parametrize("backend", ["triton", "tpu"])
@pytest.mark.parametrize("name", BAD)
def test_bad_inputs_raise_clear_errors(backend, name):
    """Each wrong shape, dtype or tier type is named before any kernel is lowered."""
    good, bad = _bad_inputs()
    change, message = {n: (c, m) for n, c, m in bad}[name]
    kw = {**good, **change}
    with pytest.raises(ValueError, match=message):
        decode_attention(
            kw.pop("q"), kw.pop("q_pos"), scale=0.125, backend=backend, interpret=True, **kw
        )


def test_bad_input_list_is_complete():
    assert tuple(n for n, _, _ in _bad_inputs()[1]) == BAD


def test_kernel_entry_points_check_their_tier():
    from kvjax.pallas_kernels.decode_attention import (
        decode_attention_lowbit_triton,
        decode_attention_tpu,
        decode_attention_triton,
    )

    good, _ = _bad_inputs()
    q, q_pos, full, lowbit = good["q"], good["q_pos"], good["full"], good["lowbit"]
    with pytest.raises(ValueError, match="must be a FullTier or Int8Tier, got LowBitTier"):
        decode_attention_triton(q, lowbit, q_pos, scale=0.125, interpret=True)
    with pytest.raises(ValueError, match="must be a FullTier or Int8Tier, got LowBitTier"):
        decode_attention_tpu(q, lowbit, q_pos, scale=0.125, interpret=True)
    with pytest.raises(ValueError, match="must be a LowBitTier, got FullTier"):
        decode_attention_lowbit_triton(q, full, q_pos, bits=4, scale=0.125, interpret=True)


INT8_QK_CASES = [
    Case(dtype=dt, tiers="fp+int8", ratio=r, head_dim=hd)
    for dt, r, hd in [("float32", 4, 64), ("bfloat16", 3, 128), ("float16", 1, 64)]
]


@pytest.mark.parametrize("case", INT8_QK_CASES, ids=lambda c: f"{c.dtype}-g{c.ratio}-d{c.head_dim}")
def test_triton_int8_qk_matches_float64(case):
    """The INT8 kernel with q quantized per query head and an int8 QK dot (compiled on a GPU,
    interpreted elsewhere) against the float64 oracle. q's rounding (≤ max|q|/254 per element)
    bounds the extra logit error, so the tolerance is bfloat16's for every dtype; the result
    must also differ from the unquantized-q kernel (the knob took effect)."""
    from kvjax.pallas_kernels.decode_attention import decode_attention_triton

    interpret = jax.default_backend() != "gpu"
    q, q_pos, full, int8, _ = make_tiers(case, _seed("int8_qk", case))
    scale = q.shape[-1] ** -0.5
    kw = dict(scale=scale, num_splits=2, block_k=16, return_logits=True, interpret=interpret)
    full_part = decode_attention_triton(q, full, q_pos, **kw)
    qk8, plain = (decode_attention_triton(q, int8, q_pos, int8_qk=f, **kw) for f in (True, False))
    got_out, got_lse = combine([full_part, qk8])
    out, lse, logits, seen = oracle(q, q_pos, full, int8, None, None, scale)
    got = np.asarray(got_out, np.float64)
    assert np.all(np.isfinite(got))
    err = np.linalg.norm(got - out) / np.linalg.norm(out)
    assert err < TOL["bfloat16"]
    np.testing.assert_allclose(np.asarray(got_lse), lse, atol=10 * TOL["bfloat16"])
    vis = np.broadcast_to(seen[1][:, :, None], logits[1].shape)
    np.testing.assert_allclose(np.asarray(qk8.logits)[vis], logits[1][vis], atol=0.1)
    assert not np.array_equal(np.asarray(qk8.logits)[vis], np.asarray(plain.logits)[vis])


def test_int8_qk_needs_an_int8_tier():
    from kvjax.pallas_kernels.decode_attention import decode_attention_triton

    case = Case(dtype="bfloat16", tiers="fp", ratio=2, head_dim=64)
    q, q_pos, full, _, _ = make_tiers(case, 0)
    with pytest.raises(ValueError, match="int8_qk applies to an Int8Tier only"):
        decode_attention_triton(q, full, q_pos, scale=0.125, int8_qk=True, interpret=True)


@pytest.mark.parametrize("dtype,on", [("bfloat16", True), ("float32", False), ("float16", False)])
def test_tuned_int8_qk_applies_to_bfloat16_queries_only(triton_tuned, dtype, on):
    """A device tuned with int8_qk quantizes q by default only when q is bfloat16 (whose own
    rounding is of q8's size); float16/float32 queries keep the exact-conversion path."""
    from kvjax.pallas_kernels.decode_attention import _tuning

    kernel = triton_tuned(_tuning.Tuning(block_k=16, target_programs=4, int8_qk=True))
    case = Case(dtype=dtype, tiers="fp+int8", ratio=2, head_dim=64)
    q, q_pos, _, int8, _ = make_tiers(case, _seed("int8_qk_default", dtype))
    kw = dict(scale=0.125, num_splits=2, return_logits=True, interpret=True)
    default, forced_on, forced_off = (
        kernel(q, int8, q_pos, int8_qk=f, **kw) for f in (None, True, False)
    )
    want, other = (forced_on, forced_off) if on else (forced_off, forced_on)
    np.testing.assert_array_equal(np.asarray(default.logits), np.asarray(want.logits))
    assert not np.array_equal(np.asarray(default.logits), np.asarray(other.logits))


@pytest.mark.parametrize("view", ["v_words", "k_pairs"])
@pytest.mark.parametrize("int8_qk", [False, True], ids=["cvt-qk", "int8-qk"])
@pytest.mark.parametrize("case", INT8_QK_CASES, ids=lambda c: f"{c.dtype}-g{c.ratio}-d{c.head_dim}")
def test_triton_int8_code_views_match_float64(case, int8_qk, view):
    """The INT8 kernel reading its codes through a wider view — value codes as int32 words of 4
    channels (bytes split in registers, 4 value dots, channel order restored outside), or key
    codes as int16 pairs of channels (the view a stack of 2^31 code bytes or more needs; 2 key
    dots over q's even and odd channels) — against the float64 oracle, and against the
    byte-wise kernel: the same products, so equal logits where the QK dot is unchanged or
    integer (int8 QK), else equal to float32 rounding."""
    from kvjax.pallas_kernels.decode_attention import decode_attention_triton

    interpret = jax.default_backend() != "gpu"
    q, q_pos, full, int8, _ = make_tiers(case, _seed(view, case, int8_qk))
    scale = q.shape[-1] ** -0.5
    kw = dict(scale=scale, num_splits=2, block_k=16, int8_qk=int8_qk, return_logits=True)
    kw |= dict(interpret=interpret)
    full_part = decode_attention_triton(q, full, q_pos, **kw | dict(int8_qk=None))
    on, off = (decode_attention_triton(q, int8, q_pos, **kw, **{view: f}) for f in (True, False))
    got_out, got_lse = combine([full_part, on])
    out, lse, _, seen = oracle(q, q_pos, full, int8, None, None, scale)
    got = np.asarray(got_out, np.float64)
    assert np.all(np.isfinite(got))
    tol = TOL["bfloat16"] if int8_qk else TOL[case.dtype]
    assert np.linalg.norm(got - out) / np.linalg.norm(out) < tol
    np.testing.assert_allclose(np.asarray(got_lse), lse, atol=10 * tol)
    np.testing.assert_allclose(np.asarray(on.out), np.asarray(off.out), rtol=1e-5, atol=1e-6)
    # slots past the extent are never written (on a GPU: whatever the buffer held)
    vis = np.broadcast_to(seen[1][:, :, None], off.logits.shape)
    a, b = np.asarray(on.logits)[vis], np.asarray(off.logits)[vis]
    if view == "v_words" or int8_qk:
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(np.asarray(on.lse), np.asarray(off.lse))
    else:
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_key_pairs_need_an_int8_tier_and_an_even_head_dim():
    from kvjax.pallas_kernels.decode_attention import decode_attention_triton

    case = Case(dtype="bfloat16", tiers="fp+int8", ratio=2, head_dim=64)
    q, q_pos, full, int8, _ = make_tiers(case, 0)
    with pytest.raises(ValueError, match="k_pairs applies to an Int8Tier only"):
        decode_attention_triton(q, full, q_pos, scale=0.125, k_pairs=True, interpret=True)
    odd = int8._replace(k=int8.k[..., :63], v=int8.v[..., :63])
    with pytest.raises(ValueError, match="k_pairs needs a head dim divisible by 2, got 63"):
        decode_attention_triton(q[..., :63], odd, q_pos, scale=0.1, k_pairs=True, interpret=True)


def test_value_words_need_an_int8_tier():
    from kvjax.pallas_kernels.decode_attention import decode_attention_triton

    case = Case(dtype="bfloat16", tiers="fp", ratio=2, head_dim=64)
    q, q_pos, full, _, _ = make_tiers(case, 0)
    with pytest.raises(ValueError, match="v_words applies to an Int8Tier only"):
        decode_attention_triton(q, full, q_pos, scale=0.125, v_words=True, interpret=True)
