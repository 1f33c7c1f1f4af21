"""Fused projections (`fuse_projections`, `stack_params(fuse=True)`): the same model, one GEMM
per input. Checked against the transformers goldens (Llama and Qwen2, whose q/k/v carry biases),
against the unfused forward over a stacked cache, and column by column against the weights they
come from. What they change on a GPU is measured in docs/lab/2026-12-06-h100-decode-gemms.md."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from model_forward import empty_forward

from kvjax.models import (
    TINY_GPT2,
    TINY_LLAMA,
    fuse_projections,
    init_params,
    stack_params,
)
from kvjax.weights import load_hf_dir


def stacked_logits(config, params, ids: np.ndarray):
    """Logits and output of a forward over a stacked empty cache (the layer scan)."""
    out = empty_forward(config, params, ids, stacked=True)
    return np.asarray(out.logits), out


@pytest.mark.parametrize("name", ["llama_tiny", "qwen2_tiny"])
def test_fused_layer_scan_matches_transformers(goldens, name):
    config, params, _ = load_hf_dir(goldens / name)
    g = np.load(goldens / name / "golden.npz")
    fused = stack_params(params, config, fuse=True)
    assert fused.layers.wqkv is not None and fused.layers.wq is None
    logits, _ = stacked_logits(config, fused, g["input_ids"])
    assert np.abs(logits - g["logits"]).max() < 1e-4


@pytest.mark.parametrize("bias", [False, True], ids=["llama", "qkv-bias"])
def test_fused_equals_unfused_forward_float32(bias):
    config = dataclasses.replace(TINY_LLAMA, attn_bias=bias)
    params = init_params(config, jax.random.key(1), dtype=jnp.float32)
    ids = np.asarray(jax.random.randint(jax.random.key(2), (2, 5), 0, config.vocab_size))
    want, ref = stacked_logits(config, stack_params(params, config, fuse=False), ids)
    fused = stack_params(params, config, fuse=True)
    assert fused.layers.attn_norm is None and fused.layers.mlp_norm is None  # folded
    got, out = stacked_logits(config, fused, ids)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for a, b in ((out.k_new, ref.k_new), (out.v_new, ref.v_new)):  # the cache's new K/V too
        assert a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-5)


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("bias", [False, True], ids=["llama", "qkv-bias"])
def test_fused_bfloat16_is_as_close_to_float32_as_unfused(bias, seed):
    """In bfloat16 the folded norm weights round once inside the weights instead of once in
    the normed activations: against the same weights' float32 forward, the fused model's
    error is the unfused one's size (mean within 1.5x, max within 2.5x), not a new error
    (a norm folded into the wrong weight is off by the activations' own size)."""
    config = dataclasses.replace(TINY_LLAMA, attn_bias=bias)
    params = init_params(config, jax.random.key(seed), dtype=jnp.bfloat16)
    ids = np.asarray(jax.random.randint(jax.random.key(2), (2, 5), 0, config.vocab_size))
    p32 = jax.tree.map(lambda a: a.astype(jnp.float32), params)
    ref, ref_out = stacked_logits(config, stack_params(p32, config, fuse=False), ids)
    unfused, un_out = stacked_logits(config, stack_params(params, config, fuse=False), ids)
    fused, fu_out = stacked_logits(config, stack_params(params, config, fuse=True), ids)
    for got, base, want in ((fused, unfused, ref), (fu_out.k_new, un_out.k_new, ref_out.k_new),
                            (fu_out.v_new, un_out.v_new, ref_out.v_new)):  # fmt: skip
        err = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))
        base_err = np.abs(np.asarray(base, np.float32) - np.asarray(want, np.float32))
        assert base_err.max() > 0 and err.max() <= 2.5 * base_err.max()
        assert err.mean() <= 1.5 * base_err.mean()


@settings(max_examples=20, deadline=None)
@given(hkv=st.integers(1, 3), g=st.integers(1, 4), d=st.sampled_from([2, 4]), f=st.integers(1, 5))
def test_fused_columns_are_the_weights_columns(hkv, g, d, f):
    """Column by column: KV head h's G query heads, then k_h, then v_h; gate f beside up f."""
    config = dataclasses.replace(
        TINY_LLAMA, num_heads=hkv * g, num_kv_heads=hkv, head_dim=d, intermediate_size=f
    )
    layer = init_params(config, jax.random.key(3)).layers[0]
    e = config.hidden_size
    rng = np.random.default_rng(hkv * 100 + g * 10 + d + f)
    an, mn = (jnp.asarray(rng.uniform(0.5, 2.0, e), jnp.float32) for _ in "am")
    layer = layer.replace(attn_norm=an, mlp_norm=mn)  # rows scaled by their norm weights
    fused = fuse_projections(layer, config)
    assert fused.attn_norm is None and fused.mlp_norm is None
    wqkv, wgu = np.asarray(fused.wqkv), np.asarray(fused.w_gate_up)
    scaled = lambda w, n: np.asarray(w) * np.asarray(n)[:, None]  # float32: exact as stored
    wq, wk, wv = (scaled(w, an) for w in (layer.wq, layer.wk, layer.wv))
    assert wqkv.shape == (config.hidden_size, hkv * (g + 2) * d)
    for h in range(hkv):
        base = h * (g + 2) * d
        for j in range(g):  # query head h·G + j uses KV head h (GQA)
            q = (h * g + j) * d
            np.testing.assert_array_equal(
                wqkv[:, base + j * d : base + (j + 1) * d], wq[:, q : q + d]
            )
        np.testing.assert_array_equal(
            wqkv[:, base + g * d : base + (g + 1) * d], wk[:, h * d : (h + 1) * d]
        )
        np.testing.assert_array_equal(
            wqkv[:, base + (g + 1) * d : base + (g + 2) * d], wv[:, h * d : (h + 1) * d]
        )
    np.testing.assert_array_equal(wgu[:, 0::2], scaled(layer.w_gate, mn))
    np.testing.assert_array_equal(wgu[:, 1::2], scaled(layer.w_up, mn))
    assert fused.wq is fused.wk is fused.wv is fused.w_gate is fused.w_up is None


def test_fusing_twice_changes_nothing():
    params = stack_params(init_params(TINY_LLAMA, jax.random.key(4)), TINY_LLAMA, fuse=True)
    again = stack_params(params, TINY_LLAMA, fuse=True)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again), strict=True):
        assert a is b


def test_fusion_default_is_the_gpu(monkeypatch):
    params = init_params(TINY_LLAMA, jax.random.key(5))
    assert stack_params(params, TINY_LLAMA).layers.wqkv is None  # on the CPU: as loaded
    assert stack_params(params).layers.wqkv is None  # no config: nothing to fuse with
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert stack_params(params, TINY_LLAMA).layers.wqkv is not None
    gpt2 = init_params(TINY_GPT2, jax.random.key(6))
    assert stack_params(gpt2, TINY_GPT2).layers.w_qkv is not None  # GPT-2: already one weight


def test_fuse_needs_a_llama_config():
    gpt2 = init_params(TINY_GPT2, jax.random.key(6))
    with pytest.raises(ValueError, match="Llama-family"):
        stack_params(gpt2, TINY_GPT2, fuse=True)
    with pytest.raises(ValueError, match="its config"):
        stack_params(init_params(TINY_LLAMA, jax.random.key(7)), fuse=True)


def test_fused_stack_of_unequal_layers_is_refused():
    params = init_params(TINY_LLAMA, jax.random.key(8))
    first = params.layers[0]
    odd = first.replace(w_down=jnp.zeros((first.w_down.shape[0] + 1, first.w_down.shape[1])))
    with pytest.raises(ValueError, match="cannot stack"):
        stack_params(params.replace(layers=(odd, *params.layers[1:])), TINY_LLAMA, fuse=True)


def test_already_stacked_params_are_fused_only_when_asked():
    stacked = stack_params(init_params(TINY_LLAMA, jax.random.key(9)), fuse=False)
    assert stack_params(stacked, TINY_LLAMA) is stacked  # the default never copies these
    fused = stack_params(stacked, TINY_LLAMA, fuse=True)
    gate = np.asarray(stacked.layers.w_gate) * np.asarray(stacked.layers.mlp_norm)[:, :, None]
    np.testing.assert_array_equal(np.asarray(fused.layers.w_gate_up[:, :, 0::2]), gate)
