"""The generate loop: equivalences, flat memory, compile counts, stop tokens, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.generate import GenerateConfig, Sampling, generate, sample, score_tokens
from kvjax.generate._loop import _generate
from kvjax.generate._score import _score_segment
from kvjax.policies import make_policy


def prompts_of(lengths, seed=0, vocab=128):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=n).tolist() for n in lengths]


@settings(max_examples=10)
@given(
    lengths=st.lists(st.integers(1, 20), min_size=1, max_size=3),
    chunk=st.integers(1, 9),
    extra=st.integers(0, 8),
    name=st.sampled_from(["window", "streaming"]),
)
def test_budget_at_least_length_equals_full(tiny_llama, lengths, chunk, extra, name):
    config, params = tiny_llama
    prompts = prompts_of(lengths)
    n_new = 6
    gen = GenerateConfig(max_new_tokens=n_new, chunk_size=chunk)
    full = generate(config, params, prompts, policy=make_policy("full"), gen=gen)
    budget = max(lengths) + n_new + extra
    other = generate(config, params, prompts, policy=make_policy(name, budget), gen=gen)
    np.testing.assert_array_equal(np.asarray(other.tokens), np.asarray(full.tokens))


def test_budget_at_least_length_gives_identical_logits(tiny_gpt2):
    config, params = tiny_gpt2
    ids = np.random.default_rng(3).integers(0, 128, size=(2, 40))
    full = score_tokens(config, params, ids, policy=make_policy("full"), segment=8)
    for name in ("window", "streaming"):
        # Budget 41: a cache of 40 slots, full's shape here, so softmax sums run in one order.
        other = score_tokens(config, params, ids, policy=make_policy(name, 41), segment=8)
        np.testing.assert_array_equal(np.asarray(other.nll), np.asarray(full.nll))


def test_batch_with_different_lengths_equals_one_by_one(tiny_llama):
    config, params = tiny_llama
    prompts = prompts_of([3, 17, 9], seed=5)
    gen = GenerateConfig(max_new_tokens=8, chunk_size=4)
    for policy in (make_policy("full"), make_policy("streaming", 10, sinks=2)):
        batch = generate(config, params, prompts, policy=policy, gen=gen)
        for i, p in enumerate(prompts):
            alone = generate(config, params, [p], policy=policy, gen=gen)
            np.testing.assert_array_equal(np.asarray(batch.tokens[i]), np.asarray(alone.tokens[0]))


def test_small_budget_keeps_live_bytes_flat(tiny_llama):
    config, params = tiny_llama
    budget = 8
    gen = GenerateConfig(max_new_tokens=40, chunk_size=4)
    for name in ("window", "streaming"):
        out = generate(config, params, prompts_of([5]), policy=make_policy(name, budget), gen=gen)
        live = out.telemetry.live_bytes()[:, 0]
        # 2 layers x 2 KV heads x budget slots x (K+V) x 16 dims x 4 bytes once full.
        full_bytes = config.num_layers * config.num_kv_heads * budget * 2 * config.head_dim * 4
        assert live.max() == full_bytes
        assert np.all(live[budget:] == full_bytes)  # flat while the sequence grows to 45
        assert np.all(np.diff(live) >= 0)
    grow = generate(config, params, prompts_of([5]), policy=make_policy("full"), gen=gen)
    assert np.all(np.diff(grow.telemetry.live_bytes()[:, 0]) > 0)


def test_decode_compiles_once_per_configuration(tiny_llama):
    config, params = tiny_llama
    policy = make_policy("window", 8)
    gen = GenerateConfig(max_new_tokens=50, chunk_size=16)
    before = _generate._cache_size()
    for lengths in ([3], [9], [16], [1]):  # all pad to one 16-token chunk
        generate(config, params, prompts_of(lengths), policy=policy, gen=gen)
    assert _generate._cache_size() == before + 1
    before = _score_segment._cache_size()
    ids = np.random.default_rng(0).integers(0, 128, size=(1, 100))
    score_tokens(config, params, ids, policy=policy, segment=16)  # 7 segments
    assert _score_segment._cache_size() == before + 1


def test_stop_tokens_end_sequences(tiny_llama):
    config, params = tiny_llama
    prompts = prompts_of([4, 6], seed=2)
    free = generate(
        config, params, prompts, policy=make_policy("full"), gen=GenerateConfig(max_new_tokens=10)
    )
    stop = int(free.tokens[0, 3])
    out = generate(
        config,
        params,
        prompts,
        policy=make_policy("full"),
        gen=GenerateConfig(max_new_tokens=10, stop_tokens=(stop,), pad_id=127),
    )
    first = int(np.argmax(np.asarray(free.tokens[0]) == stop))
    assert int(out.num_generated[0]) == first + 1
    np.testing.assert_array_equal(
        np.asarray(out.tokens[0, : first + 1]), np.asarray(free.tokens[0, : first + 1])
    )
    assert np.all(np.asarray(out.tokens[0, first + 1 :]) == 127)


def test_sampling_top_p_and_temperature():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.key(0), 2000)
    nucleus = Sampling(temperature=1.0, top_p=0.7)
    draw = jax.vmap(lambda k: sample(logits, k, nucleus))
    counts = np.bincount(np.asarray(draw(keys))[:, 0], minlength=4)
    # Nucleus of mass >= 0.7 is {0, 1}, renormalised to 0.625 / 0.375.
    assert counts[2] == counts[3] == 0
    assert abs(counts[0] / 2000 - 0.625) < 0.04
    draw_all = jax.vmap(lambda k: sample(logits, k, Sampling(temperature=1.0)))
    counts = np.bincount(np.asarray(draw_all(keys))[:, 0], minlength=4) / 2000
    np.testing.assert_allclose(counts, [0.5, 0.3, 0.15, 0.05], atol=0.04)
    assert int(sample(logits, keys[0], Sampling())[0]) == 0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ],
)
def test_bad_sampling(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Sampling(**kwargs)


def test_bad_generate_input_is_named(tiny_llama, tiny_gpt2):
    config, params = tiny_llama
    gen = GenerateConfig(max_new_tokens=4)
    full = make_policy("full")
    with pytest.raises(ValueError, match=r"token id 128 at prompt 1, position 2 is out of range"):
        generate(config, params, [[1, 2], [3, 4, 128]], policy=full, gen=gen)
    with pytest.raises(ValueError, match=r"token id -1"):
        generate(config, params, [[-1]], policy=full, gen=gen)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        generate(config, params, [[]], policy=full, gen=gen)
    with pytest.raises(ValueError, match="prompts is empty"):
        generate(config, params, [], policy=full, gen=gen)
    with pytest.raises(ValueError, match="stop token 999"):
        generate(
            config,
            params,
            [[1]],
            policy=full,
            gen=GenerateConfig(max_new_tokens=2, stop_tokens=(999,)),
        )
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        GenerateConfig(max_new_tokens=0)
    with pytest.raises(ValueError, match="token ids must be in"):
        score_tokens(config, params, [[1, 500]], policy=full)
    g_config, g_params = tiny_gpt2
    with pytest.raises(ValueError, match="exceeds the model's 64 learned positions"):
        generate(g_config, g_params, [[1] * 60], policy=full, gen=GenerateConfig(max_new_tokens=8))


def test_generate_from_cache_continues_exactly(tiny_llama):
    """Prefill a context, then continue with a question: the same tokens as one generate()."""
    import jax.numpy as jnp

    from kvjax.generate import generate_from_cache, new_cache, prefill_cache

    config, params = tiny_llama
    ctx, question = prompts_of([13], seed=4)[0], prompts_of([5], seed=6)[0]
    gen = GenerateConfig(max_new_tokens=7, chunk_size=4)
    policy = make_policy("full")
    ref = generate(config, params, [ctx + question], policy=policy, gen=gen)
    cache = new_cache(config, policy, batch=1, max_len=64, dtype=jnp.float32)
    pad = lambda ids, m: jnp.asarray([ids + [0] * (-len(ids) % m)], jnp.int32)
    cache, _ = prefill_cache(
        config, policy, gen, params, cache, pad(ctx, 4), jnp.asarray([len(ctx)], jnp.int32)
    )
    out, cache = generate_from_cache(
        config,
        policy,
        gen,
        params,
        cache,
        pad(question, 4),
        jnp.asarray([len(question)], jnp.int32),
        jax.random.key(0),
    )
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    assert int(cache.length[0]) == len(ctx) + len(question) + 7


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("confkv", dict(protected=2, fp_window=4)),
        ("confkv", dict(protected=2, fp_window=3, int8=False, pyramid=0.5, num_layers=2)),
        ("h2o", {}),
    ],
    ids=["confkv-int8", "confkv-l", "h2o"],
)
def test_one_launch_slot_writes_equal_xla_scatters(tiny_llama, name, kwargs):
    """write_kernel="pallas" writes every layer's decode slots in one kernel (interpreted here):
    the same tokens and, after prefill and 10 decode steps, the same cache, array for array."""
    from kvjax.generate import generate_from_cache, new_cache

    config, params = tiny_llama
    prompt = jnp.asarray(prompts_of([11, 7], seed=2, vocab=config.vocab_size)[0][:8] * 2)
    gen = GenerateConfig(max_new_tokens=10, chunk_size=4)
    outs = []
    for kernel in ("xla", "pallas"):
        policy = make_policy(name, 16, write_kernel=kernel, **kwargs)
        cache = new_cache(config, policy, batch=2, max_len=40, dtype=jnp.float32)
        out, cache = generate_from_cache(
            config, policy, gen, params, cache, jnp.stack([prompt, prompt[::-1]]),
            jnp.asarray([16, 13], jnp.int32), jax.random.key(0),
        )  # fmt: skip
        outs.append((out.tokens, cache))
    (tok_x, cache_x), (tok_p, cache_p) = outs
    np.testing.assert_array_equal(np.asarray(tok_p), np.asarray(tok_x))
    # a decode step (both layers) holds exactly one slot-write kernel
    from kvjax.generate._step import model_step

    step = lambda c: model_step(config, policy, params, c, tok_p[:, :1], jnp.ones((2, 1), bool))
    assert str(jax.make_jaxpr(step)(cache_p)).count("name=write_slots") == 1
    for a, b in zip(jax.tree.leaves(cache_p), jax.tree.leaves(cache_x), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
