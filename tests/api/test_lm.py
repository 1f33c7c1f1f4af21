"""`kvjax.LM` on a tiny random model: it only calls the functional core (same tokens), splits
results per prompt, drops stop tokens, batches texts of different lengths exactly, compiles once
per shape, and refuses bad input with one clear error."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.cache import CacheSpec, init_cache
from kvjax.generate import _loop, _score
from kvjax.models import forward
from kvjax.policies import ConfKVPolicy, make_policy


def core_ids(lm, prompts, policy, n, chunk=256):
    gen = kvjax.GenerateConfig(max_new_tokens=n, stop_tokens=(256,), chunk_size=chunk)
    ids = [lm.tokenizer.encode(p) for p in prompts]
    out = kvjax.generate(lm.config, lm.params, ids, policy=policy, gen=gen)
    return [
        np.asarray(out.tokens[b, : int(out.num_generated[b])]).tolist() for b in range(len(ids))
    ]


def test_generate_is_the_core_split_per_prompt(tiny_lm):
    prompts = ["ab", "hello world, a longer prompt"]
    res = tiny_lm.generate(prompts, policy="window", budget=8, max_new_tokens=6)
    want = core_ids(tiny_lm, prompts, make_policy("window", 8), 6)
    assert res.tokens == [w[:-1] if w[-1] == 256 else w for w in want]
    assert res.text == [tiny_lm.tokenizer.decode(t) for t in res.tokens]
    assert res.prompt_tokens == [len(p) for p in prompts] and res.policy == make_policy("window", 8)
    chex.assert_shape(res.telemetry.live_bytes(), (6, 2))
    one = tiny_lm.generate("ab", policy="window", budget=8, max_new_tokens=6)
    assert isinstance(one.text, str) and one.tokens == res.tokens[0]


def test_stop_token_ends_generation_and_never_shows(tiny_lm):
    free = tiny_lm.generate("stop here", max_new_tokens=8)
    assert free.finish_reason == "length" and len(free.tokens) == 8
    stop = free.tokens[3]
    first = free.tokens.index(stop)
    res = tiny_lm.generate("stop here", max_new_tokens=8, stop=[stop])
    assert res.finish_reason == "stop" and res.tokens == free.tokens[:first]
    assert stop not in res.tokens and res.text == tiny_lm.tokenizer.decode(free.tokens[:first])
    assert tiny_lm.generate("stop here", max_new_tokens=8, stop="<eos>").tokens == free.tokens


def test_chat_renders_the_template(tiny_lm):
    msgs = [{"role": "user", "content": "hi"}]
    a = tiny_lm.chat(msgs, max_new_tokens=4)
    b = tiny_lm.generate("<user>hi\n<assistant>", max_new_tokens=4)
    c = tiny_lm.generate("hi", chat=True, max_new_tokens=4)
    assert a.tokens == b.tokens == c.tokens
    assert tiny_lm.chat([msgs, msgs], max_new_tokens=4).tokens == [a.tokens, a.tokens]
    with pytest.raises(ValueError, match="role"):
        tiny_lm.chat([{"content": "no role"}])


def reference_ppl(lm, text):
    """exp(mean NLL) from one plain forward, log-softmax in float64."""
    ids = np.asarray([lm.tokenizer.encode(text)], np.int32)
    s = ids.shape[1]
    spec = CacheSpec(batch=1, num_kv_heads=2, head_dim=16, capacities=(1, 1))
    pos = jnp.arange(s, dtype=jnp.int32)[None]
    out = forward(
        lm.config, lm.params, jnp.asarray(ids), pos, jnp.ones((1, s), bool), init_cache(spec)
    )
    logits = np.asarray(out.logits[0], np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return float(np.exp(-logp[np.arange(s - 1), ids[0, 1:]].mean()))


def test_ppl_batch_of_different_lengths(tiny_lm):
    texts = ["a short text", "a rather longer text, with more tokens in it than the first"]
    full = tiny_lm.ppl(texts)
    np.testing.assert_allclose(full.ppl, [reference_ppl(tiny_lm, t) for t in texts], rtol=1e-4)
    assert full.num_tokens == [len(t) for t in texts]  # one byte token per character
    assert [len(x) for x in full.nll] == [len(t) - 1 for t in texts]
    # Through an evicting cache, each row of a batch scores as it does alone.
    batch = tiny_lm.ppl(texts, policy="window", budget=6, segment=16)
    alone = [tiny_lm.ppl(t, policy="window", budget=6, segment=16).ppl for t in texts]
    np.testing.assert_allclose(batch.ppl, alone, rtol=1e-5)
    assert batch.ppl[1] != pytest.approx(full.ppl[1], rel=1e-3)  # the window did evict


def test_second_call_with_same_shapes_does_not_recompile(tiny_lm, monkeypatch):
    monkeypatch.setattr(
        _loop, "prefill_and_decode", chex.assert_max_traces(_loop.prefill_and_decode, n=1)
    )
    before = _loop._generate._cache_size()
    for prompt in ("first prompt", "second, other prompt"):  # both pad to one 256-token chunk
        tiny_lm.generate(prompt, policy="h2o", budget=12, max_new_tokens=7)
    assert _loop._generate._cache_size() == before + 1
    before = _score._score_segment._cache_size()
    for text in ("one text to score", "another, longer text to score"):
        tiny_lm.ppl(text, policy="h2o", budget=12, segment=32)
    assert _score._score_segment._cache_size() == before + 1


def test_compression_sets_the_budget_from_the_prompt(tiny_lm):
    prompt = "x" * 40  # 40 byte tokens
    res = tiny_lm.generate(prompt, policy="window", compression=0.75, max_new_tokens=2)
    assert res.policy == make_policy("window", 10)  # kvpress: keeps (1 - 0.75) · 40 tokens
    res = tiny_lm.generate([prompt, "x" * 8], policy="window", compression=0.5, max_new_tokens=2)
    assert res.policy.budget == 20  # from the longest prompt


def test_confkv_l_takes_the_models_layer_count(tiny_lm):
    kw = dict(protected=2, fp_window=3, int8=False)
    res = tiny_lm.generate("abcdefgh", policy=make_policy("confkv-l", 16, **kw), max_new_tokens=3)
    assert res.policy.num_layers == tiny_lm.config.num_layers == 2
    spec = kvjax.generate.cache_spec_for(
        tiny_lm.config, make_policy("confkv-l", 16, **kw), batch=1, max_len=8, dtype=np.float32
    )
    # Layer budgets 16 · (1 ± 0.5) = 24 and 8 tokens attended, one of them the current token:
    # 23 and 7 cached slots — a pyramid, not a flat 16.
    assert spec.capacities == (23, 7)
    pinned = ConfKVPolicy(budget=16, pyramid=0.5, num_layers=2, **kw)
    assert tiny_lm.generate("abcdefgh", policy=pinned, max_new_tokens=3).tokens == res.tokens


def test_policy_built_for_another_model_is_refused_everywhere(tiny_lm):
    wrong = ConfKVPolicy(budget=24, pyramid=0.5, num_layers=30, protected=2, fp_window=3)
    c, p = tiny_lm.config, tiny_lm.params
    gen = kvjax.GenerateConfig(max_new_tokens=2)
    calls = [
        lambda: tiny_lm.generate("abc", policy=wrong),
        lambda: tiny_lm.ppl("abc", policy=wrong),
        lambda: kvjax.generate(c, p, [[1, 2]], policy=wrong, gen=gen),
        lambda: kvjax.new_cache(c, wrong, batch=1, max_len=4, dtype=np.float32),
        lambda: kvjax.score_tokens(c, p, np.ones((1, 4), np.int32), policy=wrong),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="num_layers is 30 but the model .* has 2 layers"):
            call()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(policy="h2o", budget=8, compression=0.5), ValueError, "not both"),
        (dict(policy="h2o", compression=1.0), ValueError, r"compression must be in \[0, 1\)"),
        (dict(policy="h2o", compression=-0.1), ValueError, "compression must be in"),
        (dict(policy="h2o", budget=0), ValueError, "budget must be >= 1"),
        (dict(policy="h2o", budget=8.5), TypeError, "budget must be an int"),
        (dict(policy="full", compression=0.5), ValueError, "takes no compression"),
        (dict(policy="full", budget=8), ValueError, "takes no budget"),
        (dict(policy="h2o"), ValueError, "needs a budget"),
        (dict(policy="nope", budget=8), ValueError, "unknown policy 'nope'"),
        (dict(policy=make_policy("h2o", 8), budget=8), ValueError, "carries its own budget"),
        (dict(policy=42), TypeError, "policy must be a name"),
        (dict(policy="streaming", compression=0.9), ValueError, "gives a budget of 1 tokens"),
        (dict(max_new_tokens=0), ValueError, "max_new_tokens"),
        (dict(temperature=-1.0), ValueError, "temperature"),
        (dict(stop=["not one token"]), ValueError, "not in the vocabulary"),
    ],
)
def test_bad_arguments_get_one_clear_error(tiny_lm, kwargs, error, match):
    with pytest.raises(error, match=match):
        tiny_lm.generate("some prompt", **kwargs)


@pytest.mark.parametrize(("prompt", "error"), [("", ValueError), ([], TypeError), (3, TypeError)])
def test_bad_prompts(tiny_lm, prompt, error):
    with pytest.raises(error):
        tiny_lm.generate(prompt)
    with pytest.raises(error):
        tiny_lm.ppl(prompt)


def test_load_refuses_bad_dtype_and_missing_files(tmp_path):
    with pytest.raises(ValueError, match="floating dtype"):
        kvjax.load(dtype="int8")
    with pytest.raises(FileNotFoundError):
        kvjax.load(tmp_path / "missing.gguf")


def test_core_refuses_bad_token_shapes(tiny_lm):
    cache = kvjax.new_cache(
        tiny_lm.config, make_policy("full"), batch=1, max_len=4, dtype=np.float32
    )
    with pytest.raises(ValueError, match=r"tokens and valid must be \[B, T\]"):
        kvjax.model_step(
            tiny_lm.config,
            make_policy("full"),
            tiny_lm.params,
            cache,
            np.ones(3, np.int32),
            np.ones(3, bool),
        )


def test_lm_on_a_mesh_generates_the_unsharded_tokens(tiny_lm):
    # The same LM placed on a 2x2 (data x model) mesh of the fake CPU devices: same tokens as the
    # unsharded LM, params really split over `model`; perplexity of two texts (rows split over
    # `data`) within float32 summation order of the unsharded one.
    from kvjax.sharding import make_mesh

    mesh = make_mesh(data=2, model=2)
    sharded = kvjax.LM(
        config=tiny_lm.config, params=tiny_lm.params, tokenizer=tiny_lm.tokenizer, mesh=mesh
    )
    prompts = ["ab", "a longer prompt"]
    want = tiny_lm.generate(prompts, policy="h2o", budget=8, max_new_tokens=5)
    got = sharded.generate(prompts, policy="h2o", budget=8, max_new_tokens=5)
    assert got.tokens == want.tokens
    leaves = [x for x in jax.tree_util.tree_leaves(sharded.params) if x.ndim == 2]
    assert any(len({s.index for s in x.addressable_shards}) > 1 for x in leaves)
    texts = ["some text to score", "another, longer text to score here"]
    ref = tiny_lm.ppl(texts, policy="window", budget=8, segment=16)
    got = sharded.ppl(texts, policy="window", budget=8, segment=16)
    np.testing.assert_allclose(got.ppl, ref.ppl, rtol=1e-5)
    for g, r in zip(got.nll, ref.nll, strict=True):
        np.testing.assert_allclose(g, r, atol=1e-5)


def test_lm_with_scan_layers_generates_the_unrolled_tokens(tiny_lm):
    """`LM(scan_layers=True)` stacks its params once and generates as the unrolled LM; policies
    with per-layer budgets get one clear error."""
    scan = kvjax.LM(
        config=tiny_lm.config, params=tiny_lm.params, tokenizer=tiny_lm.tokenizer, scan_layers=True
    )
    assert not isinstance(scan.params.layers, tuple)  # stacked
    kw = dict(policy="window", budget=6, max_new_tokens=5)
    prompts = ["a prompt longer than the window", "short"]
    assert scan.generate(prompts, **kw).tokens == tiny_lm.generate(prompts, **kw).tokens
    with pytest.raises(ValueError, match="'confkv'.*per-layer budgets"):
        scan.generate("abcdefgh", policy=make_policy("confkv-l", 16, protected=2, int8=False))
