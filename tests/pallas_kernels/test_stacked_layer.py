"""The dense Triton kernel reading one layer of a stacked cache in place (`layer=`): equal to the
same kernel on that layer sliced out and to the float64 oracle, with the layer a traced index
(a layer scan's loop counter); it lowers for the H200; bad stacks get one clear error."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_cases import Case, make_tiers, oracle, stack_layers

from kvjax.eval._kernel_ir import abstract_tiers, export_cuda
from kvjax.pallas_kernels.decode_attention import FullTier, combine, decode_attention_triton

L = 3


@pytest.mark.parametrize("tiers", ["fp", "fp+int8"])
@pytest.mark.parametrize("logits", [False, True])
def test_stacked_layer_equals_the_sliced_layer_and_float64(tiers, logits):
    case = Case("bfloat16", tiers, ratio=4, head_dim=32)
    made = [make_tiers(case, seed) for seed in range(L)]
    q, q_pos = made[1][0], made[1][1]
    pick = 3 if tiers == "fp+int8" else 2  # FullTier or Int8Tier of each layer
    layers = [m[pick] for m in made]
    # every layer's extent is layer 1's, so the stack can carry one extent
    layers = [t._replace(extent=layers[1].extent) for t in layers]
    stacked = stack_layers(layers)
    interpret = jax.default_backend() != "gpu"  # compiled on a GPU, interpreted elsewhere
    kw = dict(scale=0.3, block_k=16, num_splits=2, return_logits=logits, interpret=interpret)
    run = jax.jit(lambda i: decode_attention_triton(q, stacked, q_pos, i, **kw))
    got = run(jnp.int32(1))
    want = decode_attention_triton(q, layers[1], q_pos, **kw)
    np.testing.assert_array_equal(np.asarray(got.out), np.asarray(want.out))
    np.testing.assert_array_equal(np.asarray(got.lse), np.asarray(want.lse))
    if pick == 2:
        full, int8 = layers[1], None
    else:  # the oracle's full tier left empty: only the INT8 slots are attended
        f = made[1][2]
        full, int8 = f._replace(pos=jnp.full_like(f.pos, -1), extent=0 * f.extent), layers[1]
    o64, lse64, _, seen = oracle(q, q_pos, full, int8, None, None, 0.3)
    if logits:  # equal where visible (elsewhere the kernel leaves them arbitrary, as documented)
        vis = np.broadcast_to(seen[-1][:, :, None], got.logits.shape)
        np.testing.assert_array_equal(np.asarray(got.logits)[vis], np.asarray(want.logits)[vis])
    out, lse = combine([got])
    # the bf16 measure of the kernel suite (test_decode_attention's TOL["bfloat16"])
    err = np.linalg.norm(np.asarray(out, np.float64) - o64) / np.linalg.norm(o64)
    assert err < 2e-2
    np.testing.assert_allclose(np.asarray(lse), lse64, rtol=0, atol=0.2)
    other = run(jnp.int32(0))  # another layer really is another answer
    assert not np.allclose(np.asarray(other.out), np.asarray(got.out))


@pytest.mark.parametrize("tier", ["bf16", "int8"])
def test_stacked_layer_kernel_lowers_for_h200(tier):
    # Triton's lowering takes one indexer per load: the layer view must fold its leading
    # indices into the kernel's own.
    sds = jax.ShapeDtypeStruct
    full, int8, _ = abstract_tiers(2, 8, 128, 1000, 1000, 20, 32, 32, 2, jnp.bfloat16)
    data = full if tier == "bf16" else int8
    grow = lambda f, a: a if f == "extent" else sds((4, *a.shape), a.dtype)
    stack = type(data)(**{f: grow(f, a) for f, a in data._asdict().items()})
    fn = functools.partial(
        decode_attention_triton, scale=0.1, block_k=64, num_splits=4, return_logits=True
    )
    q, q_pos, layer = sds((2, 8, 4, 128), jnp.bfloat16), sds((2,), jnp.int32), sds((), jnp.int32)
    text = export_cuda(fn, q, stack, q_pos, layer)
    assert text.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize(("slots", "wide"), [(1000, False), (8192, True)])
def test_int8_stack_of_2_31_code_bytes_is_read_as_pairs_and_words(monkeypatch, slots, wide):
    """Pallas' Triton lowering indexes an array of at most 2^32 bytes with 32-bit offsets: a
    stack of INT8 codes of 2^31 bytes or more (here 32 layers × B 8 × 8 heads × 8192 slots ×
    128) is handed to the kernel as int16 key pairs and int32 value words, whose element
    offsets fit; a smaller stack keeps the tuned layout. Lowered only (no memory needed)."""
    from kvjax.pallas_kernels.decode_attention import _triton

    seen = []
    kernel = _triton._kernel
    monkeypatch.setattr(_triton, "_kernel", lambda *a, **kw: seen.append(kw) or kernel(*a, **kw))
    sds = jax.ShapeDtypeStruct
    _, int8, _ = abstract_tiers(8, 8, 128, 64, slots, 20, 32, 32, 2, jnp.bfloat16)
    grow = lambda f, a: a if f == "extent" else sds((32, *a.shape), a.dtype)
    stack = type(int8)(**{f: grow(f, a) for f, a in int8._asdict().items()})
    assert (stack.k.size >= 2**31) == wide
    fn = functools.partial(
        decode_attention_triton, scale=0.1, block_k=64, num_splits=4, v_words=False
    )
    q, q_pos, layer = sds((8, 8, 4, 128), jnp.bfloat16), sds((8,), jnp.int32), sds((), jnp.int32)
    export_cuda(fn, q, stack, q_pos, layer)
    assert seen and all(kw["k_pairs"] == wide and kw["v_words"] == wide for kw in seen)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a 2.2 GB stack on a GPU")
def test_int8_stack_past_2_31_code_bytes_reads_its_last_layer():
    """On the GPU: the last layer of a stack of 2^31+ INT8 code bytes, read in place, equals
    that layer sliced out (the unwidened offsets wrapped negative: an illegal address)."""
    b, hkv, g, d, c, layers = 8, 8, 4, 128, 8200, 32
    ks = jax.random.split(jax.random.key(0), 4)
    codes = lambda k: jax.random.randint(k, (layers, b, hkv, c, d), -127, 128, jnp.int8)
    scales = jnp.full((layers, b, hkv, c), 0.01, jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (layers, b, hkv, c))
    from kvjax.pallas_kernels.decode_attention import Int8Tier

    extent = jnp.full((b, hkv), c, jnp.int32)
    stack = Int8Tier(codes(ks[0]), codes(ks[1]), scales, scales, pos, extent)
    q = jax.random.normal(ks[2], (b, hkv, g, d), jnp.bfloat16)
    q_pos = jnp.full((b,), c, jnp.int32)
    kw = dict(scale=0.1)
    got = decode_attention_triton(q, stack, q_pos, jnp.int32(layers - 1), **kw)
    one = jax.tree.map(lambda a: a[-1], stack._replace(extent=None))._replace(extent=extent)
    want = decode_attention_triton(q, one, q_pos, **kw)
    np.testing.assert_allclose(
        np.asarray(combine([got])[0], np.float32),
        np.asarray(combine([want])[0], np.float32),
        rtol=1e-2,
        atol=1e-2,
    )


def test_stacked_layer_bad_inputs_raise_clear_errors():
    case = Case("bfloat16", "fp", ratio=2, head_dim=32)
    q, q_pos, full, _, _ = make_tiers(case, 0)
    kw = dict(scale=0.3, interpret=True)
    with pytest.raises(ValueError, match="FullTier.pos"):  # a per-layer tier given a layer
        decode_attention_triton(q, full, q_pos, jnp.int32(0), **kw)
    stacked = stack_layers([full, full])
    bad = FullTier(stacked.k, stacked.v[:1], stacked.pos, stacked.extent)
    with pytest.raises(ValueError, match="leading"):
        decode_attention_triton(q, bad, q_pos, jnp.int32(0), **kw)
    with pytest.raises(ValueError, match="integer scalar"):
        decode_attention_triton(q, stacked, q_pos, jnp.zeros((2,), jnp.int32), **kw)


def test_lowbit_codes_of_2_to_4_gib_are_one_clear_error():
    """The low-bit kernel's packed codes stay 1-byte arrays: 2^31 to 2^32 bytes of them (here
    B 32 × 8 heads × 4096 pages × 32 tokens × 64 bytes) would be indexed with overflowing
    32-bit offsets, so they are refused by name at trace time (abstract shapes, no memory)."""
    from kvjax.pallas_kernels.decode_attention import decode_attention_lowbit_triton

    _, _, lowbit = abstract_tiers(32, 8, 128, 64, 64, 4096, 32, 32, 4, jnp.bfloat16)
    assert lowbit.k.size == 2**31
    sds = jax.ShapeDtypeStruct
    q, q_pos = sds((32, 8, 4, 128), jnp.bfloat16), sds((32,), jnp.int32)
    fn = functools.partial(decode_attention_lowbit_triton, bits=4, scale=0.1)
    with pytest.raises(ValueError, match=r"LowBitTier.k: 2147483648 bytes of codes \(2-4 GiB\)"):
        jax.eval_shape(fn, q, lowbit, q_pos)
