"""StreamingLLM's positions within the cache (`StreamingPolicy(position_shift=True)`) against an
independent float64 masked forward where every (query, key) pair gets the paper's cache
positions; the cache's sink slots against their float32 originals; the layer scan; bad input."""

import dataclasses
import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reliability.char_tokenizer import CharTokenizer
from reliability.masked_forward import cache_positions, masked_nll, streaming_mask

from kvjax.cli import main
from kvjax.eval import run_stream, stream_tokens
from kvjax.generate import model_step, new_cache, score_tokens
from kvjax.models import TINY_GPT2, TINY_LLAMA, RopeScaling, rope_rotation
from kvjax.policies import H2OPolicy, StreamingPolicy, make_policy
from kvjax.weights import LoadedModel

S = 40
BUDGET, SINKS = 9, 2  # cache of 8 = 2 sinks + 6 recent; query 8 is the last one unshifted


@pytest.fixture(scope="module")
def tokens():
    return np.asarray(jax.random.randint(jax.random.key(7), (S,), 0, 128), np.int32)


@pytest.fixture(scope="module")
def scored(tiny_llama, tokens):
    """score_tokens with position_shift on and off (one token per step)."""
    config, params = tiny_llama
    run = lambda shift: score_tokens(
        config,
        params,
        tokens,
        policy=StreamingPolicy(budget=BUDGET, sinks=SINKS, position_shift=shift),
        segment=8,
    )
    return run(True), run(False)


def test_position_shift_equals_the_cache_position_reference(tiny_llama, tokens, scored):
    config, params = tiny_llama
    on, off = (np.asarray(o.nll[0]) for o in scored)
    mask = streaming_mask(S, BUDGET, SINKS)
    want = masked_nll(config, params, tokens, mask, cache_positions(S, BUDGET, SINKS))
    np.testing.assert_allclose(on, want, rtol=2e-5, atol=2e-5)
    # The reference tells the two schemes apart: absolute positions are the default policy's.
    absolute = masked_nll(config, params, tokens, mask)
    np.testing.assert_allclose(off, absolute, rtol=2e-5, atol=2e-5)
    assert np.max(np.abs(want - absolute)) > 1e-3
    assert np.max(np.abs(on - absolute)) > 1e-3
    # Until the cache is full (queries 0..BUDGET-1) nothing moves: bit for bit the default.
    np.testing.assert_array_equal(on[:BUDGET], off[:BUDGET])
    assert np.max(np.abs(on[BUDGET:] - off[BUDGET:])) > 1e-3


def test_sink_slots_are_their_first_keys_turned_once(tiny_llama, scored):
    """After S-1 steps each sink slot holds rotate(first key, Δ), Δ for the next query
    (S-1) - (BUDGET-1), turned from aux (the key as first written: the default policy's slot),
    not step by step from the slot; nothing else moves."""
    on, off = (o.cache for o in scored)
    delta = (S - 1) - (BUDGET - 1)
    rotate = rope_rotation(tiny_llama[0])
    for lon, loff in zip(on.layers, off.layers, strict=True):
        first = np.asarray(loff.k[:, :, :SINKS], np.float32)  # [B, Hkv, S, D]
        np.testing.assert_array_equal(np.asarray(lon.aux), first)
        by = jnp.full((1, SINKS), delta, jnp.int32)
        turned = jnp.swapaxes(rotate(jnp.swapaxes(lon.aux, 1, 2), by), 1, 2)
        # (the jitted rotation may round its float32 products differently from this eager one)
        np.testing.assert_allclose(np.asarray(lon.k[:, :, :SINKS]), turned, rtol=1e-6, atol=1e-7)
        assert np.max(np.abs(np.asarray(turned) - first)) > 1e-3
        for name in ("pos", "score"):
            np.testing.assert_array_equal(getattr(lon, name), getattr(loff, name))
    # Layer 0's keys and values come from the embeddings alone: all but the sink keys equal.
    np.testing.assert_array_equal(on.layers[0].k[:, :, SINKS:], off.layers[0].k[:, :, SINKS:])
    np.testing.assert_array_equal(on.layers[0].v, off.layers[0].v)


@pytest.mark.parametrize("scaling", [None, RopeScaling(kind="llama3", factor=8.0)])
def test_rope_rotation_composes(scaling):
    """R(a)R(b) = R(a+b), with llama3 frequency scaling too (what position_shift relies on)."""
    config = dataclasses.replace(TINY_LLAMA, rope_scaling=scaling)
    rotate = rope_rotation(config)
    x = jax.random.normal(jax.random.key(1), (2, 3, 2, 16), jnp.float32)
    a = jnp.array([[0, 5, 300], [7, 1, 9000]], jnp.int32)
    b = jnp.array([[3, 0, 12], [4000, 2, 1]], jnp.int32)
    np.testing.assert_allclose(rotate(rotate(x, a), b), rotate(x, a + b), atol=2e-3)
    np.testing.assert_array_equal(rotate(x, jnp.zeros_like(a)), x)
    assert rope_rotation(TINY_GPT2) is None


@functools.partial(jax.jit, static_argnums=(0, 1))
def _decode(config, policy, params, cache, toks):
    def body(cache, tok):
        logits, cache = model_step(config, policy, params, cache, tok[:, None], tok[:, None] >= 0)
        return cache, logits[:, 0]

    return jax.lax.scan(body, cache, toks.T)


def test_layer_scan_equals_per_layer(tiny_llama):
    config, params = tiny_llama
    policy = StreamingPolicy(budget=7, sinks=3, position_shift=True)
    toks = jax.random.randint(jax.random.key(4), (2, 20), 0, config.vocab_size)
    out = {}
    for stacked in (False, True):
        cache = new_cache(config, policy, batch=2, max_len=20, dtype=jnp.float32, stacked=stacked)
        out[stacked] = _decode(config, policy, params, cache, toks)
    np.testing.assert_allclose(out[True][1], out[False][1], rtol=1e-5, atol=1e-5)
    for i, layer in enumerate(out[False][0].layers):
        np.testing.assert_allclose(out[True][0].layers.k[i], layer.k, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(out[True][0].layers.aux[i], layer.aux)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(budget=8, position_shift="true"), "position_shift must be True or False"),
        (dict(budget=8, position_shift=1), "position_shift must be True or False"),
        (dict(budget=8, sinks=0, position_shift=True), "sinks=0"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StreamingPolicy(**kwargs)
    with pytest.raises(ValueError, match=match):
        make_policy("streaming", **kwargs)


@pytest.mark.parametrize(
    "policy",
    [
        pytest.param(StreamingPolicy(budget=8, position_shift=True), id="streaming"),
        pytest.param(H2OPolicy(budget=8, position_shift=True), id="h2o"),
    ],
)
def test_a_model_without_rope_is_refused(tiny_gpt2, policy):
    """StreamingLLM's shift and a ranked policy's both need RoPE (GPT-2's positions are
    learned)."""
    config, params = tiny_gpt2
    with pytest.raises(ValueError, match="has no RoPE"):
        new_cache(config, policy, batch=1, max_len=16, dtype=jnp.float32)
    with pytest.raises(ValueError, match="has no RoPE"):
        score_tokens(config, params, np.arange(10), policy=policy)


@pytest.mark.parametrize(
    "name,cls,value", [("streaming", StreamingPolicy, "TRUE"), ("h2o", H2OPolicy, "True")]
)
def test_cli_set_position_shift(tiny_llama, monkeypatch, capsys, name, cls, value):
    """`--set position_shift=True` (true/false in any case) reaches the policy, positional or
    ranked (ppl and generate build it the same way, `kvjax.cli._common.build_policy`)."""
    import kvjax.cli._stream as stream_cli

    config, params = tiny_llama
    model = LoadedModel(config=config, params=params, tokenizer=CharTokenizer(), source="tiny")
    monkeypatch.setattr(stream_cli, "load", lambda args: model)
    argv = ["stream", "--policy", name, "--budget", "9", "--tokens", "48"]
    argv += ["--chunk", "16", "--segment", "16", "--set", f"position_shift={value}", "--json"]
    assert main(argv) == 0
    got = [r["ppl"] for r in json.loads(capsys.readouterr().out)]
    toks = stream_tokens(model, 49)
    for shift in (True, False):
        policy = cls(budget=9, position_shift=shift)
        rows = run_stream(model, policy, toks, budget=9, chunk=16, segment=16, max_full=64)
        same = all(math.isclose(a, r.ppl, rel_tol=1e-6) for a, r in zip(got, rows, strict=True))
        assert same == shift


def test_cli_bad_position_shift_exits_2(capsys):
    argv = ["stream", "--policy", "streaming", "--budget", "9", "--set", "position_shift=maybe"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "position_shift must be True or False" in err[0]
