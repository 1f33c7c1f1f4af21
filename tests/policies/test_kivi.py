"""KIVI: pages hold exactly the quantized groups of every token older than the residual; pages are
written once; the residual is the tail, in full precision."""

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.attention import AttnStats
from kvjax.cache import init_cache
from kvjax.policies import make_policy
from kvjax.quant import pack, quantize_per_channel, quantize_per_token


@pytest.mark.parametrize("chunks", [[1] * 30, [5, 1, 9, 3, 12], [30]])
def test_pages_are_the_quantized_groups_and_never_change(chunks):
    r, g, bits, h, d = 8, 4, 2, 2, 8
    policy = make_policy("kivi", residual=r, group=g, bits=bits, value_group=4)
    n_total = sum(chunks)
    spec = policy.cache_spec(
        batch=1, num_layers=1, num_kv_heads=h, head_dim=d, max_len=n_total, dtype=jnp.float32
    )
    layer = init_cache(spec).layers[0]
    rng = np.random.default_rng(0)
    keys = rng.normal(size=(n_total, h, d)).astype(np.float32)
    vals = rng.normal(size=(n_total, h, d)).astype(np.float32)
    start = 0
    seen = {}  # page -> its codes when first written (write-once)
    for t in chunks:
        k = jnp.asarray(keys[start : start + t])[None]
        v = jnp.asarray(vals[start : start + t])[None]
        pos = jnp.arange(start, start + t, dtype=jnp.int32)[None]
        stats = AttnStats(
            slot_mass=jnp.zeros((1, h, r)), new_mass=jnp.zeros((1, h, t)), lse=jnp.zeros((1, t, h))
        )
        layer = policy.write(layer, k, v, pos, jnp.ones((1, t), bool), stats, None, layer_index=0)
        start += t
        paged = (start // r) * r
        lb = layer.lowbit
        for p in range(paged // g):
            toks = slice(p * g, (p + 1) * g)
            kc, ks, kz = quantize_per_channel(jnp.asarray(keys[toks]).transpose(1, 0, 2), bits)
            vc, vs, vz = quantize_per_token(jnp.asarray(vals[toks]).transpose(1, 0, 2), bits, 4)
            np.testing.assert_array_equal(np.asarray(lb.k[0, :, p]), np.asarray(pack(kc, bits)))
            np.testing.assert_array_equal(np.asarray(lb.v[0, :, p]), np.asarray(pack(vc, bits)))
            np.testing.assert_array_equal(np.asarray(lb.k_scale[0, :, p]), np.asarray(ks))
            np.testing.assert_array_equal(
                np.asarray(lb.pos[0, 0, p]), np.arange(p * g, (p + 1) * g)
            )
            codes = np.asarray(lb.k[0, :, p])
            assert np.array_equal(seen.setdefault(p, codes), codes), "page rewritten"
        assert not np.any(np.asarray(lb.pos[0, :, paged // g :]) >= 0)
        ring = np.asarray(layer.pos[0, 0])
        assert sorted(ring[ring >= 0].tolist()) == list(range(paged, start))
        for slot in np.nonzero(ring >= 0)[0]:
            np.testing.assert_array_equal(np.asarray(layer.k[0, :, slot]), keys[ring[slot]])


def test_kivi_rejects_bad_groups():
    with pytest.raises(ValueError, match="multiple of group"):
        make_policy("kivi", residual=10, group=4)
    with pytest.raises(ValueError, match="bits must be one of"):
        make_policy("kivi", bits=3)
    with pytest.raises(ValueError, match="takes no budget"):
        make_policy("kivi", 64)


def test_decode_padding_rows_change_nothing():
    """One-token decode writes (the in-place path) with a padding row (valid False) on random
    steps: that row's cache equals a batch-1 run over its valid tokens only, live slots and
    pages alike, and the other row equals its own batch-1 run."""
    r, g, h, d, n = 8, 4, 2, 8, 27
    policy = make_policy("kivi", residual=r, group=g, bits=2, value_group=4)
    rng = np.random.default_rng(1)
    keys = rng.normal(size=(2, n, h, d)).astype(np.float32)
    vals = rng.normal(size=(2, n, h, d)).astype(np.float32)
    valid = np.stack([np.ones(n, bool), rng.random(n) < 0.6])

    def run(rows):
        spec = policy.cache_spec(
            batch=len(rows), num_layers=1, num_kv_heads=h, head_dim=d, max_len=n, dtype=jnp.float32
        )
        layer = init_cache(spec).layers[0]
        count = np.zeros(len(rows), np.int32)
        for step in range(n):
            ok = valid[rows, step] if len(rows) > 1 else np.ones(1, bool)
            if len(rows) == 1 and not valid[rows[0], step]:
                continue
            stats = AttnStats(
                slot_mass=jnp.zeros((len(rows), h, r)),
                new_mass=jnp.zeros((len(rows), h, 1)),
                lse=jnp.zeros((len(rows), 1, h)),
            )
            layer = policy.write(
                layer,
                jnp.asarray(keys[rows, step])[:, None],
                jnp.asarray(vals[rows, step])[:, None],
                jnp.asarray(count)[:, None],
                jnp.asarray(ok)[:, None],
                stats,
                None,
                layer_index=0,
            )
            count += ok
        return layer

    both = run([0, 1])
    for row in (0, 1):
        alone = run([row])
        live = np.asarray(alone.pos[0]) >= 0
        np.testing.assert_array_equal(np.asarray(both.pos[row]), np.asarray(alone.pos[0]))
        np.testing.assert_array_equal(np.asarray(both.k[row])[live], np.asarray(alone.k[0])[live])
        np.testing.assert_array_equal(np.asarray(both.v[row])[live], np.asarray(alone.v[0])[live])
        for name in ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero", "pos", "held"):
            np.testing.assert_array_equal(
                np.asarray(getattr(both.lowbit, name)[row]),
                np.asarray(getattr(alone.lowbit, name)[0]),
                err_msg=name,
            )
    assert int(np.sum(np.asarray(both.lowbit.held[1, 0]))) == int(valid[1].sum()) // r * (r // g)
