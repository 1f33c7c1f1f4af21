"""A stacked cache (`new_cache(stacked=True)`) runs the layers in a `lax.scan`: every policy whose
layers share one shape must give the logits and the cache of the unrolled step, through chunked
prefill and decode; per-layer budgets are refused with one clear error."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from policy_cases import build

from kvjax.cache import is_stacked, stack_cache, unstack_cache
from kvjax.generate import model_step, new_cache
from kvjax.models import stack_params

CHUNK, PREFILL, DECODE = 8, 20, 5  # 20-token prompt in chunks of 8 (the last one padded)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _run(config, policy, params, cache, tokens):
    """Chunked prefill of tokens[:, :PREFILL], then greedy decode; all logits and the cache."""
    b = tokens.shape[0]
    outs = []
    for s in range(0, PREFILL, CHUNK):
        chunk = tokens[:, s : s + CHUNK]
        valid = jnp.arange(chunk.shape[1])[None, :] < (PREFILL - s)
        logits, cache = model_step(config, policy, params, cache, chunk, valid.repeat(b, 0))
        outs.append(logits[:, -1])

    def body(carry, _):
        cache, tok = carry
        logits, cache = model_step(config, policy, params, cache, tok, jnp.ones((b, 1), bool))
        return (cache, jnp.argmax(logits, axis=-1).astype(jnp.int32)), logits[:, 0]

    tok = tokens[:, PREFILL - 1 : PREFILL]
    (cache, _), dec = jax.lax.scan(body, (cache, tok), None, length=DECODE)
    return jnp.concatenate([jnp.stack(outs, 1), jnp.swapaxes(dec, 0, 1)], 1), cache


CASES = ["h2o", "confkv-int8", "qevict", "kvpop"]  # ranked, tiered INT8, low-bit routing, scorer


@pytest.mark.parametrize("case", CASES)
def test_scanned_layers_equal_the_unrolled_step(tiny_llama, case):
    config, params = tiny_llama
    # Budgets below the 25 tokens: every policy evicts (or quantizes); QEvict needs room for a
    # window beside its sinks and band.
    policy = build(case, 16 if case == "qevict" else 12)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, PREFILL + CHUNK)), jnp.int32)
    cache = new_cache(config, policy, batch=2, max_len=32, dtype=jnp.float32)
    want_logits, want_cache = _run(config, policy, params, cache, tokens)
    stacked = new_cache(config, policy, batch=2, max_len=32, dtype=jnp.float32, stacked=True)
    assert is_stacked(stacked)
    got_logits, got_cache = _run(config, policy, stack_params(params), stacked, tokens)
    assert is_stacked(got_cache)
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    got, want = jax.tree.leaves(unstack_cache(got_cache)), jax.tree.leaves(want_cache)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_stack_then_unstack_is_the_same_cache(tiny_llama):
    config, _ = tiny_llama
    cache = new_cache(config, build("qevict", 16), batch=2, max_len=32, dtype=jnp.float32)
    cache = cache.replace(length=jnp.array([3, 5], jnp.int32))
    back = unstack_cache(stack_cache(cache))
    assert jax.tree.structure(back) == jax.tree.structure(cache)
    for g, w in zip(jax.tree.leaves(back), jax.tree.leaves(cache), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("case", ["confkv-l", "pyramidkv"])
def test_per_layer_budgets_cannot_stack(tiny_llama, case):
    config, _ = tiny_llama
    with pytest.raises(ValueError, match="per-layer budgets"):
        new_cache(config, build(case, 24), batch=1, max_len=32, dtype=jnp.float32, stacked=True)
