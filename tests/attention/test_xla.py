"""The XLA attention path against a float64 NumPy softmax over the visible keys."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.attention import attend
from kvjax.cache import LayerCache


def reference(q, k, v, pos, k_new, v_new, q_pos, valid, weight):
    """Dense float64 attention; returns out [B,T,Hq,D], slot mass [B,Hkv,C], new mass."""
    b, t, hq, d = q.shape
    hkv, c = k.shape[1], k.shape[2]
    g = hq // hkv
    out = np.zeros((b, t, hq, d))
    slot_mass = np.zeros((b, hkv, c))
    new_mass = np.zeros((b, hkv, t))
    for bi in range(b):
        for ti in range(t):
            for h in range(hq):
                kh = h // g
                keys = np.concatenate([k[bi, kh], k_new[bi, :, kh]])
                vals = np.concatenate([v[bi, kh], v_new[bi, :, kh]])
                vis = np.concatenate(
                    [
                        (pos[bi, kh] >= 0) & (pos[bi, kh] <= q_pos[bi, ti]),
                        valid[bi] & (q_pos[bi] <= q_pos[bi, ti]),
                    ]
                )
                s = keys @ q[bi, ti, h] / np.sqrt(d)
                s = np.where(vis, s, -np.inf)
                p = np.exp(s - s.max())
                p /= p.sum()
                out[bi, ti, h] = p @ vals
                slot_mass[bi, kh] += weight[bi, ti] * p[:c]
                new_mass[bi, kh] += weight[bi, ti] * p[c:]
    return out, slot_mass, new_mass


@pytest.mark.parametrize("hq,hkv,t,c", [(4, 2, 1, 7), (6, 2, 5, 9), (4, 4, 3, 1), (3, 1, 2, 16)])
def test_attend_matches_float64_reference(hq, hkv, t, c):
    rng = np.random.default_rng(hq * 100 + t * 10 + c)
    b, d = 2, 8
    q = rng.normal(size=(b, t, hq, d))
    k = rng.normal(size=(b, hkv, c, d))
    v = rng.normal(size=(b, hkv, c, d))
    # Holes (-1) and arbitrary original positions, all before this call's tokens.
    pos = np.where(rng.random((b, hkv, c)) < 0.3, -1, rng.integers(0, 50, (b, hkv, c)))
    pos[:, :, 0] = 3  # every query sees at least one slot
    k_new = rng.normal(size=(b, t, hkv, d))
    v_new = rng.normal(size=(b, t, hkv, d))
    q_pos = 50 + np.arange(t)[None].repeat(b, 0)
    valid = np.ones((b, t), bool)
    valid[1, t - 1 :] = t == 1  # padding at the end of row 1 when t > 1
    weight = rng.random((b, t)) * valid
    layer = LayerCache(
        k=jnp.asarray(k, jnp.float32),
        v=jnp.asarray(v, jnp.float32),
        pos=jnp.asarray(pos, jnp.int32),
        score=jnp.zeros((b, hkv, c)),
    )
    out, st = attend(
        jnp.asarray(q, jnp.float32),
        layer,
        jnp.asarray(k_new, jnp.float32),
        jnp.asarray(v_new, jnp.float32),
        jnp.asarray(q_pos, jnp.int32),
        jnp.asarray(valid),
        query_weight=jnp.asarray(weight, jnp.float32),
    )
    ro, rs, rn = reference(q, k, v, pos, k_new, v_new, q_pos, valid, weight)
    real = valid[:, :, None, None]
    np.testing.assert_allclose(np.where(real, np.asarray(out), 0), np.where(real, ro, 0), atol=1e-5)
    np.testing.assert_allclose(np.asarray(st.slot_mass), rs, atol=1e-5)
    np.testing.assert_allclose(np.asarray(st.new_mass), rn, atol=1e-5)
    # Each weighted query spreads exactly its weight over its G heads.
    total = np.asarray(st.slot_mass).sum(-1) + np.asarray(st.new_mass).sum(-1)
    np.testing.assert_allclose(
        total, np.repeat(weight.sum(1, keepdims=True), hkv, 1) * hq / hkv, rtol=1e-5
    )


def test_attend_rejects_bad_shapes():
    layer = LayerCache(
        k=jnp.zeros((1, 2, 4, 8)),
        v=jnp.zeros((1, 2, 4, 8)),
        pos=jnp.zeros((1, 2, 4), jnp.int32),
        score=jnp.zeros((1, 2, 4)),
    )
    q = jnp.zeros((1, 1, 3, 8))
    kn = jnp.zeros((1, 1, 2, 8))
    with pytest.raises(ValueError, match="multiple of cache KV heads"):
        attend(q, layer, kn, kn, jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1), bool))
    with pytest.raises(ValueError, match="k_new/v_new must be"):
        attend(
            jnp.zeros((1, 1, 4, 8)),
            layer,
            jnp.zeros((1, 1, 4, 8)),
            kn,
            jnp.zeros((1, 1), jnp.int32),
            jnp.ones((1, 1), bool),
        )
    with pytest.raises(ValueError, match="unknown attention implementation"):
        attend(
            jnp.zeros((1, 1, 4, 8)),
            layer,
            kn,
            kn,
            jnp.zeros((1, 1), jnp.int32),
            jnp.ones((1, 1), bool),
            implementation="cuda",
        )


def test_attend_is_jittable_with_bf16_cache():
    layer = LayerCache(
        k=jnp.ones((1, 1, 4, 8), jnp.bfloat16),
        v=jnp.ones((1, 1, 4, 8), jnp.bfloat16),
        pos=jnp.arange(4, dtype=jnp.int32)[None, None],
        score=jnp.zeros((1, 1, 4)),
    )
    kn = jnp.ones((1, 1, 1, 8), jnp.bfloat16)
    f = jax.jit(
        lambda q: attend(q, layer, kn, kn, jnp.full((1, 1), 4, jnp.int32), jnp.ones((1, 1), bool))
    )
    out, st = f(jnp.ones((1, 1, 2, 8), jnp.bfloat16))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), 1.0)
    np.testing.assert_allclose(np.asarray(st.slot_mass), 2 * 0.2, rtol=1e-2)  # 5 equal keys
