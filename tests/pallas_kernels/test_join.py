"""`join_new_token` (the tiers' split partials and a decode step's own token merged in one
launch) against a float64 NumPy merge; the interpreter on CPU, the Triton lowering for an H200,
and its input checks."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.eval._kernel_ir import export_cuda
from kvjax.pallas_kernels.decode_attention import Partials, join_applies, join_new_token


def _parts(rng, b, h, g, d, splits, pad=0):
    """Random partials; `pad` more query rows after the G real ones, NaN (never to be read)."""
    parts = []
    for s in splits:
        out = rng.standard_normal((b, h, s, g, d)).astype(np.float32)
        lse = (3 * rng.standard_normal((b, h, s, g))).astype(np.float32)
        lse[rng.random(lse.shape) < 0.3] = -np.inf  # splits that saw nothing
        out[np.isneginf(lse)] = 0.0
        if pad:
            out = np.concatenate([out, np.full((b, h, s, pad, d), np.nan, np.float32)], 3)
            lse = np.concatenate([lse, np.full((b, h, s, pad), np.nan, np.float32)], 3)
        parts.append(Partials(jnp.asarray(out), jnp.asarray(lse), None))
    return parts


def _real(parts, g):
    """The G real query rows of padded partials (what the float64 merge takes)."""
    return [p._replace(out=p.out[:, :, :, :g], lse=p.lse[..., :g]) for p in parts]


def _merge64(parts, q, k, v, valid, scale):
    """float64: every split's (out, lse) and the new token (its logit q·k·scale, its value)."""
    f = lambda x: np.asarray(x, np.float64)
    s_new = np.einsum("bhgd,bhd->bhg", f(q), f(k)) * scale
    s_new = np.where(f(valid)[:, None, None] > 0, s_new, -np.inf)
    lses = np.concatenate([f(p.lse) for p in parts] + [s_new[:, :, None]], axis=2)
    vnew = np.broadcast_to(f(v)[:, :, None, None, :], (*s_new.shape[:2], 1, *q.shape[2:]))
    outs = np.concatenate([f(p.out) for p in parts] + [vnew], axis=2)
    m = np.max(lses, axis=2)
    m = np.where(np.isfinite(m), m, 0.0)
    w = np.exp(lses - m[:, :, None])
    den = w.sum(axis=2)
    has = den > 0
    out = np.einsum("bhsg,bhsgd->bhgd", w, outs) / np.where(has, den, 1.0)[..., None]
    lse = np.where(has, m + np.log(np.where(has, den, 1.0)), -np.inf)
    w_new = np.where(has, w[:, :, -1] / np.where(has, den, 1.0), 0.0)
    return out, lse, w_new


@pytest.mark.parametrize(
    "g, d, splits, dtype, pad",
    [(4, 16, (3,), jnp.float32, 0), (3, 8, (2, 5), jnp.float32, 13),
     (1, 16, (1, 4, 2), jnp.bfloat16, 15), (4, 128, (19, 1), jnp.float32, 12),
     (4, 128, (300,), jnp.float32, 0)],  # 300 splits: channel chunks of 16
)  # fmt: skip
def test_join_matches_float64(g, d, splits, dtype, pad):
    rng = np.random.default_rng(g * 100 + d + len(splits))
    b, h = 3, 2
    parts = _parts(rng, b, h, g, d, splits, pad)
    q = jnp.asarray(rng.standard_normal((b, h, g, d)), dtype)
    k = jnp.asarray(rng.standard_normal((b, h, d)), dtype)
    v = jnp.asarray(rng.standard_normal((b, h, d)), dtype)
    valid = jnp.array([True, False, True])
    # sequence 2 sees nothing in the cache: only its own token
    parts = [p._replace(out=p.out.at[2].set(0.0), lse=p.lse.at[2].set(-jnp.inf)) for p in parts]
    out, lse, w_new = join_new_token(parts, q, k, v, valid, scale=0.3, interpret=True)
    want_out, want_lse, want_w = _merge64(_real(parts, g), q, k, v, valid, 0.3)
    assert out.dtype == dtype and out.shape == (b, h, g, d)
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(out, np.float64), want_out, atol=tol, rtol=tol)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(w_new), want_w, atol=1e-6)
    np.testing.assert_allclose(np.asarray(w_new[2]), 1.0)  # its own token only
    assert np.all(np.asarray(w_new[1]) == 0)  # an invalid new token weighs nothing


def test_nothing_visible_and_no_new_token_gives_zero_and_minus_inf():
    rng = np.random.default_rng(1)
    parts = _parts(rng, 1, 2, 4, 8, (3,))
    parts = [p._replace(out=p.out * 0, lse=jnp.full_like(p.lse, -jnp.inf)) for p in parts]
    q, k, v = (jnp.ones(s, jnp.float32) for s in ((1, 2, 4, 8), (1, 2, 8), (1, 2, 8)))
    out, lse, w_new = join_new_token(parts, q, k, v, jnp.array([False]), scale=1.0, interpret=True)
    assert np.all(np.asarray(out) == 0) and np.all(np.asarray(lse) == -np.inf)
    assert np.all(np.asarray(w_new) == 0)


def test_bad_input_gets_one_clear_error():
    rng = np.random.default_rng(2)
    parts = _parts(rng, 2, 2, 4, 8, (2,))
    q = jnp.ones((2, 2, 4, 8), jnp.float32)
    kv = jnp.ones((2, 2, 8), jnp.float32)
    run = functools.partial(join_new_token, scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="k_new"):
        run(parts, q, kv[:, :1], kv, jnp.ones((2,), bool))
    with pytest.raises(ValueError, match="valid must be"):
        run(parts, q, kv, kv, jnp.ones((2, 1), bool))
    with pytest.raises(ValueError, match="do not fit q"):  # fewer rows than query heads
        run(parts, jnp.ones((2, 2, 5, 8), jnp.float32), kv, kv, jnp.ones((2,), bool))
    with pytest.raises(ValueError, match="do not fit q"):  # lse not [B, Hkv, S, R]
        run([parts[0]._replace(lse=parts[0].lse[..., :2])], q, kv, kv, jnp.ones((2,), bool))
    with pytest.raises(ValueError, match="no partials"):
        run([], q, kv, kv, jnp.ones((2,), bool))
    with pytest.raises(ValueError, match="power of two"):  # the compiled join: D=8 < 16
        join_new_token(parts, q, kv, kv, jnp.ones((2,), bool), scale=1.0)
    q16 = jnp.ones((2, 2, 3, 16), jnp.float32)
    assert join_applies(q16) is None and "D=8" in join_applies(q)  # any G, D a power of 2
    assert join_applies(q16, (256, 256)) is None and "512+1 splits" in join_applies(q16, (512, 1))


def test_join_lowers_for_h200_through_triton():
    b, h, g, d = 8, 8, 4, 128
    sds = jax.ShapeDtypeStruct
    parts = [
        Partials(sds((b, h, s, 16, d), jnp.float32), sds((b, h, s, 16), jnp.float32), None)
        for s in (6, 3)
    ]  # fmt: skip  (padded to the Triton kernel's 16 query rows)
    fn = functools.partial(join_new_token, scale=0.1)
    kv = sds((b, h, d), jnp.bfloat16)
    text = export_cuda(fn, parts, sds((b, h, g, d), jnp.bfloat16), kv, kv, sds((b,), jnp.bool_))
    assert text.count("kvjax_decode_join") >= 1


def test_join_compiled_matches_float64():
    if jax.default_backend() != "gpu":
        pytest.skip("the compiled (Triton) join needs a GPU; the interpreter cases cover CPU")
    rng = np.random.default_rng(7)
    b, h, g, d = 4, 8, 4, 128
    parts = _parts(rng, b, h, g, d, (6, 3, 35), pad=12)
    q = jnp.asarray(rng.standard_normal((b, h, g, d)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((b, h, d)), jnp.bfloat16) for _ in "kv")
    valid = jnp.array([True, False, True, True])
    out, lse, w_new = join_new_token(parts, q, k, v, valid, scale=0.1)
    want_out, want_lse, want_w = _merge64(_real(parts, g), q, k, v, valid, 0.1)
    np.testing.assert_allclose(np.asarray(out, np.float64), want_out, atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(w_new), want_w, atol=1e-5)


def test_tuning_overrides_from_the_environment(monkeypatch):
    from kvjax.pallas_kernels.decode_attention import tuning_for

    base = tuning_for()
    monkeypatch.setenv("KVJAX_TUNING", "join_new_token=1, mgpu_tiers=full-tm+int8,mgpu_stages=3")
    t = tuning_for()
    assert t.join_new_token and t.mgpu_tiers == ("full-tm", "int8") and t.mgpu_stages == 3
    assert t.block_k == base.block_k  # the rest as tuned
    for bad, what in [("nope=1", "nope=1"), ("join_new_token=yes", "bad value 'yes'"),
                      ("mgpu_stages", "not field=value")]:  # fmt: skip
        monkeypatch.setenv("KVJAX_TUNING", bad)
        with pytest.raises(ValueError, match=f"KVJAX_TUNING: .*{what}"):
            tuning_for()
