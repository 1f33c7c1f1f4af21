"""KVpop targets: the transposed pass (teacher LSE, blockwise) against the dense S × S softmax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.train import dense_log_future_mass, log_future_mass, teacher_activations

# float32 throughout: both paths sum at most S = 45 probabilities in different orders and the
# transposed one reuses a log-sum-exp computed separately, so log m_t agrees to ~1e-6 (S·eps);
# we assert atol 2e-5 on log mass (a relative 2e-5 on m_t).
ATOL = 2e-5


def _causal_lse(q, k):
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, s, hkv, hq // hkv, d)
    logits = jnp.einsum("bdhgx,bthx->bdhgt", qg, k) * d**-0.5
    causal = (jnp.arange(s)[:, None] >= jnp.arange(s)[None, :])[None, :, None, None, :]
    logits = jnp.where(jnp.broadcast_to(causal, logits.shape), logits, -1e30)
    return jax.nn.logsumexp(logits, axis=-1).reshape(b, s, hq)


@pytest.mark.parametrize(
    ("window", "hq", "hkv", "aggregate"),
    [(0, 4, 2, "max"), (1, 3, 3, "mean"), (5, 6, 1, "max"), (5, 4, 2, "mean"), (44, 4, 2, "max"),
     (50, 6, 1, "mean")],
)  # fmt: skip
def test_transposed_pass_equals_dense(window, hq, hkv, aggregate):
    s, d = 45, 8
    kq, kk = jax.random.split(jax.random.key(window * 31 + hq))
    q = 2.0 * jax.random.normal(kq, (2, s, hq, d))
    k = 2.0 * jax.random.normal(kk, (2, s, hkv, d))
    want, want_has = dense_log_future_mass(q, k, window=window, aggregate=aggregate)
    for block in (7, 16, 64):  # 7 and 16 do not divide S: padding is masked
        got, has = log_future_mass(
            q, k, _causal_lse(q, k), window=window, aggregate=aggregate, block=block
        )
        np.testing.assert_array_equal(has, want_has)
        np.testing.assert_array_equal(np.isinf(got), ~np.asarray(has))
        np.testing.assert_allclose(np.where(has, got, 0), np.where(has, want, 0), atol=ATOL)
    # N_t = S − (t + w) eligible queries; the last eligible token has exactly one.
    assert int(np.asarray(has)[0, 0].sum()) == max(0, s - window)


def test_teacher_targets_match_dense_on_the_model(tiny_llama):
    """End to end: the model's own per-query LSE gives the same targets as a dense recomputation
    of its attention from its queries and keys."""
    from kvjax.cache import CacheSpec, init_cache
    from kvjax.models import forward

    config, params = tiny_llama
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (1, 40)), jnp.int32)
    t = teacher_activations(config, params, tokens, window=6, block=16)
    spec = CacheSpec(batch=1, num_kv_heads=2, head_dim=16, capacities=(1, 1))
    pos = jnp.arange(40, dtype=jnp.int32)[None]
    out = forward(
        config, params, tokens, pos, jnp.ones((1, 40), bool), init_cache(spec), return_queries=True
    )
    assert out.q[0].shape == (1, 40, 4, 16)
    for layer in range(config.num_layers):
        want, has = dense_log_future_mass(out.q[layer], out.k_new[layer], window=6)
        got = t.log_mass[:, layer]
        np.testing.assert_allclose(np.where(has, got, 0), np.where(has, want, 0), atol=ATOL)
    assert t.k.shape == (1, 40, 2, 2, 16) and t.v.shape == t.k.shape


def test_forward_without_queries_is_unchanged(tiny_llama):
    from kvjax.cache import CacheSpec, init_cache
    from kvjax.models import forward

    config, params = tiny_llama
    tokens = jnp.ones((1, 3), jnp.int32)
    pos = jnp.arange(3, dtype=jnp.int32)[None]
    spec = CacheSpec(batch=1, num_kv_heads=2, head_dim=16, capacities=(1, 1))
    args = (config, params, tokens, pos, jnp.ones((1, 3), bool), init_cache(spec))
    plain, with_q = forward(*args), forward(*args, return_queries=True)
    assert plain.q is None and len(with_q.q) == 2
    np.testing.assert_array_equal(plain.logits, with_q.logits)


def _largest_intermediate(jaxpr) -> int:
    size = 0
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            size = max(size, int(np.prod(getattr(v.aval, "shape", ()))))
        for p in eqn.params.values():
            for sub in p if isinstance(p, tuple | list) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    size = max(size, _largest_intermediate(inner))
    return size


def test_transposed_pass_never_builds_s_by_s():
    """Memory O(S·(Hq + D)): no intermediate (inside loops too) reaches S × S elements."""
    s, hq, d = 1024, 2, 16
    q = jax.ShapeDtypeStruct((1, s, hq, d), jnp.float32)
    k = jax.ShapeDtypeStruct((1, s, 1, d), jnp.float32)
    lse = jax.ShapeDtypeStruct((1, s, hq), jnp.float32)
    fn = lambda q, k, lse: log_future_mass(q, k, lse, window=8, block=64)
    assert _largest_intermediate(jax.make_jaxpr(fn)(q, k, lse).jaxpr) < s * s // 8
    dense = lambda q, k: dense_log_future_mass(q, k, window=8)
    assert _largest_intermediate(jax.make_jaxpr(dense)(q, k).jaxpr) >= s * s  # the check bites


@pytest.mark.parametrize(
    ("q_shape", "k_shape", "lse_shape", "kwargs", "match"),
    [
        ((1, 8, 4, 8), (1, 9, 2, 8), (1, 8, 4), {}, "q must be"),
        ((1, 8, 3, 8), (1, 8, 2, 8), (1, 8, 3), {}, "multiple of Hkv"),
        ((1, 8, 4, 8), (1, 8, 2, 8), (1, 8, 4), {"window": -1}, "window"),
        ((1, 8, 4, 8), (1, 8, 2, 8), (1, 8, 2), {}, "lse must be"),
        ((1, 8, 4, 8), (1, 8, 2, 8), (1, 8, 4), {"block": 0}, "block"),
    ],
)
def test_bad_inputs(q_shape, k_shape, lse_shape, kwargs, match):
    kwargs = {"window": 2} | kwargs
    with pytest.raises(ValueError, match=match):
        log_future_mass(jnp.zeros(q_shape), jnp.zeros(k_shape), jnp.zeros(lse_shape), **kwargs)
