"""The split combine as one Triton kernel (`combine_triton`) against `combine` in float64 and
against a brute-force softmax over the splits; compiled on a GPU, interpreted on the CPU; and
`decode_attention`'s lone-full-tier path through it against the float64 oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_cases import Case, make_tiers, oracle
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.eval._kernel_ir import export_cuda
from kvjax.pallas_kernels.decode_attention import combine_triton, decode_attention
from kvjax.pallas_kernels.decode_attention._combine_triton import MAX_TILE, combine_applies

INTERPRET = jax.default_backend() != "gpu"


def _partials(rng, b, hkv, s, rows, d, dead=0.3):
    """Random split outputs and log-sum-exps, a share of splits -inf (saw nothing), and
    garbage (NaN) in the padding rows, which the kernel must never read."""
    out = rng.normal(size=(b, hkv, s, rows, d)).astype(np.float32)
    lse = (rng.normal(size=(b, hkv, s, rows)) * 8).astype(np.float32)
    lse[rng.random(lse.shape) < dead] = -np.inf
    return out, lse


def _brute(out, lse, group):
    """Per (sequence, KV head, query head): Σ_s softmax(lse)_s · out_s in float64 with NumPy
    loops; lse = log Σ_s exp(lse_s). Nothing visible: 0 and -inf."""
    b, hkv, s, _, d = out.shape
    o = np.zeros((b, hkv, group, d))
    l = np.full((b, hkv, group), -np.inf)
    for i in range(b):
        for j in range(hkv):
            for g in range(group):
                x = lse[i, j, :, g].astype(np.float64)
                if np.all(np.isneginf(x)):
                    continue
                m = x.max()
                w = np.exp(x - m)
                o[i, j, g] = (w[:, None] * out[i, j, :, g].astype(np.float64)).sum(0) / w.sum()
                l[i, j, g] = m + np.log(w.sum())
    return o, l


def _check(out, lse, group):
    pad = out.copy()
    pad[:, :, :, group:] = np.nan  # padding rows: never read
    lpad = lse.copy()
    lpad[..., group:] = np.nan
    o, l = combine_triton(jnp.asarray(pad), jnp.asarray(lpad), group, interpret=INTERPRET)
    ro, rl = _brute(out, lse, group)
    np.testing.assert_allclose(np.asarray(o), ro, rtol=1e-5, atol=1e-5)
    assert np.array_equal(np.isneginf(np.asarray(l)), np.isneginf(rl))
    fin = np.isfinite(rl)
    np.testing.assert_allclose(np.asarray(l)[fin], rl[fin], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "b, hkv, s, rows, group, d",
    [(1, 8, 132, 16, 4, 128), (8, 8, 17, 16, 4, 128), (2, 3, 5, 16, 3, 64), (1, 2, 1, 8, 8, 16)],
)
def test_matches_a_brute_force_softmax_over_the_splits(b, hkv, s, rows, group, d):
    rng = np.random.default_rng(s * 1000 + d)
    _check(*_partials(rng, b, hkv, s, rows, d), group)


@settings(max_examples=12, deadline=None)
@given(
    s=st.integers(1, 40),
    group=st.integers(1, 16),
    d=st.sampled_from([16, 32, 64, 128]),
    dead=st.sampled_from([0.0, 0.5, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_any_split_count_group_and_dead_share(s, group, d, dead, seed):
    """Every split dead (nothing visible anywhere) gives 0 and -inf, as `combine`."""
    rng = np.random.default_rng(seed)
    _check(*_partials(rng, 1, 2, s, 16, d, dead), group)


def test_bad_input_gets_one_clear_error():
    out = jnp.zeros((1, 2, 3, 16, 64), jnp.float32)
    lse = jnp.zeros((1, 2, 3, 16), jnp.float32)
    with pytest.raises(ValueError, match="lse \\[B, Hkv, S, R\\]"):
        combine_triton(out, lse[..., :8], 4)
    with pytest.raises(ValueError, match="float32 partials"):
        combine_triton(out.astype(jnp.bfloat16), lse, 4)
    with pytest.raises(ValueError, match="group 17 must be in 1..16"):
        combine_triton(out, lse, 17)
    with pytest.raises(ValueError, match="head dim 48"):
        combine_triton(jnp.zeros((1, 2, 3, 16, 48), jnp.float32), lse, 4)
    many = MAX_TILE // 16 + 1
    assert "splits" in combine_applies(many, 64)
    with pytest.raises(ValueError, match=f"{many} splits"):
        combine_triton(jnp.zeros((1, 1, many, 16, 64)), jnp.zeros((1, 1, many, 16)), 4)


@pytest.mark.parametrize("s", [17, 132, 512])
def test_lowers_for_h200(s):
    sds = jax.ShapeDtypeStruct
    text = export_cuda(
        lambda o, l: combine_triton(o, l, 4),
        sds((1, 8, s, 16, 128), jnp.float32),
        sds((1, 8, s, 16), jnp.float32),
    )
    assert "kvjax_combine_splits" in text


@pytest.mark.parametrize("fused", [True, False])
def test_decode_attention_of_a_lone_full_tier_matches_float64(monkeypatch, fused):
    """`decode_attention` with one full tier (through `combine_triton` unless the Tuning's
    fused_combine is off) against the float64 oracle, logits included."""
    monkeypatch.setenv("KVJAX_TUNING", f"fused_combine={int(fused)}")
    case = Case(dtype="bfloat16", tiers="fp", ratio=4, head_dim=128, cap=200)
    q, q_pos, full, _, _ = make_tiers(case, 3)
    res = decode_attention(
        q, q_pos, full=full, scale=case.head_dim**-0.5, num_splits=3, return_logits=True,
        interpret=INTERPRET,
    )  # fmt: skip
    ro, rl = oracle(q, q_pos, full, None, None, None, case.head_dim**-0.5)[:2]
    np.testing.assert_allclose(np.asarray(res.out), np.asarray(ro), atol=2e-2, rtol=2e-2)
    fin = np.isfinite(np.asarray(rl))
    np.testing.assert_allclose(np.asarray(res.lse)[fin], np.asarray(rl)[fin], atol=2e-2)
    assert res.logits[0].shape[:3] == q.shape[:3]
