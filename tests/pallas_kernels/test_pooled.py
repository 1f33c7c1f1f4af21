"""The pooled decode kernel (one slot pool shared by a layer's KV heads, `adakv`) against the
float64 oracle on the same tokens in per-head slots, `attend`'s pallas path against its XLA path
on a pool, and `generate` through adakv with pallas == xla. On CPU the kernel runs in the Pallas
interpreter (`TestPooledKernelInterpret`; `TestPooledKernel` compiles them, GPU only)."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_cases import oracle

from kvjax.attention import attend
from kvjax.cache import LayerCache
from kvjax.generate import GenerateConfig, generate
from kvjax.pallas_kernels.decode_attention import (
    FullTier,
    Int8Tier,
    PooledTier,
    attention_mass,
    decode_attention,
    decode_attention_pooled_triton,
)
from kvjax.policies import make_policy

TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 4e-3}


def make_pool(seed, *, b=2, hkv=2, g=3, d=16, p=37, dtype="float32"):
    """(q [B, Hkv, G, D], q_pos [B], PooledTier) with unequal shares, holes, future slots and
    an empty tail on sequence 0 (so its extent stops early)."""
    rng = np.random.default_rng(seed)
    dt = jnp.dtype(dtype)
    q_pos = np.array([200, 90][:b], np.int32)  # sequence 1: part of the pool in its future
    pos = np.stack([rng.permutation(150)[:p] + 2 * hkv for _ in range(b)]).astype(np.int32)
    pos[:, p // 3 : p // 3 + 3] = -1  # holes in the middle
    pos[0, p - p // 4 :] = -1
    share = rng.dirichlet(np.ones(hkv) * 0.7)  # unequal shares, a head may own few slots
    head = rng.choice(hkv, (b, p), p=share).astype(np.int32)
    pos[:, 1 : 2 * hkv + 1] = np.arange(2 * hkv)  # every head sees at least two slots
    head[:, 1 : 2 * hkv + 1] = np.arange(2 * hkv) % hkv
    ext = np.where(pos >= 0, np.arange(1, p + 1), 0).max(-1).astype(np.int32)
    nrm = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32), dt)
    tier = PooledTier(
        nrm(b, 1, p, d), nrm(b, 1, p, d), jnp.asarray(pos[:, None]),
        jnp.asarray(head[:, None]), jnp.asarray(ext[:, None]),
    )  # fmt: skip
    return 2 * nrm(b, hkv, g, d), jnp.asarray(q_pos), tier


def per_head(tier: PooledTier, hkv: int) -> FullTier:
    """The pool's tokens as per-head slots: every head the whole pool, other heads' slots empty."""
    b, _, p, d = tier.k.shape
    own = tier.head == jnp.arange(hkv, dtype=jnp.int32)[None, :, None]  # [B, Hkv, P]
    wide = lambda x: jnp.broadcast_to(x, (b, hkv, p, d))
    ext = jnp.broadcast_to(tier.extent, (b, hkv))
    return FullTier(wide(tier.k), wide(tier.v), jnp.where(own, tier.pos, -1), ext)


CASES = [
    ("float32", 1, 2, 16),
    ("bfloat16", 3, 2, 32),
    ("float16", 4, 3, 16),
    ("float32", 2, 3, 16),
]


class TestPooledKernel:
    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _needs_device(self):
        if not self.INTERPRET and jax.default_backend() != "gpu":
            pytest.skip("compiled Triton kernels need a GPU; the interpreted class covers CPU")

    def run(self, q, q_pos, tier, splits=3, logits=True):
        return decode_attention(
            q, q_pos, full=tier, scale=q.shape[-1] ** -0.5, return_logits=logits,
            interpret=self.INTERPRET, block_k=16, num_splits=splits,
        )  # fmt: skip

    @pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-g{c[1]}-h{c[2]}-d{c[3]}")
    def test_matches_float64(self, case):
        dtype, g, hkv, d = case
        q, q_pos, tier = make_pool(zlib.crc32(repr(case).encode()), hkv=hkv, g=g, d=d, dtype=dtype)
        res = self.run(q, q_pos, tier)
        out, lse, (want_s,), (vis,) = oracle(q, q_pos, per_head(tier, hkv), None, None, 2, d**-0.5)
        tol = TOL[dtype]
        got = np.asarray(res.out, np.float64)
        assert np.linalg.norm(got - out) / np.linalg.norm(out) < tol
        np.testing.assert_allclose(np.asarray(res.lse), lse, atol=10 * tol)
        (got_s,) = res.logits
        assert got_s.shape == want_s.shape  # [B, Hkv, G, P]
        vis4 = np.broadcast_to(vis[:, :, None], want_s.shape)
        np.testing.assert_allclose(np.asarray(got_s)[vis4], want_s[vis4], atol=10 * tol, rtol=tol)
        w = jnp.array([1.0, 0.5], jnp.float32)
        mass = attention_mass(got_s, res.lse, jnp.asarray(vis), w)
        want = np.exp(want_s - lse[..., None]).sum(2) * np.asarray(w)[:, None, None]
        np.testing.assert_allclose(np.asarray(mass), want, atol=5 * tol)

    @pytest.mark.parametrize("splits", [1, 4])
    def test_split_count_does_not_change_result(self, splits):
        q, q_pos, tier = make_pool(splits, p=70)
        res = self.run(q, q_pos, tier, splits=splits, logits=False)
        out, lse, _, _ = oracle(q, q_pos, per_head(tier, 2), None, None, 2, 16**-0.5)
        np.testing.assert_allclose(np.asarray(res.out), out, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(res.lse), lse, atol=1e-5)

    def test_past_the_extent_and_a_head_without_slots(self):
        q, q_pos, tier = make_pool(7)
        tier = tier._replace(
            k=tier.k.at[:, :, -3:].set(jnp.nan),
            v=tier.v.at[:, :, -3:].set(jnp.nan),
            head=jnp.where(tier.head == 1, 0, tier.head),  # KV head 1 owns nothing
            extent=jnp.minimum(tier.extent, tier.k.shape[2] - 3),
        )
        res = self.run(q, q_pos, tier, logits=False)
        assert np.all(np.isfinite(np.asarray(res.out)))
        assert np.all(np.asarray(res.out[:, 1]) == 0)
        assert np.all(np.asarray(res.lse[:, 1]) == -np.inf)
        assert np.all(np.isfinite(np.asarray(res.lse[:, 0])))


class TestPooledKernelInterpret(TestPooledKernel):
    INTERPRET = True


def test_bad_pooled_input_is_named():
    q, q_pos, tier = make_pool(1)
    kw = dict(scale=0.25, interpret=True)
    with pytest.raises(ValueError, match="PooledTier.head"):
        decode_attention_pooled_triton(q, tier._replace(head=tier.head[:, :, :-1]), q_pos, **kw)
    with pytest.raises(ValueError, match="PooledTier.k"):
        decode_attention_pooled_triton(q, tier._replace(k=tier.k[:, :, :, :8]), q_pos, **kw)
    with pytest.raises(ValueError, match="GPU backends"):
        decode_attention(q, q_pos, full=tier, backend="tpu", **kw)
    i8 = jnp.zeros((2, 2, 4, 16), jnp.int8)
    int8 = Int8Tier(i8, i8, *(jnp.zeros((2, 2, 4)),) * 2, jnp.zeros((2, 2, 4), jnp.int32),
                    jnp.zeros((2, 2), jnp.int32))  # fmt: skip
    with pytest.raises(ValueError, match="only tier"):
        decode_attention(q, q_pos, full=tier, int8=int8, **kw)


def test_attend_on_a_pool_pallas_equals_xla():
    """`attend(implementation="pallas")` on a pooled layer runs the pooled kernel (a
    pallas_call in its program) and equals the XLA path: output, per-slot and new mass, lse."""
    q4, q_pos, tier = make_pool(11, hkv=2, g=3)
    b, hkv, g, d = q4.shape
    layer = LayerCache(
        k=tier.k, v=tier.v, pos=tier.pos, score=jnp.zeros(tier.pos.shape, jnp.float32),
        head=tier.head, pool_heads=hkv,
    )  # fmt: skip
    rng = np.random.default_rng(12)
    q = q4.reshape(b, 1, hkv * g, d)
    k_new, v_new = (jnp.asarray(rng.standard_normal((b, 1, hkv, d)), jnp.float32) for _ in "kv")
    args = (q, layer, k_new, v_new, q_pos[:, None], jnp.ones((b, 1), bool))
    weight = jnp.array([[1.0], [0.5]], jnp.float32)
    call = lambda impl: attend(*args, query_weight=weight, implementation=impl)
    assert "pallas_call" in str(jax.make_jaxpr(lambda: call("pallas"))())
    # Full float32 dots on the XLA side: a GPU's default f32 precision (TF32) is ~1e-3 off,
    # where the kernel's f32 dots match the float64 oracle to 1e-5 (the tests above).
    with jax.default_matmul_precision("highest"):
        want_out, want = call("xla")
    got_out, got = call("pallas")
    np.testing.assert_allclose(np.asarray(got_out), np.asarray(want_out), atol=2e-5, rtol=2e-5)
    for field in ("slot_mass", "new_mass", "lse"):
        w, gt = np.asarray(getattr(want, field)), np.asarray(getattr(got, field))
        assert gt.shape == w.shape, field
        np.testing.assert_allclose(gt, w, atol=2e-5, err_msg=field)


def test_generate_adakv_with_pallas_equals_xla(tiny_llama):
    config, params = tiny_llama
    prompts = [[5, 9, 33, 2, 7, 1, 8, 3, 3, 60, 2], [4, 4, 90]]
    policy = make_policy("adakv", 6, press="h2o", num_layers=config.num_layers)
    out = {
        impl: generate(config, params, prompts, policy=policy,
                       gen=GenerateConfig(max_new_tokens=10, chunk_size=4, implementation=impl))
        for impl in ("xla", "pallas")
    }  # fmt: skip
    np.testing.assert_array_equal(np.asarray(out["pallas"].tokens), np.asarray(out["xla"].tokens))
