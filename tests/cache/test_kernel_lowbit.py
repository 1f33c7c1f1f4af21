"""The low-bit tier in the Mosaic GPU kernel's layouts (`CacheSpec.lowbit_layout="kernel"` and
"words", `KernelLowBitTier`): its quantizers against float64 bounds and the token-major tier,
its pages against the token-major tier's bytes, write-once KIVI pages, the kernel reading the
cache as stored against the XLA path, sharding names, and clear errors for shapes the layouts
cannot hold."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax import quant
from kvjax.attention import AttnStats, attend
from kvjax.cache import CacheSpec, KernelLowBitTier, LayerCache, init_cache, physical_bytes
from kvjax.policies import make_policy
from kvjax.quant._kernel_layout import slice_values
from kvjax.quant._words_layout import pack_words, unpack_words, word_source


def _spec(bits=2, vg=64, page=64, pages=3, layout="kernel", **kw):
    return CacheSpec(
        batch=2, num_kv_heads=2, head_dim=128, capacities=(8,), dtype=jnp.bfloat16,
        lowbit_pages=(pages,), lowbit_page_size=page, lowbit_bits=bits,
        lowbit_value_group=vg, lowbit_layout=layout, **kw,
    )  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    bits=st.sampled_from([2, 4, 8]),
    loc=st.sampled_from([0.0, 3.0, -250.0, 1e4]),
    spread=st.sampled_from([1e-3, 1.0, 40.0]),
)
def test_offset_quantizer_meets_its_float64_bound(seed, bits, loc, spread):
    """|x − (codes − o)·scale − zero| ≤ scale/2 in float64 for every offset o, with the scale
    bound of the docstring; offset 0 is exactly `quantize_per_channel`."""
    rng = np.random.default_rng(seed)
    x = (loc + spread * rng.standard_normal((3, 16, 8))).astype(np.float32)
    levels = (1 << bits) - 1
    offs = np.array([0, 1, 1 << (bits - 1), levels - 1, 0, 2, 1 << (bits - 1), 1]).reshape(1, 1, 8)
    codes, scale, zero = quant.quantize_offset(jnp.asarray(x), bits, -2, offs)
    c = np.asarray(codes, np.float64)
    s, z = (np.asarray(a, np.float64) for a in (scale, zero))
    assert c.min() >= 0 and c.max() <= levels
    err = np.abs(x.astype(np.float64) - ((c - offs) * s + z))
    tol = s / 2 * (1 + 1e-5) + 1e-6 * np.abs(x).max(axis=-2, keepdims=True)
    assert np.all(err <= tol)
    lo, hi = x.min(axis=-2, keepdims=True), x.max(axis=-2, keepdims=True)
    o = np.maximum(np.minimum(offs, levels - offs), 1)
    bound = (1 + 2**-7) * ((hi - lo) / levels + 2**-8 * np.abs(z) / o) + 1e-30
    assert np.all(s <= bound * (1 + 1e-6))
    kc, ks, kz = quant.quantize_per_channel(jnp.asarray(x), bits)
    zero_off = offs[0, 0] == 0
    np.testing.assert_array_equal(np.asarray(codes)[..., zero_off], np.asarray(kc)[..., zero_off])
    for got, want in ((scale, ks), (zero, kz)):
        np.testing.assert_array_equal(
            np.asarray(got)[:, 0, zero_off], np.asarray(want)[:, zero_off]
        )


@pytest.mark.parametrize("bits, groups", [(2, 2), (4, 2), (4, 1)])
def test_kernel_pages_dequantize_within_half_a_step_of_float64(bits, groups):
    """Each key channel and value group back within scale/2, the scale read from the
    kernel-ready statistics (scale·2^-(slice·bits)); the slices are what the kernel reads."""
    rng = np.random.default_rng(bits + groups)
    xk = (1.5 + 3 * rng.standard_normal((2, 3, 64, 128))).astype(np.float32)
    xv = rng.standard_normal((2, 3, 64, 128)).astype(np.float32)
    k, v, ks, vs = quant.quantize_kernel_pages(jnp.asarray(xk), jnp.asarray(xv), bits, groups)
    assert k.dtype == v.dtype == jnp.int4 and ks.dtype == vs.dtype == jnp.bfloat16
    assert k.shape == (2, 3, 64, 128 * bits // 4) and v.shape == (2, 3, 128 * bits // 4, 64)
    assert ks.shape == (2, 3, 2, 128) and vs.shape == (2, 3, 2, groups, 64)
    dk, dv = (np.asarray(a, np.float64) for a in quant.dequantize_kernel_pages(k, v, ks, vs, bits))
    n = 4 // bits
    kslice = np.arange(128) // (128 // n)
    kscale = np.asarray(ks[..., 0, :], np.float64) * 2.0 ** (kslice * bits)  # [.., D]
    assert np.all(np.abs(dk - xk) <= kscale[..., None, :] / 2 * (1 + 1e-5) + 1e-6)
    gslice = np.arange(groups) // max(groups // n, 1) if n > 1 else np.zeros(groups, int)
    vscale = np.asarray(vs[..., 0, :, :], np.float64) * 2.0 ** (gslice * bits)[:, None]
    vstep = np.repeat(np.swapaxes(vscale, -1, -2), 128 // groups, axis=-1)  # [.., T, D]
    assert np.all(np.abs(dv - xv) <= vstep / 2 * (1 + 1e-5) + 1e-6)
    # The kernel's read of a nibble: slice c masked, (code − offset)·2^(c·bits)
    nib = np.asarray(k, np.int8)
    sl = np.asarray(slice_values(k, bits, axis=-1))
    for c in range(n):
        part = sl[..., c * 128 // n : (c + 1) * 128 // n]
        assert np.all(part % 2 ** (c * bits) == 0)
    assert nib.min() >= -8 and nib.max() <= 7


def _pack_words_gather(tiles, bits: int) -> np.ndarray:
    """The words layout built code by code from `word_source` (the brute-force reference)."""
    tiles = np.asarray(tiles, np.uint64)
    parts, _, k = tiles.shape[-3:]
    flat, bit = word_source(bits, k, parts)
    lead = tiles.shape[:-3]
    src = tiles.reshape(-1, flat.size) << bit.ravel().astype(np.uint64)
    words = np.zeros((src.shape[0], parts * k * bits // 64 * 128), np.uint64)
    for w, x in zip(words, src, strict=True):
        np.bitwise_or.at(w, flat.ravel(), x)  # each code into its word's bits
    return words.astype(np.uint32).reshape(*lead, -1, 128)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), bits=st.sampled_from([2, 4]), parts=st.sampled_from([1, 2]))
def test_words_unpack_inverts_pack(seed, bits, parts):
    """`pack_words` (reshapes, a transpose, a shift-sum) puts every code where `word_source`
    says (the gather over it), and every code comes back from its words."""
    k = (256 // bits if parts == 1 else 64) * (1 + seed % 2)  # one or two loads' worth
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 1 << bits, (3, parts, 64, k)).astype(np.uint8)
    words = pack_words(jnp.asarray(codes), bits)
    assert words.dtype == jnp.uint32 and words.shape == (3, parts * k * bits // 64, 128)
    np.testing.assert_array_equal(np.asarray(words), _pack_words_gather(codes, bits))
    np.testing.assert_array_equal(np.asarray(unpack_words(words, bits, parts, k)), codes)


@pytest.mark.parametrize("bits, groups", [(2, 2), (2, 1), (4, 2), (4, 1)])
def test_words_pages_are_the_token_tiers_codes_within_half_a_step(bits, groups):
    """The words layout holds `quantize_per_channel` / `quantize_per_token`'s codes and
    statistics (the powers of two in its statistics exact): dequantized it equals the
    token-major tier's dequantization bit for bit, and each value is within scale/2 of x."""
    rng = np.random.default_rng(10 * bits + groups)
    xk = (1.5 + 3 * rng.standard_normal((2, 3, 64, 128))).astype(np.float32)
    xv = rng.standard_normal((2, 3, 64, 128)).astype(np.float32)
    k, v, ks, vs = quant.quantize_words_pages(jnp.asarray(xk), jnp.asarray(xv), bits, groups)
    assert k.dtype == v.dtype == jnp.uint32 and ks.dtype == vs.dtype == jnp.bfloat16
    assert k.shape == v.shape == (2, 3, 128 * bits // 64, 128)
    assert ks.shape == (2, 3, 2, 128) and vs.shape == (2, 3, 2, groups, 64)
    dk, dv = quant.dequantize_words_pages(k, v, ks, vs, bits)
    kc, kscale, kzero = quant.quantize_per_channel(jnp.asarray(xk), bits)
    vc, vscale, vzero = quant.quantize_per_token(jnp.asarray(xv), bits, 128 // groups)
    want_k = quant.dequantize_per_channel(kc, kscale, kzero)
    want_v = quant.dequantize_per_token(vc, vscale, vzero)
    np.testing.assert_array_equal(np.asarray(dk), np.asarray(want_k))
    np.testing.assert_array_equal(np.asarray(dv), np.asarray(want_v))
    step_k = np.asarray(kscale, np.float64)[..., None, :]
    assert np.all(np.abs(np.asarray(dk, np.float64) - xk) <= step_k / 2 * (1 + 1e-5) + 1e-6)
    step_v = np.repeat(np.asarray(vscale, np.float64), 128 // groups, axis=-1)
    assert np.all(np.abs(np.asarray(dv, np.float64) - xv) <= step_v / 2 * (1 + 1e-5) + 1e-6)
    with pytest.raises(ValueError, match="must be uint32"):
        quant.dequantize_words_pages(k.astype(jnp.int32), v, ks, vs, bits)
    with pytest.raises(ValueError, match=r"\[\.\.\., 64, D\] alike"):
        quant.quantize_words_pages(jnp.asarray(xk[..., :32, :]), jnp.asarray(xv[..., :32, :]), 2, 2)


def test_spec_refuses_what_the_layout_cannot_hold():
    with pytest.raises(ValueError, match="64-token pages"):
        _spec(page=32)
    with pytest.raises(ValueError, match="holds"):
        _spec(bits=8)
    with pytest.raises(ValueError, match="value groups of 64"):
        _spec(bits=2, vg=128)
    with pytest.raises(ValueError, match="multiple of 64 channels"):
        _spec(bits=4, vg=32)
    with pytest.raises(ValueError, match="lowbit_layout must be one of"):
        _spec(layout="channels")
    with pytest.raises(ValueError, match="'words' needs 64-token pages"):
        _spec(page=32, layout="words")
    with pytest.raises(ValueError, match=r"head_dim·bits a multiple of 256"):
        dataclasses.replace(_spec(layout="words", bits=2, vg=64), head_dim=64)
    with pytest.raises(ValueError, match="value groups of a multiple of 64 channels"):
        _spec(layout="words", bits=4, vg=32)
    with pytest.raises(ValueError, match=r"holds \(2, 4\)-bit codes"):
        _spec(layout="words", bits=8)
    with pytest.raises(ValueError, match="KIVIPolicy.lowbit_layout must be one of"):
        make_policy("kivi", lowbit_layout="int4")
    _spec(layout="token", page=32, bits=8)  # the token-major tier takes them


@pytest.mark.parametrize("layout", ["kernel", "words"])
@pytest.mark.parametrize("bits", [2, 4])
def test_same_bytes_as_the_token_major_tier_measured_from_the_arrays(bits, layout):
    kern = init_cache(_spec(bits=bits, layout=layout)).layers[0].lowbit
    tok = init_cache(_spec(bits=bits, layout="token")).layers[0].lowbit
    assert isinstance(kern, KernelLowBitTier)
    assert kern.page_bytes() == tok.page_bytes()
    b, h, p = kern.held.shape
    data = (kern.k, kern.v, kern.k_stats, kern.v_stats)
    measured = sum(a.size * jnp.iinfo(a.dtype).bits // 8 if a.dtype == jnp.int4
                   else a.size * a.dtype.itemsize for a in data)  # fmt: skip
    assert measured == b * h * p * kern.page_bytes()
    one = lambda lb: physical_bytes(init_cache(_spec(bits=bits, layout=lb)))
    assert one(layout) == one("token")


@pytest.mark.parametrize("layout", ["kernel", "words"])
def test_kivi_pages_are_written_once_in_the_kernel_layout(layout):
    """KIVI's pages hold quantize_kernel_pages (quantize_words_pages) of each 64-token group,
    written once; the residual stays in full precision."""
    r, g, h, d = 64, 64, 2, 128
    policy = make_policy("kivi", residual=r, group=g, value_group=64, lowbit_layout=layout)
    quantize = quant.quantize_words_pages if layout == "words" else quant.quantize_kernel_pages
    n = 200
    spec = policy.cache_spec(
        batch=1, num_layers=1, num_kv_heads=h, head_dim=d, max_len=n, dtype=jnp.bfloat16
    )
    layer = init_cache(spec).layers[0]
    assert isinstance(layer.lowbit, KernelLowBitTier)
    rng = np.random.default_rng(2)
    keys = rng.standard_normal((n, h, d)).astype(np.float32)
    vals = rng.standard_normal((n, h, d)).astype(np.float32)
    seen, start = {}, 0
    for t in (70, 1, 1, 60, 68):
        k, v = (jnp.asarray(a[start : start + t], jnp.bfloat16)[None] for a in (keys, vals))
        stats = AttnStats(
            slot_mass=jnp.zeros((1, h, r)), new_mass=jnp.zeros((1, h, t)), lse=jnp.zeros((1, t, h))
        )
        pos = jnp.arange(start, start + t, dtype=jnp.int32)[None]
        layer = policy.write(layer, k, v, pos, jnp.ones((1, t), bool), stats, None, layer_index=0)
        start += t
        lb = layer.lowbit
        for p in range((start // r) * r // g):
            toks = slice(p * g, (p + 1) * g)
            pk, pv = (jnp.asarray(a[toks], jnp.bfloat16).transpose(1, 0, 2) for a in (keys, vals))
            want = quantize(pk, pv, 2, 2)
            for got, w in zip((lb.k, lb.v, lb.k_stats, lb.v_stats), want, strict=True):
                np.testing.assert_array_equal(np.asarray(got[0, :, p]), np.asarray(w))
            codes = np.asarray(lb.k[0, :, p]).astype(np.int64)
            assert np.array_equal(seen.setdefault(p, codes), codes), "page rewritten"
            np.testing.assert_array_equal(
                np.asarray(lb.pos[0, 0, p]), np.arange(p * g, (p + 1) * g)
            )
        assert not np.any(np.asarray(lb.held[0, :, (start // r) * r // g :]))


def _kernel_layer(seed: int, bits: int, layout: str = "kernel") -> LayerCache:
    """A bfloat16 layer (D 128) with full-precision slots and kernel-layout (or words-layout)
    pages, holes and a dormant page."""
    b, h, c, pages, d = 2, 2, 24, 3, 128
    rng = np.random.default_rng(seed)
    nrm = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)

    def pos(*s):
        p = rng.integers(0, 300, s).astype(np.int32)
        p[rng.random(s) < 0.25] = -1
        return jnp.asarray(p)

    spec = _spec(bits=bits, layout=layout)
    layer = init_cache(dataclasses.replace(spec, capacities=(c,))).layers[0]
    every = jnp.broadcast_to(jnp.arange(pages, dtype=jnp.int32), (b, h, pages))
    lb = layer.lowbit.write(every, nrm(b, h, pages, 64, d), nrm(b, h, pages, 64, d))
    lpos = pos(b, h, pages, 64).at[0, 1, 1].set(-1)
    lb = lb.replace(pos=lpos, held=jnp.ones((b, h, pages), bool))
    return layer.replace(k=nrm(b, h, c, d), v=nrm(b, h, c, d), pos=pos(b, h, c), lowbit=lb)


@pytest.mark.parametrize("layout", ["kernel", "words"])
@pytest.mark.parametrize("bits", [2, 4])
def test_the_kernel_reads_the_cache_as_stored_and_equals_xla(bits, layout):
    """attend(pallas) — the Mosaic GPU low-bit kernel over the cache's own arrays (interpreted
    here) — equals attend(xla), which dequantizes the same pages, mass included."""
    layer = _kernel_layer(bits, bits, layout)
    b, h, d = 2, 2, 128
    rng = np.random.default_rng(bits)
    q = jnp.asarray(rng.standard_normal((b, 1, h * 4, d)) / 4, jnp.bfloat16)
    k_new, v_new = (jnp.asarray(rng.standard_normal((b, 1, h, d)), jnp.bfloat16) for _ in "kv")
    args = (q, layer, k_new, v_new, jnp.array([[280], [299]], jnp.int32), jnp.ones((b, 1), bool))
    want_out, want = attend(*args, implementation="xla")
    got_out, got = attend(*args, implementation="pallas")
    f32 = lambda a: np.asarray(a, np.float32)
    np.testing.assert_allclose(f32(got_out), f32(want_out), atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(f32(got.lowbit_mass), f32(want.lowbit_mass), atol=5e-3)
    np.testing.assert_allclose(f32(got.slot_mass), f32(want.slot_mass), atol=5e-3)


@pytest.mark.parametrize("layout", ["kernel", "words"])
def test_sharding_names_mirror_the_kernel_tier(layout):
    from kvjax.sharding import layer_names

    layer = init_cache(_spec(layout=layout)).layers[0]
    names = layer_names(layer)
    assert jax.tree.structure(names) == jax.tree.structure(layer)
    assert isinstance(names.lowbit, KernelLowBitTier)
    for field in ("k", "v", "k_stats", "v_stats", "pos"):
        assert len(getattr(names.lowbit, field).axes) == getattr(layer.lowbit, field).ndim, field


def test_auto_takes_the_tunings_layout_only_where_the_shapes_fit(monkeypatch):
    from kvjax.pallas_kernels.decode_attention import _tuning

    def spec(policy, d=128, dtype=jnp.bfloat16):
        return policy.cache_spec(
            batch=1, num_layers=1, num_kv_heads=2, head_dim=d, max_len=256, dtype=dtype
        )

    fits = make_policy("kivi", residual=64, group=64, value_group=64)
    kind = jax.devices()[0].device_kind
    for named in ("token", "kernel", "words"):  # whatever this device's own Tuning names
        tune = dataclasses.replace(_tuning.tuning_for(kind), lowbit_cache_layout=named)
        monkeypatch.setitem(_tuning.TUNINGS, kind, tune)
        assert spec(fits).lowbit_layout == named
    # "words" falls back to "kernel" where only that fits (INT4, D 64: 256 bits a row of words
    # holds it too; value groups of 128 at INT4 D 128 fit both), to "token" where neither does
    assert spec(make_policy("kivi", residual=64, group=64, value_group=64), d=64).lowbit_layout == (
        "token"
    )  # INT2, D 64: neither layout
    four = make_policy("kivi", residual=64, group=64, value_group=64, bits=4)
    assert spec(four, d=64).lowbit_layout == "words"
    assert spec(fits, dtype=jnp.float32).lowbit_layout == "token"  # the kernel's q is bf16
    assert spec(make_policy("kivi")).lowbit_layout == "token"  # 32-token pages
    assert spec(make_policy("kivi", residual=64, group=64)).lowbit_layout == "token"  # groups 32
    assert spec(make_policy("qevict", 512)).lowbit_layout == "token"  # 8-token windows
    assert spec(
        make_policy("kivi", residual=64, group=64, lowbit_layout="token")
    ).lowbit_layout == ("token")


def test_a_tpu_refuses_the_kernel_layout_by_name(monkeypatch):
    from kvjax.attention import _pallas

    monkeypatch.setattr(_pallas, "default_backend", lambda *a: "tpu")
    layer = _kernel_layer(0, 2)
    q = jnp.zeros((2, 1, 8, 128), jnp.bfloat16)
    kv = jnp.zeros((2, 1, 2, 128), jnp.bfloat16)
    args = (q, layer, kv, kv, jnp.array([[280], [299]], jnp.int32), jnp.ones((2, 1), bool))
    with pytest.raises(ValueError, match="lowbit_layout='token'"):
        attend(*args, implementation="pallas")


@pytest.mark.parametrize(
    "knobs, layout",
    [({}, "kernel"), ({"fold_keys": True, "bias_outside": True}, "kernel"), ({}, "words")],
)
def test_the_kernel_reads_one_layer_of_a_stacked_cache_in_place(knobs, layout):
    """`layer=` on a stack of three layers' kernel-layout pages gives exactly the call on that
    layer's own arrays (the layer scan's read, without a slice of the stack); with the key
    biases computed before the launch, from that layer's statistics."""
    from kvjax.pallas_kernels.decode_attention import ChannelMajorLowBitTier
    from kvjax.pallas_kernels.decode_attention._mgpu_lowbit import decode_attention_lowbit_mgpu

    layers = [_kernel_layer(10 + i, 4, layout).lowbit for i in range(3)]
    stack = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((2, 2, 4, 128)) / 4, jnp.bfloat16)
    q_pos = jnp.array([280, 299], jnp.int32)

    def tier(lb, extent_of):
        extent = jnp.sum(jnp.any(extent_of.pos >= 0, axis=-1), axis=-1, dtype=jnp.int32)
        return ChannelMajorLowBitTier(lb.k, lb.v, lb.k_stats, lb.v_stats, lb.pos, extent)

    run = lambda t, **kw: decode_attention_lowbit_mgpu(
        q, t, q_pos, bits=4, scale=0.1, num_splits=2, return_logits=True, interpret=True,
        **knobs, **kw,
    )  # fmt: skip
    want = run(tier(layers[1], layers[1]))
    got = run(tier(stack, layers[1]), layer=jnp.int32(1))
    for w, g in zip(want, got, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    with pytest.raises(ValueError, match="integer scalar"):
        run(tier(stack, layers[1]), layer=jnp.ones((2,), jnp.int32))


@pytest.mark.parametrize("layout", ["kernel", "words", "token"])
def test_read_gives_the_written_pages_and_drops_out_of_range_writes(layout):
    """`write` puts pages where asked (an index ≥ P writes nothing), `read` gets exactly those
    pages' `dequantize` back (QEvict's recovery path), in either layout."""
    lb = init_cache(_spec(layout=layout)).layers[0].lowbit
    rng = np.random.default_rng(7)
    x = lambda: jnp.asarray(rng.standard_normal((2, 2, 2, 64, 128)), jnp.bfloat16)
    page = jnp.asarray([[[2, 3], [0, 2]], [[1, 0], [3, 1]]], jnp.int32)  # 3 = P: dropped
    lb = lb.write(page, x(), x())
    k_all, v_all = (np.asarray(a) for a in lb.dequantize(jnp.float32))
    got_k, got_v = lb.read(jnp.minimum(page, 2), jnp.float32)
    for b, h, j in zip(*np.nonzero(np.asarray(page) < 3), strict=True):
        p = int(page[b, h, j])
        np.testing.assert_array_equal(np.asarray(got_k)[b, h, j], k_all[b, h, p])
        np.testing.assert_array_equal(np.asarray(got_v)[b, h, j], v_all[b, h, p])
    untouched = [(0, 0, 0), (0, 0, 1), (0, 1, 1), (1, 0, 2), (1, 1, 0), (1, 1, 2)]
    for b, h, p in untouched:
        assert not np.any(k_all[b, h, p]) and not np.any(v_all[b, h, p])
