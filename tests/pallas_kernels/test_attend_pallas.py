"""`attend(..., implementation="pallas")` equals the XLA reference, stats included, and drives
generate / teacher-forced scoring through every kind of cache tier (CPU: the interpreter)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from policy_cases import build

from kvjax import quant
from kvjax.attention import attend, resolve_implementation
from kvjax.cache import Int8Tier, LayerCache, LowBitTier
from kvjax.generate import GenerateConfig, generate, score_tokens
from kvjax.pallas_kernels.decode_attention import TUNINGS, tuning_for


def _layer(seed: int, b=2, h=2, c=21, cq=19, pages=3, page=4, d=16, bits=2) -> LayerCache:
    rng = np.random.default_rng(seed)
    nrm = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)

    def pos(*s):
        p = rng.integers(0, 50, s).astype(np.int32)
        p[rng.random(s) < 0.25] = -1  # holes anywhere
        return jnp.asarray(p)

    k8, k8s = quant.quantize_int8(nrm(b, h, cq, d))
    v8, v8s = quant.quantize_int8(nrm(b, h, cq, d))
    kc, ks, kz = quant.quantize_per_channel(nrm(b, h, pages, page, d), bits)
    vc, vs, vz = quant.quantize_per_token(nrm(b, h, pages, page, d), bits, 8)
    lpos = pos(b, h, pages, page)
    lpos = lpos.at[0, 1, 1].set(-1)  # a dormant page
    return LayerCache(
        k=nrm(b, h, c, d),
        v=nrm(b, h, c, d),
        pos=pos(b, h, c),
        score=jnp.zeros((b, h, c)),
        int8=Int8Tier(k8, v8, k8s, v8s, pos(b, h, cq), jnp.zeros((b, h, cq))),
        lowbit=LowBitTier(
            quant.pack(kc, bits), quant.pack(vc, bits), ks, kz, vs, vz, lpos,
            jnp.zeros((b, h, pages)), jnp.ones((b, h, pages), bool), bits=bits,
        ),
    )  # fmt: skip


@pytest.mark.parametrize(
    "tiers, ratio, joined",
    [(t, r, False) for t in ("fp", "fp+int8", "fp+int8+lowbit") for r in (1, 3)]
    + [("fp", 3, True), ("fp+int8", 1, True), ("fp+int8+lowbit", 1, True),
       ("fp+int8+lowbit", 3, True)],
    ids=lambda x: {False: "xla-merge", True: "join-kernel"}.get(x, str(x)) if isinstance(x, bool)
    else str(x),
)  # fmt: skip
def test_pallas_equals_xla_with_stats(tiers, ratio, joined, monkeypatch):
    """joined: the tiers' partials and the new token merged by `join_new_token` (the Tuning's
    join_new_token), else by XLA."""
    kind = jax.devices()[0].device_kind
    monkeypatch.setitem(TUNINGS, kind, dataclasses.replace(tuning_for(), join_new_token=joined))
    layer = _layer(ratio * 7 + len(tiers))
    if "lowbit" not in tiers:
        layer = layer.replace(lowbit=None)
    if "int8" not in tiers:
        layer = layer.replace(int8=None)
    b, h, d = 2, 2, 16
    rng = np.random.default_rng(len(tiers))
    q = jnp.asarray(rng.standard_normal((b, 1, h * ratio, d)), jnp.float32)
    k_new = jnp.asarray(rng.standard_normal((b, 1, h, d)), jnp.float32)
    v_new = jnp.asarray(rng.standard_normal((b, 1, h, d)), jnp.float32)
    q_pos = jnp.array([[40], [55]], jnp.int32)  # some slots (pos up to 49) are in the future
    valid = jnp.array([[True], [ratio == 1]])  # a padding (invalid) new token at ratio 3
    weight = jnp.array([[1.0], [0.5]], jnp.float32)
    args = (q, layer, k_new, v_new, q_pos, valid)
    want_out, want = attend(*args, query_weight=weight, implementation="xla")
    got_out, got = attend(*args, query_weight=weight, implementation="pallas")
    # Compiled on a GPU the kernels' float32 dots run on the tensor cores as TF32 (10-bit
    # mantissa): there both sides differ by ~4e-4 (seen at G = 3 on an H100, merged by XLA or
    # by the join alike); the interpreter (CPU) computes in full float32.
    tol = 2e-5 if jax.default_backend() == "cpu" else 2e-3
    np.testing.assert_allclose(np.asarray(got_out), np.asarray(want_out), atol=tol, rtol=tol)
    for field in ("slot_mass", "new_mass", "lse", "int8_mass", "lowbit_mass"):
        w, g = getattr(want, field), getattr(got, field)
        assert (w is None) == (g is None), field
        if w is not None:
            assert g.shape == w.shape, field
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=tol, err_msg=field)


def test_pallas_without_mass_gives_the_same_output_and_zero_mass():
    layer = _layer(5)
    b, h, d = 2, 2, 16
    rng = np.random.default_rng(9)
    q = jnp.asarray(rng.standard_normal((b, 1, h * 3, d)), jnp.float32)
    k_new, v_new = (jnp.asarray(rng.standard_normal((b, 1, h, d)), jnp.float32) for _ in "kv")
    args = (q, layer, k_new, v_new, jnp.array([[40], [55]], jnp.int32), jnp.ones((b, 1), bool))
    want_out, want = attend(*args, implementation="pallas")
    got_out, got = attend(*args, implementation="pallas", need_mass=False)
    np.testing.assert_array_equal(np.asarray(got_out), np.asarray(want_out))
    np.testing.assert_array_equal(np.asarray(got.lse), np.asarray(want.lse))
    for field in ("slot_mass", "int8_mass", "lowbit_mass"):
        w, g = getattr(want, field), getattr(got, field)
        assert g.shape == w.shape and not np.any(np.asarray(g)), field
        assert np.any(np.asarray(w)), field


def test_auto_picks_pallas_only_on_accelerators():
    assert resolve_implementation("auto", "gpu") == "pallas"
    assert resolve_implementation("auto", "tpu") == "pallas"
    assert resolve_implementation("auto", "cpu") == "xla"
    assert resolve_implementation("xla", "gpu") == "xla"


@pytest.mark.parametrize("case", ["h2o", "confkv-int8", "kivi", "qevict"])
def test_decode_through_pallas_equals_xla(tiny_llama, case):
    config, params = tiny_llama
    policy = build(case, 12)
    tokens = np.random.default_rng(3).integers(0, config.vocab_size, (2, 40))
    nll = {
        impl: np.asarray(
            score_tokens(config, params, tokens, policy=policy, segment=40, implementation=impl).nll
        )
        for impl in ("xla", "pallas")
    }
    np.testing.assert_allclose(nll["pallas"], nll["xla"], atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("case", ["confkv-int8", "kivi", "qevict"])  # every quantized tier
def test_generate_with_pallas_equals_xla(tiny_llama, case):
    config, params = tiny_llama
    prompts = [[5, 9, 33, 2, 7, 1, 8], [4, 4, 90]]
    policy = build(case, 12)
    out = {
        impl: generate(
            config,
            params,
            prompts,
            policy=policy,
            gen=GenerateConfig(max_new_tokens=12, chunk_size=4, implementation=impl),
        )
        for impl in ("xla", "pallas")
    }
    np.testing.assert_array_equal(np.asarray(out["pallas"].tokens), np.asarray(out["xla"].tokens))
    tier = 1 if case == "confkv-int8" else 2  # the quantized tier was attended
    assert np.max(np.asarray(out["xla"].telemetry.live_slots)[..., tier]) > 0


@pytest.mark.parametrize("tiers", ["fp", "fp+int8", "fp+int8+lowbit"])
def test_join_runs_unless_an_int8_tier_returns_permuted_channels(tiers, monkeypatch):
    """With the Tuning's join on, a step's merge is the one-launch join, except where an INT8
    tier is read as value words (its partials' channels come permuted, a transpose the join
    would copy): XLA merges those."""
    kind = jax.devices()[0].device_kind
    for v_words in (False, True):
        tune = dataclasses.replace(tuning_for(), join_new_token=True, int8_v_words=v_words)
        monkeypatch.setitem(TUNINGS, kind, tune)
        layer = _layer(4)
        if "lowbit" not in tiers:
            layer = layer.replace(lowbit=None)
        if "int8" not in tiers:
            layer = layer.replace(int8=None)
        b, h, d = 2, 2, 16
        q = jnp.ones((b, 1, h * 2, d), jnp.float32)
        kv = jnp.ones((b, 1, h, d), jnp.float32)
        args = (q, layer, kv, kv, jnp.array([[40], [55]], jnp.int32), jnp.ones((b, 1), bool))
        fn = lambda *a: attend(*a, implementation="pallas")
        text = str(jax.make_jaxpr(fn)(*args))
        joined = "kvjax_decode_join" in text
        assert joined == (not (v_words and "int8" in tiers)), (tiers, v_words)


def test_int8_tier_on_the_slots_on_m_kernel_is_joined_and_equals_xla(monkeypatch):
    """ "int8-tm" in the Tuning's mgpu_tiers: a bfloat16 step reads its INT8 tier (70 slots, no
    multiple of 64) through the slots-on-M Mosaic GPU kernel, whose partials keep their
    channels in order, so the join runs even with value words on; output and masses equal
    XLA's attention to bfloat16's precision."""
    kind = jax.devices()[0].device_kind
    tune = dataclasses.replace(
        tuning_for(), join_new_token=True, int8_v_words=True, mgpu_tiers=("int8-tm",)
    )
    monkeypatch.setitem(TUNINGS, kind, tune)
    b, h, d = 2, 2, 64
    bf = lambda x: jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float32
                                else a, x)  # fmt: skip
    layer = _layer(11, c=21, cq=70, d=d).replace(lowbit=None)
    layer = layer.replace(k=layer.k.astype(jnp.bfloat16), v=layer.v.astype(jnp.bfloat16))
    rng = np.random.default_rng(4)
    q, k_new, v_new = (
        bf(jnp.asarray(rng.standard_normal((b, 1, n, d)), jnp.float32)) for n in (h * 4, h, h)
    )
    args = (q, layer, k_new, v_new, jnp.array([[40], [55]], jnp.int32), jnp.ones((b, 1), bool))
    fn = lambda *a: attend(*a, implementation="pallas")
    text = str(jax.make_jaxpr(fn)(*args))
    assert "kvjax_decode_int8_mgpu_tm" in text and "kvjax_decode_join" in text
    want_out, want = attend(*args, implementation="xla")
    got_out, got = fn(*args)
    f32 = lambda x: np.asarray(jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(f32(got_out), f32(want_out), atol=3e-2, rtol=3e-2)
    for field in ("slot_mass", "new_mass", "int8_mass"):
        np.testing.assert_allclose(f32(getattr(got, field)), f32(getattr(want, field)),
                                   atol=1e-2, err_msg=field)  # fmt: skip


def test_lowbit_pages_on_the_mosaic_gpu_kernel_equal_xla(monkeypatch):
    """ "pages" in the Tuning's mgpu_tiers: a bfloat16 step reads its low-bit tier of 8-token
    pages (QEvict's: 2-bit codes, one value group, 16 pages) through the Mosaic GPU kernel of
    8-token pages, joined with the other tiers; output and every tier's mass equal XLA's
    attention to bfloat16's precision."""
    kind = jax.devices()[0].device_kind
    tune = dataclasses.replace(tuning_for(), join_new_token=True, mgpu_tiers=("pages",))
    monkeypatch.setitem(TUNINGS, kind, tune)
    b, h, d, pages = 2, 2, 64, 16
    rng = np.random.default_rng(9)
    nrm = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    kc, ks, kz = quant.quantize_per_channel(nrm(b, h, pages, 8, d), 2)
    vc, vs, vz = quant.quantize_per_token(nrm(b, h, pages, 8, d), 2, d)
    lpos = jnp.asarray(rng.integers(0, 60, (b, h, pages, 8)), jnp.int32)
    lpos = lpos.at[0, 1, 4].set(-1)  # a dormant page
    low = LowBitTier(
        quant.pack(kc, 2), quant.pack(vc, 2), ks, kz, vs, vz, lpos,
        jnp.zeros((b, h, pages)), jnp.ones((b, h, pages), bool), bits=2,
    )  # fmt: skip
    layer = _layer(12, c=21, d=d).replace(int8=None, lowbit=low)
    layer = layer.replace(k=layer.k.astype(jnp.bfloat16), v=layer.v.astype(jnp.bfloat16))
    bf = lambda x: x.astype(jnp.bfloat16)
    q, k_new, v_new = (bf(nrm(b, 1, n, d)) for n in (h * 4, h, h))
    args = (q, layer, k_new, v_new, jnp.array([[40], [55]], jnp.int32), jnp.ones((b, 1), bool))
    fn = lambda *a: attend(*a, implementation="pallas")
    assert "kvjax_decode_int2_pages_mgpu" in str(jax.make_jaxpr(fn)(*args))
    want_out, want = attend(*args, implementation="xla")
    got_out, got = fn(*args)
    f32 = lambda x: np.asarray(jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(f32(got_out), f32(want_out), atol=3e-2, rtol=3e-2)
    for field in ("slot_mass", "new_mass", "lowbit_mass"):
        np.testing.assert_allclose(f32(getattr(got, field)), f32(getattr(want, field)),
                                   atol=1e-2, err_msg=field)  # fmt: skip
