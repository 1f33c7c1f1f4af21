"""The Mosaic GPU low-bit kernel (tokens on the wgmma M axis) vs the float64 oracle, compiled on a
GPU and interpreted on CPU; its layout (`to_channel_major`) against the tier it comes from.

`TestMgpuLowbit` compiles the `plgpu` kernel (skipped without a GPU); `TestMgpuLowbitInterpret`
reruns it in the Mosaic GPU interpreter. Pages have holes, one head stops pages early, a page in
the middle is dormant, and sequence 1 has half its positions in its future.
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

from kvjax import quant
from kvjax.eval._kernel_ir import H200
from kvjax.pallas_kernels.decode_attention import (
    MGPU_LOWBIT_PAGE,
    ChannelMajorLowBitTier,
    combine,
    decode_attention,
    decode_attention_lowbit_mgpu,
    to_channel_major,
)
from kvjax.pallas_kernels.decode_attention._mgpu_lowbit import INT4_LOADS

TOL = 2e-2  # bfloat16 operands


def _tiers(case: Case, seed: int, value_group: int = 64, native: bool | str = False):
    """(q, q_pos, channel-major tier, oracle tiers (empty full, low-bit)) with 64-token pages
    (`native`: int4 codes; "words": the words layout)."""
    q, q_pos, full, _, lowbit = make_tiers(
        case, seed, page=MGPU_LOWBIT_PAGE, value_group=value_group
    )
    empty = full._replace(pos=jnp.full_like(full.pos, -1))
    words = native == "words"
    cm = to_channel_major(lowbit, case.bits, native=bool(native) and not words, words=words)
    return q, q_pos, cm, (empty, lowbit)


CASES = [
    Case(dtype="bfloat16", tiers="fp+int4", ratio=4, head_dim=128, cap=200),
    Case(dtype="bfloat16", tiers="fp+int2", ratio=4, head_dim=128, cap=200),
    Case(dtype="bfloat16", tiers="fp+int4", ratio=1, head_dim=64, cap=200),
    Case(dtype="bfloat16", tiers="fp+int2", ratio=3, head_dim=64, cap=200),
    Case(dtype="bfloat16", tiers="fp+int4", ratio=16, head_dim=128, cap=200),
]

# ~24 pages of INT2, G 4, D 128: about 8 pages a split at 3 splits
LONG = dataclasses.replace(CASES[1], cap=1500)


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


class TestMgpuLowbit:
    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _needs_device(self):
        if not self.INTERPRET and jax.default_backend() != "gpu":
            pytest.skip("compiled Mosaic GPU kernels need a GPU; the Interpret class covers CPU")

    @pytest.mark.parametrize("splits", [1, 3])
    @pytest.mark.parametrize(
        "case, native",
        [(c, False) for c in CASES]
        + [(c, True) for c in CASES if c.bits == 4 or c.head_dim == 128],
        ids=lambda x: f"{x.tiers}-g{x.ratio}-d{x.head_dim}" if isinstance(x, Case) else
        ("int4codes" if x else "bytes"),
    )  # fmt: skip
    def test_matches_float64(self, case, native, splits):
        self._check(case, native, splits, return_logits=splits == 3)  # with and without

    @pytest.mark.parametrize("load", INT4_LOADS)
    @pytest.mark.parametrize(
        "case", [CASES[0], CASES[1]], ids=lambda c: f"{c.tiers}-g{c.ratio}-d{c.head_dim}"
    )
    def test_each_int4_load_matches_float64(self, case, load):
        """The register layouts the int4 codes load into (`int4_load`), each compiled."""
        if self.INTERPRET:
            pytest.skip("register layouts are a compiled kernel's; the interpreter has none")
        self._check(case, True, 3, int4_load=load)

    @pytest.mark.parametrize(
        "case, native", [(CASES[0], True), (CASES[1], False), (CASES[3], False)],
        ids=["int4codes-g4", "int2-g4", "int2-g3-d64"],
    )  # fmt: skip
    def test_two_pages_a_step_match_float64(self, case, native):
        """pages_per_step=2: a step's two pages under one softmax update; 3 pages (200 slots),
        so the last step copies pages 1-2 and attends page 2 only, and an odd extent leaves a
        step's second page unread (one head stops pages early)."""
        self._check(case, native, 3, pages_per_step=2, return_logits=True)

    @pytest.mark.parametrize(
        "case, native",
        [(CASES[0], True), (CASES[1], True), (CASES[3], False), (CASES[4], False)],
        ids=["int4codes-g4", "int2codes-g4", "int2-g3-d64", "int4-g16"],
    )  # fmt: skip
    def test_folded_key_statistics_match_float64(self, case, native):
        """fold_keys=True: each page's key scale on q ((q⊙scale)^T the B operand), the zeros'
        share a float32 bias per column, the codes unscaled; with logits (they come from the
        same S) and 3 splits; int4 codes also with int4_offset (codes read as code + 136, the
        offset taken out through the bias and the value zeros' tile)."""
        self._check(case, native, 3, fold_keys=True, return_logits=True, one_barrier=True)
        if native:
            self._check(case, native, 3, fold_keys=True, int4_offset=True, return_logits=True)

    @pytest.mark.parametrize(
        "case, native, kw",
        [
            (CASES[1], "words", dict(one_barrier=True, return_logits=True)),
            (CASES[1], True, dict(fold_keys=True, int4_offset=True, one_barrier=True)),
            (CASES[0], True, dict(return_logits=True, stages=3)),
            (CASES[3], False, dict(return_logits=True, num_splits=6)),
            (CASES[4], False, dict(fold_keys=True, lean_barriers=True)),
        ],
        ids=["int2-words-logits", "int2codes-hopper", "int4codes-3stages",
             "int2-g3-d64-empty-splits", "int4-g16-fold-lean"],
    )  # fmt: skip
    def test_overlapped_pages_match_float64(self, case, native, kw):
        """overlap=True: page i's QK dot issued with page i - 1's PV dots, one wait a turn, a
        last turn that only finishes the last page; with 6 splits of 4 pages some splits have
        no page at all (their one turn reads none)."""
        kw = {"num_splits": 3, **kw}
        self._check(case, native, kw.pop("num_splits"), overlap=True, **kw)

    @pytest.mark.parametrize(
        "case, kw",
        [
            (CASES[0], dict(return_logits=True)),
            (CASES[1], dict(return_logits=True, one_barrier=True)),
            (CASES[4], dict(one_barrier=True)),
            (CASES[1], dict(pages_per_step=2, lean_barriers=True)),
            (CASES[1], dict(one_barrier=True, words_lop3=True)),
        ],
        ids=["int4-g4-logits", "int2-g4-logits", "int4-g16", "int2-g4-two-pages-lean",
             "int2-g4-lop3"],
    )  # fmt: skip
    def test_words_layout_matches_float64(self, case, kw):
        """The words layout (`to_channel_major(words=True)`): each thread's codes by 128-bit
        loads, a register's pair by one AND-OR into 128 + code·2^pos, the powers of two out
        through q and the value scales, the 128 through the bias and the value zeros' tile;
        compiled, this checks the register order against the wgmma fragment."""
        self._check(case, "words", 3, **kw)

    @pytest.mark.parametrize(
        "case, native, kw",
        [
            (CASES[1], True, dict(int4_offset=True, one_barrier=True, return_logits=True)),
            (CASES[1], "words", dict(one_barrier=True)),
            (CASES[0], "words", dict(return_logits=True)),
            (CASES[3], False, dict(pages_per_step=2)),
            (LONG, "words", dict(one_barrier=True)),
            (LONG, True, dict(int4_offset=True, stages=3)),
            (LONG, "words", dict(overlap=True, one_barrier=True)),
        ],
        ids=["int2codes-offset-logits", "int2-words", "int4-words-six-barriers",
             "int2-g3-d64-two-pages", "int2-words-long", "int2codes-offset-long-3-stages",
             "int2-words-long-overlapped"],
    )  # fmt: skip
    def test_key_bias_before_the_launch_matches_float64(self, case, native, kw):
        """bias_outside=True: each page's key bias (the zeros on q, less the offset codes'
        share) computed by XLA before the launch (`key_bias`), a split's biases copied to
        shared memory once before its loop; one barrier or one a copy; 3 splits. The long
        cases read ~8 pages a split (one overlapped: its last turn reads no page)."""
        self._check(case, native, 3, fold_keys=True, bias_outside=True, **kw)

    @pytest.mark.parametrize(
        "case, native, kw",
        [
            (CASES[1], "words", dict(one_barrier=True, return_logits=True)),
            (CASES[0], "words", dict()),
            (CASES[1], True, dict(int4_offset=True, one_barrier=True, return_logits=True)),
            (CASES[0], True, dict(int4_offset=True)),
            (CASES[4], False, dict(one_barrier=True)),
            (CASES[3], False, dict(pages_per_step=2, return_logits=True)),
            (LONG, "words", dict(overlap=True, one_barrier=True, lean_barriers=True)),
            (LONG, True, dict(int4_offset=True, stages=3)),
        ],
        ids=["int2-words-logits", "int4-words", "int2codes-offset-logits", "int4codes-offset",
             "int4-g16-bytes", "int2-g3-d64-two-pages", "int2-words-long-overlapped-lean",
             "int2codes-offset-long-3-stages"],
    )  # fmt: skip
    def test_tensor_core_key_bias_matches_float64(self, case, native, kw):
        """tc_bias=True: each page's key bias added by two more dots into S (the constant
        -offset tile against (q⊙scale)^T, the zero row in every row against q^T) instead of
        the sum across warps; with and without an offset (words 128, int4 codes 136, bytes
        none), two pages a step, the overlapped loop, ~8 pages a split in the long cases."""
        self._check(case, native, 3, fold_keys=True, tc_bias=True, **kw)

    @pytest.mark.parametrize(
        "case, native, kw",
        [
            (CASES[1], "words", dict(one_barrier=True, return_logits=True)),
            (CASES[0], "words", dict()),
            (CASES[1], True, dict(int4_offset=True, one_barrier=True, return_logits=True)),
            (CASES[0], False, dict()),
            (CASES[1], "words", dict(pages_per_step=2, tc_bias=True)),
            (LONG, "words", dict(one_barrier=True, lean_barriers=True)),
            (LONG, True, dict(int4_offset=True, stages=3)),
        ],
        ids=["int2-words-logits", "int4-words", "int2codes-offset-logits", "int4-bytes",
             "int2-words-two-pages-tc-bias", "int2-words-long-lean",
             "int2codes-offset-long-3-stages"],
    )  # fmt: skip
    def test_split_key_dot_matches_float64(self, case, native, kw):
        """qk_split=True: each page's QK dot as two chains, key channels [0, 64) and [64, 128)
        into two accumulators, S their sum; the words layout (half the registers each), int4
        codes at 2 bits and bytes at 4 (a code slice each), two pages a step, ~8 pages a
        split in the long cases."""
        self._check(case, native, 3, fold_keys=True, qk_split=True, **kw)

    @pytest.mark.parametrize(
        "case, kw",
        [
            (CASES[1], dict(one_barrier=True, return_logits=True)),
            (CASES[0], dict(qk_split=True)),
            (CASES[4], dict()),
            (CASES[1], dict(pages_per_step=2, return_logits=True)),
            (CASES[1], dict(bias_outside=True, one_barrier=True)),
            (LONG, dict(overlap=True, one_barrier=True, lean_barriers=True)),
            (LONG, dict(stages=3, return_logits=True)),
        ],
        ids=["int2-logits", "int4-split-dot", "int4-g16", "int2-two-pages", "int2-bias-outside",
             "int2-long-overlapped-lean", "int2-long-3-stages"],
    )  # fmt: skip
    def test_subnormal_codes_match_float64(self, case, kw):
        """subnormal=True: the words' codes as subnormal bfloat16s (no 128), S and out^T from
        the dots at 2^-64 of their size, q^T and the probabilities at 2^69; with logits (the
        same S scaled back), two pages a step, the key bias before the launch, the overlapped
        loop, ~8 pages a split in the long cases. Compiled, this checks that the tensor cores
        keep subnormal operands; interpreted, the scaling (normal codes, 2^-64 on q and p)."""
        self._check(case, "words", 3, subnormal=True, **kw)

    @pytest.mark.parametrize(
        "case, native, kw",
        [
            (CASES[1], True, dict(fold_keys=True, int4_offset=True, one_barrier=True)),
            (CASES[0], True, dict(return_logits=True)),
            (CASES[3], False, dict(pages_per_step=2, return_logits=True)),
            (CASES[4], False, dict(fold_keys=True)),
        ],
        ids=["int2codes-hopper", "int4codes-logits", "int2-g3-d64-two-pages", "int4-g16-fold"],
    )  # fmt: skip
    def test_lean_barriers_match_float64(self, case, native, kw):
        """lean_barriers=True (no barrier Pallas would add around each shared-memory store or
        before each TMA copy): the kernel's own commit_smem barriers order every hazard, over
        3 splits and many pages a split, with Hopper's INT2 knobs and without."""
        self._check(case, native, 3, lean_barriers=True, **kw)

    @pytest.mark.parametrize("native", [True, False], ids=["int4codes", "bytes"])
    def test_the_tunings_knobs_equal_the_same_knobs_per_call(self, monkeypatch, native):
        """A device's Tuning naming these bits for all four knobs (as Hopper's does for INT2)
        runs the kernel a call with the same knobs explicit runs, bit for bit."""
        case = CASES[1]  # INT2, G 4, D 128
        q, q_pos, tier, _ = _tiers(case, _seed("tuning", self.INTERPRET, native), native=native)
        run = functools.partial(
            decode_attention_lowbit_mgpu, q, tier, q_pos, bits=2, scale=0.1, num_splits=3,
            stages=2, return_logits=True, interpret=self.INTERPRET,
        )  # fmt: skip
        want = run(fold_keys=True, int4_offset=native, one_barrier=True, lean_barriers=True)
        knobs = (
            "mgpu_lowbit_fold_keys",
            "mgpu_lowbit_int4_offset",
            "mgpu_lowbit_one_barrier",
            "mgpu_lowbit_lean_barriers",
        )
        monkeypatch.setenv("KVJAX_TUNING", ",".join(f"{k}=2" for k in knobs))
        jax.clear_caches()  # the Tuning is read when the call is traced
        try:
            got = run()
        finally:
            monkeypatch.delenv("KVJAX_TUNING")
            jax.clear_caches()
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))

    def _check(self, case, native, splits, **kw):
        seed = _seed(case, splits, self.INTERPRET, native)
        q, q_pos, tier, (full, lowbit) = _tiers(case, seed, native=native)
        scale = q.shape[-1] ** -0.5
        kw = {"stages": 2, **kw}
        res = decode_attention_lowbit_mgpu(
            q, tier, q_pos, bits=case.bits, scale=scale, num_splits=splits,
            interpret=self.INTERPRET, **kw,
        )  # fmt: skip
        out, lse = combine([res])
        want, want_lse, logits, seen = oracle(q, q_pos, full, None, lowbit, case.bits, scale)
        got = np.asarray(out, np.float64)
        assert np.all(np.isfinite(got))
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < TOL
        np.testing.assert_allclose(np.asarray(lse), want_lse, atol=10 * TOL)
        if kw.get("return_logits"):  # the low-bit tier's logits, [B, Hkv, G, P·64]
            _check_logits(res.logits, logits[-1], seen[-1], tier.extent)
        else:
            assert res.logits is None

    def test_nothing_visible_gives_zero_and_minus_inf(self):
        case = CASES[0]
        q, q_pos, tier, _ = _tiers(case, _seed("empty", self.INTERPRET))
        tier = tier._replace(pos=jnp.full_like(tier.pos, -1))
        res = decode_attention_lowbit_mgpu(
            q, tier, q_pos, bits=4, scale=0.1, num_splits=2, interpret=self.INTERPRET
        )
        out, lse = combine([res])
        assert np.all(np.asarray(out) == 0)
        assert np.all(np.asarray(lse) == -np.inf)


class TestMgpuLowbitInterpret(TestMgpuLowbit):
    INTERPRET = True


def _f32(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def _slice_values(packed: np.ndarray, c: int, bits: int) -> np.ndarray:
    """What the kernel reads for code slice c: the masked byte as a signed int8."""
    mask = ((1 << bits) - 1) << (c * bits)
    return (packed & mask).astype(np.uint8).view(np.int8).astype(np.float64)


def _nibble_values(codes: np.ndarray, c: int, bits: int) -> np.ndarray:
    """What the kernel reads for nibble slice c of int4 codes: one mask, read as signed int4."""
    v = (codes.astype(np.int64) & 0xF) & (((1 << bits) - 1) << (c * bits))
    return np.where(v >= 8, v - 16, v).astype(np.float64)


@pytest.mark.parametrize("codes", ["bytes", "int4"])
@pytest.mark.parametrize("bits", [2, 4])
def test_channel_major_dequantizes_to_the_same_keys_and_values(bits, codes):
    """Every key and value, rebuilt from the channel-major layout as the kernel reads it (code
    slices by mask — of a byte read as int8, or of an int4 nibble (`native=True`) read as
    signed int4 — and kernel-ready statistics), equals the token-major tier's dequantized one up
    to the one bfloat16 rounding of the adjusted zero."""
    case = Case(dtype="bfloat16", tiers=f"fp+int{bits}", ratio=2, head_dim=128, cap=130)
    native = codes == "int4"
    _, _, cm, (_, lowbit) = _tiers(case, _seed("layout", bits, codes), native=native)
    if native:  # a nibble holds 4/bits slices: key channels, value halves (axis -2)
        assert cm.k.dtype == jnp.int4 and cm.v.dtype == jnp.int4
        n, read, v_axis = 4 // bits, _nibble_values, -2
        kc, vc = (np.asarray(x.astype(jnp.int8)) for x in (cm.k, cm.v))
    else:  # a byte holds 8/bits slices: key channels, value tokens (axis -1)
        n, read, v_axis = 8 // bits, _slice_values, -1
        kc, vc = np.asarray(cm.k), np.asarray(cm.v)
    d = 128
    ks, kz = _f32(cm.k_stats[:, :, :, 0]), _f32(cm.k_stats[:, :, :, 1])  # [B, Hkv, P, D]
    k_cm = np.concatenate(
        [read(kc, c, bits) for c in range(n)], axis=-1
    )  # [B, Hkv, P, Tp, D]: slice c holds channels c·w ... (c+1)·w
    k_cm = k_cm * ks[:, :, :, None] + kz[:, :, :, None]
    k_ref = _f32(quant.unpack(lowbit.k, bits)) * _f32(lowbit.k_scale)[:, :, :, None]
    k_ref = k_ref + _f32(lowbit.k_zero)[:, :, :, None]
    bound = 2.0**-8 * (np.abs(kz) + 2.0**bits * np.abs(ks))[:, :, :, None] + 1e-6
    assert np.all(np.abs(k_cm - k_ref) <= bound)
    vs, vz = _f32(cm.v_stats[:, :, :, 0]), _f32(cm.v_stats[:, :, :, 1])  # [B, Hkv, P, NG, Tp]
    ng = vs.shape[3]
    v_cm = np.concatenate([read(vc, c, bits) for c in range(n)], axis=v_axis)  # [.., D, Tp]
    group = np.arange(d) // (d // ng)
    v_cm = v_cm * vs[:, :, :, group] + vz[:, :, :, group]
    v_ref = _f32(quant.unpack(lowbit.v, bits)).reshape(*lowbit.v.shape[:4], ng, d // ng)
    v_ref = v_ref * _f32(lowbit.v_scale)[..., None] + _f32(lowbit.v_zero)[..., None]
    v_ref = np.swapaxes(v_ref.reshape(*lowbit.v.shape[:4], d), -1, -2)
    bound = 2.0**-8 * (np.abs(vz) + 2.0**bits * np.abs(vs))[:, :, :, group] + 1e-6
    assert np.all(np.abs(v_cm - v_ref) <= bound)
    np.testing.assert_array_equal(np.asarray(cm.pos), np.asarray(lowbit.pos))


def test_int4_codes_at_two_bits_need_d128_and_value_groups_of_64():
    small = Case(dtype="bfloat16", tiers="fp+int2", ratio=2, head_dim=64, cap=130)
    lowbit = make_tiers(small, 1, page=MGPU_LOWBIT_PAGE, value_group=64)[4]
    with pytest.raises(ValueError, match="D = 128 and value groups of 64"):
        to_channel_major(lowbit, 2, native=True)


def test_key_biases_past_their_shared_memory_get_one_clear_error(monkeypatch):
    """bias_outside=True holds a split's key biases in shared memory: more than fit is
    refused, naming the pages, the columns and the bound."""
    from kvjax.pallas_kernels.decode_attention import _mgpu_lowbit

    case = Case(dtype="bfloat16", tiers="fp+int2", ratio=4, head_dim=128, cap=130)
    q, q_pos, tier, _ = _tiers(case, 2, native=True)
    monkeypatch.setattr(_mgpu_lowbit, "BIAS_SMEM", 64)
    jax.clear_caches()  # the bound is read when the call is traced
    try:
        with pytest.raises(ValueError, match=r"3 pages x 8 columns x 4 bytes > 64"):
            decode_attention_lowbit_mgpu(
                q, tier, q_pos, bits=2, scale=0.1, num_splits=1, fold_keys=True,
                bias_outside=True, interpret=True,
            )  # fmt: skip
    finally:
        jax.clear_caches()


def test_unsupported_input_gets_one_clear_error():
    case = Case(dtype="bfloat16", tiers="fp+int4", ratio=4, head_dim=128, cap=130)
    q, q_pos, tier, (_, lowbit) = _tiers(case, 1)
    run = functools.partial(decode_attention_lowbit_mgpu, scale=0.1, interpret=True)
    with pytest.raises(ValueError, match="q dtype float32"):
        run(q.astype(jnp.float32), tier, q_pos, bits=4)
    with pytest.raises(ValueError, match="must be a ChannelMajorLowBitTier"):
        run(q, lowbit, q_pos, bits=4)
    with pytest.raises(ValueError, match="packed width"):
        run(q, tier, q_pos, bits=2)
    with pytest.raises(ValueError, match="must be 2 or 4"):
        run(q, tier, q_pos, bits=8)
    with pytest.raises(ValueError, match="pages_per_step must be 1 or 2"):
        run(q, tier, q_pos, bits=4, pages_per_step=3)
    first = lambda a: a[:, :, :1]  # the tier's first page only
    t1 = tier._replace(k=first(tier.k), v=first(tier.v), k_stats=first(tier.k_stats),
                       v_stats=first(tier.v_stats), pos=first(tier.pos),
                       extent=jnp.minimum(tier.extent, 1))  # fmt: skip
    with pytest.raises(ValueError, match="needs as many pages, got 1"):
        run(q, t1, q_pos, bits=4, pages_per_step=2)
    with pytest.raises(ValueError, match="overlap needs pages_per_step=1, got 2"):
        run(q, tier, q_pos, bits=4, pages_per_step=2, overlap=True)
    with pytest.raises(ValueError, match="bias_outside=True needs fold_keys"):
        run(q, tier, q_pos, bits=4, fold_keys=False, bias_outside=True)
    with pytest.raises(ValueError, match="tc_bias=True needs fold_keys"):
        run(q, tier, q_pos, bits=4, fold_keys=False, tc_bias=True)
    with pytest.raises(ValueError, match="tc_bias=True and bias_outside=True"):
        run(q, tier, q_pos, bits=4, fold_keys=True, tc_bias=True, bias_outside=True)
    with pytest.raises(ValueError, match=r"qk_split=True needs .*overlap=True"):
        run(q, tier, q_pos, bits=4, fold_keys=True, qk_split=True, overlap=True)
    with pytest.raises(ValueError, match=r"qk_split=True needs .*int4 codes at 4 bits"):
        run(q, to_channel_major(lowbit, 4, native=True), q_pos, bits=4, fold_keys=True,
            qk_split=True)  # fmt: skip
    with pytest.raises(ValueError, match=r"qk_split=True needs .*fold_keys=False"):
        run(q, tier, q_pos, bits=4, fold_keys=False, qk_split=True)
    with pytest.raises(ValueError, match=r"subnormal=True needs the words layout"):
        run(q, tier, q_pos, bits=4, subnormal=True)
    with pytest.raises(ValueError, match=r"subnormal=True and tc_bias=True"):
        run(q, to_channel_major(lowbit, 4, words=True), q_pos, bits=4, subnormal=True,
            tc_bias=True)  # fmt: skip
    words = to_channel_major(lowbit, 4, words=True)
    with pytest.raises(ValueError, match="the words layout needs fold_keys"):
        run(q, words, q_pos, bits=4, fold_keys=False)
    with pytest.raises(ValueError, match="native and words are two layouts"):
        to_channel_major(lowbit, 4, native=True, words=True)
    with pytest.raises(ValueError, match=r"int4_offset=True needs int4 codes.*got uint8"):
        run(q, tier, q_pos, bits=4, fold_keys=True, int4_offset=True)
    native = to_channel_major(lowbit, 4, native=True)
    with pytest.raises(ValueError, match=r"int4_offset=True needs .* fold_keys=False"):
        run(q, native, q_pos, bits=4, fold_keys=False, int4_offset=True)
    with pytest.raises(ValueError, match=r"v_stats has dtype float32"):
        run(q, tier._replace(v_stats=tier.v_stats.astype(jnp.float32)), q_pos, bits=4)
    q2, qp2, t2, _ = _tiers(case, 2, value_group=32)
    with pytest.raises(ValueError, match="value groups of 32 channels"):
        run(q2, t2, qp2, bits=4)
    case16 = Case(dtype="bfloat16", tiers="fp+int4", ratio=4, head_dim=128, cap=130)
    q3, qp3, _, (_, lb16) = make_tiers_page(case16, 3, 32)
    with pytest.raises(ValueError, match="32-token pages"):
        run(q3, to_channel_major(lb16, 4), qp3, bits=4)


def make_tiers_page(case: Case, seed: int, page: int):
    q, q_pos, full, _, lowbit = make_tiers(case, seed, page=page, value_group=64)
    return q, q_pos, full, (None, lowbit)


@pytest.mark.parametrize(
    "bits, codes, logits",
    [(2, "bytes", False), (4, "bytes", False)]
    + [(b, f"int4-{load}", False) for b in (4, 2) for load in INT4_LOADS]
    + [(4, "bytes", True), (4, "int4-auto", True), (2, "int4-upcast2x", True)]
    + [(b, "words", logits) for b in (4, 2) for logits in (False, True)],
)
@pytest.mark.parametrize("fold", ["dequant", "fold", "fold+offset", "fold+offset+lean"])
def test_kernel_lowers_for_h200(bits, codes, logits, fold):
    _lowers_for_h200(bits, codes, logits, fold)


@pytest.mark.parametrize(
    "bits, codes, fold",
    [(2, "words", "fold"), (2, "int4-wgmma", "fold+offset"), (4, "bytes", "dequant")],
)
def test_overlapped_kernel_lowers_for_h200(bits, codes, fold):
    _lowers_for_h200(bits, codes, True, fold, overlap=True)


@pytest.mark.parametrize("bits", [4, 2])
def test_words_kernel_lowers_with_either_conversion(bits):
    _lowers_for_h200(bits, "words", False, "fold", words_lop3=True)


@pytest.mark.parametrize(
    "bits, codes, fold",
    [(2, "words", "fold"), (2, "int4-wgmma", "fold+offset"), (4, "bytes", "fold+offset+lean")],
)
@pytest.mark.parametrize("one_barrier", [False, True])
def test_kernel_with_key_bias_before_the_launch_lowers_for_h200(bits, codes, fold, one_barrier):
    _lowers_for_h200(bits, codes, True, fold, bias_outside=True, one_barrier=one_barrier)


@pytest.mark.parametrize(
    "bits, codes, fold, kw",
    [
        (2, "words", "fold", dict(one_barrier=True)),
        (4, "words", "fold", dict(overlap=True)),
        (2, "int4-wgmma", "fold+offset+lean", dict(one_barrier=True)),
        (4, "bytes", "fold", dict(pages_per_step=2)),
    ],
)
def test_kernel_with_tensor_core_key_bias_lowers_for_h200(bits, codes, fold, kw):
    _lowers_for_h200(bits, codes, True, fold, tc_bias=True, **kw)


@pytest.mark.parametrize(
    "bits, codes, fold, kw",
    [
        (2, "words", "fold", dict(one_barrier=True)),
        (4, "words", "fold", dict(pages_per_step=2)),
        (2, "int4-wgmma", "fold+offset+lean", dict(one_barrier=True)),
        (4, "bytes", "fold", dict(tc_bias=True)),
    ],
)
def test_kernel_with_split_key_dot_lowers_for_h200(bits, codes, fold, kw):
    _lowers_for_h200(bits, codes, True, fold, qk_split=True, **kw)


@pytest.mark.parametrize(
    "bits, kw",
    [(2, dict(one_barrier=True)), (4, dict(qk_split=True)), (2, dict(bias_outside=True))],
)
def test_kernel_with_subnormal_codes_lowers_for_h200(bits, kw):
    _lowers_for_h200(bits, "words", True, "fold", subnormal=True, **kw)


def _lowers_for_h200(bits, codes, logits, fold, **kw):
    if fold.startswith("fold+offset") and not codes.startswith("int4"):
        pytest.skip("int4_offset needs int4 codes")
    if codes == "words" and fold not in ("fold", "dequant"):
        pytest.skip("the words layout: folded keys, no int4_offset")
    b, hkv, g, d, pages = 2, 8, 4, 128, 16
    sds = jax.ShapeDtypeStruct
    load = codes.removeprefix("int4-") if codes.startswith("int4") else "upcast2x"
    if codes == "words":
        k = v = sds((b, hkv, pages, d * bits // 64, 128), jnp.uint32)
    elif codes.startswith("int4"):
        k = sds((b, hkv, pages, 64, d * bits // 4), jnp.int4)
        v = sds((b, hkv, pages, d * bits // 4, 64), jnp.int4)
    else:
        k = sds((b, hkv, pages, 64, d * bits // 8), jnp.uint8)
        v = sds((b, hkv, pages, d, 64 * bits // 8), jnp.uint8)
    tier = ChannelMajorLowBitTier(
        k,
        v,
        sds((b, hkv, pages, 2, d), jnp.bfloat16),
        sds((b, hkv, pages, 2, 2, 64), jnp.bfloat16),
        sds((b, hkv, pages, 64), jnp.int32),
        sds((b, hkv), jnp.int32),
    )
    q = jax.ShapeDtypeStruct((b, hkv, g, d), jnp.bfloat16)
    q_pos = jax.ShapeDtypeStruct((b,), jnp.int32)
    fn = functools.partial(
        decode_attention_lowbit_mgpu,
        bits=bits,
        scale=d**-0.5,
        num_splits=4,
        int4_load=load,
        return_logits=logits,
        fold_keys=fold != "dequant" or codes == "words",
        int4_offset=fold.startswith("fold+offset"),
        lean_barriers=fold.endswith("lean"),
        **kw,
    )
    with jax.sharding.use_abstract_mesh(H200):
        exp = jax.export.export(jax.jit(fn), platforms=["cuda"])(q, tier, q_pos)
    assert exp.mlir_module().count("@mosaic_gpu_v2") == 1


def test_decode_attention_routes_a_channel_major_tier_to_the_mosaic_kernel():
    """A layer's full tier (Triton) and its channel-major low-bit tier (Mosaic GPU) combined by
    `decode_attention` equal the float64 oracle over both tiers."""
    case = Case(dtype="bfloat16", tiers="fp+int2", ratio=4, head_dim=64, cap=70)
    q, q_pos, full, _, lowbit = make_tiers(case, 5, page=MGPU_LOWBIT_PAGE, value_group=64)
    scale = 0.125
    got = decode_attention(
        q, q_pos, full=full, lowbit=to_channel_major(lowbit, 2), bits=2, scale=scale,
        interpret=True, num_splits=2,
    )  # fmt: skip
    want, want_lse, _, _ = oracle(q, q_pos, full, None, lowbit, 2, scale)
    out = np.asarray(got.out, np.float64)
    assert np.linalg.norm(out - want) / np.linalg.norm(want) < TOL
    np.testing.assert_allclose(np.asarray(got.lse), want_lse, atol=10 * TOL)
    cm = to_channel_major(lowbit, 2)
    with pytest.raises(ValueError, match="GPU backends, not 'tpu'"):
        decode_attention(q, q_pos, full=full, lowbit=cm, bits=2, scale=scale, backend="tpu")
    # with logits: each tier's, the channel-major one's as the token-major kernels give them
    got = decode_attention(
        q, q_pos, full=full, lowbit=cm, bits=2, scale=scale, return_logits=True,
        interpret=True, num_splits=2,
    )  # fmt: skip
    _, _, logits, seen = oracle(q, q_pos, full, None, lowbit, 2, scale)
    assert len(got.logits) == 2
    _check_logits(got.logits[1], logits[1], seen[1], cm.extent)


def _check_logits(got, want, seen, extent):
    """A kernel's logits against the float64 oracle's: equal on the visible slots (bfloat16
    dequantized keys: within TOL of the largest), -inf on the slots of the pages the kernel
    reads (those below each head's `extent` [B, Hkv]) that are not visible. The other pages'
    slots hold whatever the output buffer held (finite garbage, on a GPU, as often as not)."""
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape
    vis = np.broadcast_to(seen[:, :, None], want.shape)
    assert np.all(np.isfinite(got[vis]))
    err = np.max(np.abs(got[vis] - want[vis])) / np.max(np.abs(want[vis]))
    assert err < TOL, err
    page = np.arange(got.shape[-1]) // MGPU_LOWBIT_PAGE
    read = page[None, None, None, :] < np.asarray(extent)[:, :, None, None]
    assert np.all(np.isneginf(got[np.broadcast_to(read, got.shape) & ~vis]))
