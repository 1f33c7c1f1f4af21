"""A stacked cache (`new_cache(stacked=True)`) runs the layers in a `lax.scan`: every policy whose
layers share one shape must give the logits and the cache of the unrolled step, through chunked
prefill and decode; per-layer budgets are refused with one clear error. Through the Pallas
kernels the scanned step hands every decode kernel the stack itself (read in place)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params
from policy_cases import NAMES, build

import kvjax.generate._step as step_module
from kvjax.cache import is_stacked, stack_cache, unstack_cache
from kvjax.eval._kernel_ir import pallas_calls
from kvjax.generate import GenerateConfig, generate, model_step, new_cache, score_tokens
from kvjax.models import stack_params

CHUNK, PREFILL, DECODE = 8, 20, 5  # 20-token prompt in chunks of 8 (the last one padded)


@functools.partial(jax.jit, static_argnums=(0, 1, 5))
def _run(config, policy, params, cache, tokens, impl="auto"):
    """Chunked prefill of tokens[:, :PREFILL], then greedy decode; all logits and the cache.
    impl: the attention implementation of the decode steps."""
    b = tokens.shape[0]
    outs = []
    for s in range(0, PREFILL, CHUNK):
        chunk = tokens[:, s : s + CHUNK]
        valid = jnp.arange(chunk.shape[1])[None, :] < (PREFILL - s)
        logits, cache = model_step(config, policy, params, cache, chunk, valid.repeat(b, 0))
        outs.append(logits[:, -1])

    def body(carry, _):
        cache, tok = carry
        one = jnp.ones((b, 1), bool)
        logits, cache = model_step(config, policy, params, cache, tok, one, implementation=impl)
        return (cache, jnp.argmax(logits, axis=-1).astype(jnp.int32)), logits[:, 0]

    tok = tokens[:, PREFILL - 1 : PREFILL]
    (cache, _), dec = jax.lax.scan(body, (cache, tok), None, length=DECODE)
    return jnp.concatenate([jnp.stack(outs, 1), jnp.swapaxes(dec, 0, 1)], 1), cache


CASES = ["h2o", "confkv-int8", "qevict", "kvpop"]  # ranked, tiered INT8, low-bit routing, scorer
PALLAS = ["confkv-int8", "qevict", "kivi"]  # INT8 tier; token-major low-bit pages, with masses
# (the kernel's logits) and without


def _policy(case: str):
    """The case's policy; low-bit pages token-major (`LowBitTier`, every backend's layout).
    Budgets below the 25 tokens: every policy evicts (or quantizes); QEvict needs room for a
    window beside its sinks and band."""
    policy = build(case, 16 if case == "qevict" else 12)
    if hasattr(policy, "lowbit_layout"):
        policy = dataclasses.replace(policy, lowbit_layout="token")
    return policy


@pytest.mark.parametrize(
    "case, impl", [*((c, "auto") for c in CASES), *((c, "pallas") for c in PALLAS)]
)
def test_scanned_layers_equal_the_unrolled_step(tiny_llama, case, impl):
    # impl "pallas": decode attention by the Pallas kernels (interpreted here), which read the
    # full, INT8 and low-bit tiers of the scanned layer in the stack itself (`StackedLayer`);
    # the scanned step then also equals XLA attention's.
    config, params = tiny_llama
    policy = _policy(case)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, PREFILL + CHUNK)), jnp.int32)
    cache = new_cache(config, policy, batch=2, max_len=32, dtype=jnp.float32)
    want_logits, want_cache = _run(config, policy, params, cache, tokens, impl)
    stacked = new_cache(config, policy, batch=2, max_len=32, dtype=jnp.float32, stacked=True)
    assert is_stacked(stacked)
    got_logits, got_cache = _run(config, policy, stack_params(params), stacked, tokens, impl)
    assert is_stacked(got_cache)
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    got, want = jax.tree.leaves(unstack_cache(got_cache)), jax.tree.leaves(want_cache)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    if impl == "pallas":  # float32: the kernels and XLA differ in summation order only
        xla_logits, _ = _run(config, policy, stack_params(params), stacked, tokens, "xla")
        np.testing.assert_allclose(got_logits, xla_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", PALLAS)
def test_scanned_pallas_step_hands_every_decode_kernel_the_stack(tiny_llama, case):
    """Every decode kernel of the scanned step gets its tier's slot arrays as the whole stack
    [L·B, Hkv, ...] (`layer=`): no slice of the stack is made for a kernel's operand (XLA would
    copy it, every layer of every step). KIVI and QEvict: their token-major low-bit pages too."""
    config, params = tiny_llama
    policy = _policy(case)
    b = 2
    cache = new_cache(config, policy, batch=b, max_len=32, dtype=jnp.float32, stacked=True)
    tok, one = jnp.zeros((b, 1), jnp.int32), jnp.ones((b, 1), bool)
    step = lambda c: model_step(
        config, policy, stack_params(params), c, tok, one, implementation="pallas"
    )
    calls = pallas_calls(jax.make_jaxpr(step)(cache).jaxpr)
    codes = jnp.int8 if case == "confkv-int8" else jnp.uint8  # INT8 or packed low-bit codes
    assert any(e.invars[3].aval.dtype == codes for e in calls)  # (operand 3: the tier's k)
    lead = config.num_layers * b
    for e in calls:  # extent [B, Hkv], q_pos [B], q [B, Hkv, Gp, D]; then the tier's arrays
        assert [v.aval.shape[0] for v in e.invars[3:-1]] == [lead] * (len(e.invars) - 4), e
        assert e.invars[-1].aval.shape == ()  # the layer


def _primitives(jaxpr) -> set[str]:
    """Every primitive of a jaxpr and of the jaxprs nested in it."""
    out = set()
    for e in jaxpr.eqns:
        out.add(e.primitive.name)
        for sub in jaxprs_in_params(e.params):
            out |= _primitives(sub)
    return out


def test_layer_scan_turns_by_one_rope_table_per_step(tiny_llama):
    """RoPE's cos/sin table is computed once per step, outside the layer scan: every layer
    turns by the same angles, and XLA's GPU compiler leaves a table computed in the scan's
    body there (a kernel in every layer of every step)."""
    config, params = tiny_llama
    cache = new_cache(
        config, build("h2o", 12), batch=2, max_len=32, dtype=jnp.float32, stacked=True
    )
    tok, one = jnp.zeros((2, 1), jnp.int32), jnp.ones((2, 1), bool)
    step = lambda c: model_step(config, build("h2o", 12), stack_params(params), c, tok, one)
    jaxpr = jax.make_jaxpr(step)(cache).jaxpr
    # the layer scan: the scan whose length is the layer count
    scans = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    layer_scans = [e for e in scans if e.params["length"] == config.num_layers]
    assert len(layer_scans) == 1, [e.params["length"] for e in scans]
    body = _primitives(layer_scans[0].params["jaxpr"].jaxpr)
    assert "dot_general" in body  # (the layers' projections are in it)
    assert not body & {"sin", "cos"}, body & {"sin", "cos"}
    assert {"sin", "cos"} <= _primitives(jaxpr)  # computed once, outside


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


@pytest.mark.parametrize("case", ["h2o", "confkv-int8"])  # qevict: test_scanned_layers_equal...
def test_generate_with_scan_layers_gives_the_unrolled_tokens(tiny_llama, case, monkeypatch):
    """`GenerateConfig(scan_layers=True)`: the same greedy tokens and per-step live slots as the
    unrolled loop, through chunked prefill (prompts of two lengths) and decode."""
    config, params = tiny_llama
    policy = build(case, 12)
    scanned = []  # the scanned write is traced (the loop really runs the layer scan)
    write = step_module.write_stacked
    monkeypatch.setattr(
        step_module, "write_stacked", lambda *a, **kw: scanned.append(1) or write(*a, **kw)
    )
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 128, 21).tolist(), rng.integers(0, 128, 13).tolist()]
    kw = dict(max_new_tokens=6, chunk_size=8)
    want = generate(config, params, prompts, policy=policy, gen=GenerateConfig(**kw))
    gen = GenerateConfig(**kw, scan_layers=True)
    assert not scanned
    got = generate(config, stack_params(params), prompts, policy=policy, gen=gen)
    assert scanned
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.num_generated, want.num_generated)
    np.testing.assert_array_equal(got.telemetry.live_slots, want.telemetry.live_slots)
    np.testing.assert_array_equal(got.telemetry.slot_bytes, want.telemetry.slot_bytes)


def test_score_tokens_with_scan_layers_gives_the_unrolled_nll(tiny_llama):
    """Teacher-forced NLL (float32 logits) and live slots through the scanned step, KIVI's
    low-bit pages included; the per-layer params are stacked by `score_tokens` itself."""
    config, params = tiny_llama
    tokens = np.random.default_rng(2).integers(0, 128, (2, 30))
    kw = dict(policy=build("kivi", 0), chunk=1, segment=16, lengths=[30, 19])
    want = score_tokens(config, params, tokens, **kw)
    got = score_tokens(config, params, tokens, **kw, scan_layers=True)
    assert is_stacked(got.cache) and not is_stacked(want.cache)
    np.testing.assert_allclose(got.nll, want.nll, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got.live_slots, want.live_slots)


def test_scan_layers_with_per_layer_budgets_is_one_clear_error(tiny_llama):
    config, params = tiny_llama
    policy = build("confkv-l", 24)
    gen = GenerateConfig(max_new_tokens=2, scan_layers=True)
    with pytest.raises(ValueError, match=r"scan_layers=True.*'confkv'.*per-layer budgets"):
        generate(config, params, [[1, 2, 3]], policy=policy, gen=gen)
    with pytest.raises(ValueError, match=r"scan_layers=True.*'confkv'.*per-layer budgets"):
        score_tokens(config, params, np.arange(8), policy=policy, scan_layers=True)


def test_stacked_empty_cache_allocates_only_the_stack(tiny_llama):
    # Stacked eagerly, the per-layer buffers and the stack are live together (twice the cache:
    # 86 GB for a 34 GB cache at Llama-3-8B shapes); built in one computation, XLA writes the
    # stack directly and needs no per-layer buffer.
    from kvjax.generate._fit import fit_policy
    from kvjax.generate._step import _empty_stacked, cache_spec_for

    config, _ = tiny_llama
    policy = fit_policy(build("h2o", 12), config)
    spec = cache_spec_for(config, policy, batch=2, max_len=256, dtype=jnp.float32)
    compiled = _empty_stacked.lower(policy, spec).compile()
    stack_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(compiled.out_info))
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < stack_bytes / 4, (temp, stack_bytes)


# every policy with one budget for all layers (confkv-l and pyramidkv: per-layer budgets, refused)
STACKABLE = [n for n in NAMES if n not in ("confkv-l", "pyramidkv")]


@pytest.mark.parametrize("case", STACKABLE)
def test_stacked_write_equals_the_per_layer_write(case):
    """`write_stack` over two stacked layers equals `write_layers` layer by layer, through a
    prefill and decode writes; confkv's decode turns confident (tight budget) after a loose
    prefill, so its one cond for all layers evicts (the branch a vmapped `write` would run as a
    select)."""
    from kvjax.attention import AttnStats
    from kvjax.cache import stack_trees

    policy = build(case, 16)
    b, h, d, n_layers = 2, 2, 16, 2  # TINY_LLAMA's KV heads and head dim (the kvpop scorers')
    spec = policy.cache_spec(
        batch=b, num_layers=n_layers, num_kv_heads=h, head_dim=d, max_len=64, dtype=jnp.float32
    )
    layers = policy.empty_cache(spec).layers
    stacked = stack_trees(layers, "layers")
    rng = np.random.default_rng(0)
    loose = policy.init_state(b)
    tight = jnp.ones_like(loose) if case.startswith("confkv") else loose

    def inputs(t, layer):
        kv = lambda: jnp.asarray(rng.normal(size=(n_layers, b, t, h, d)), jnp.float32)
        mass = lambda *s: jnp.asarray(rng.random((n_layers, *s)), jnp.float32)
        lowbit = layer.lowbit
        stats = AttnStats(
            slot_mass=mass(b, h, layer.capacity),
            new_mass=mass(b, h, t),
            lse=mass(b, t, 2 * h),
            int8_mass=None if layer.int8 is None else mass(b, h, layer.int8.pos.shape[-1]),
            lowbit_mass=None if lowbit is None else mass(b, h, *lowbit.pos.shape[2:]),
        )
        return kv(), kv(), stats

    per_layer = lambda x, i: jax.tree.map(lambda a: a[i], x)
    ranked_live = lambda ly: np.asarray(
        jnp.sum((ly.int8.pos if ly.int8 is not None else ly.pos[..., policy.ring :]) >= 0, -1)
    )  # [B, H] (confkv: its INT8 tier, or the slots after its ring)
    live = []
    length = 0
    for t, state in [(24, loose), *[(1, tight)] * 6]:
        k, v, stats = inputs(t, layers[0])
        pos = jnp.broadcast_to(length + jnp.arange(t, dtype=jnp.int32), (b, t))
        valid = jnp.ones((b, t), bool)
        ks, vs, sts = ([per_layer(x, i) for i in range(n_layers)] for x in (k, v, stats))
        layers = policy.write_layers(layers, ks, vs, pos, valid, sts, state)
        stacked = policy.write_stack(stacked, k, v, pos, valid, stats, state)
        length += t
        if case.startswith("confkv"):
            live.append(ranked_live(layers[0]))
    want = jax.tree.leaves(stack_trees(layers, "layers"))
    got = jax.tree.leaves(stacked)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)
    if case.startswith("confkv"):  # the loose prefill held more than the tight budget allows
        allowed = np.asarray(policy.ranked_budget(tight, 0, b))[:, None]
        assert (live[0] > allowed).all() and (live[-1] <= allowed).all(), (live, allowed)


def test_kernel_layout_pages_scanned_equal_unrolled(tiny_llama):
    """KIVI's pages in the Mosaic GPU kernel's layout (bfloat16, D 128, 64-token pages): the
    scanned step, whose kernel reads each layer's pages in the stack itself (`layer=`), gives
    the unrolled step's logits and cache (kernels interpreted here)."""
    import dataclasses

    from kvjax.cache import KernelLowBitTier
    from kvjax.models import init_params
    from kvjax.policies import make_policy

    config = dataclasses.replace(tiny_llama[0], head_dim=128)
    params = init_params(config, jax.random.key(3), dtype=jnp.bfloat16)
    policy = make_policy("kivi", residual=64, group=64, value_group=64, lowbit_layout="kernel")
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 128, (2, 140)), jnp.int32)

    @functools.partial(jax.jit, static_argnums=(0,))
    def run(stacked, params):
        cache = new_cache(config, policy, batch=2, max_len=160, dtype=jnp.bfloat16, stacked=stacked)
        for s in range(0, 136, 68):  # 136 prompt tokens: two 64-token pages flushed
            ones = jnp.ones((2, 68), bool)
            _, cache = model_step(config, policy, params, cache, tokens[:, s : s + 68], ones)
        outs = []
        for t in range(136, 140):
            logits, cache = model_step(
                config, policy, params, cache, tokens[:, t : t + 1], jnp.ones((2, 1), bool),
                implementation="pallas",
            )  # fmt: skip
            outs.append(logits[:, 0])
        return jnp.stack(outs, 1).astype(jnp.float32), cache

    want_logits, want_cache = run(False, params)
    got_logits, got_cache = run(True, stack_params(params))
    assert isinstance(want_cache.layers[0].lowbit, KernelLowBitTier)
    assert int(np.sum(np.asarray(want_cache.layers[0].lowbit.held))) > 0  # pages attended
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), atol=2e-2)
    # bfloat16 keys from two compilations differ by an ulp here and there, so a code on a
    # rounding boundary (or a page whose min/max moved) may differ: nearly every code agrees,
    # positions and pages held exactly, the rest within bfloat16 rounding.
    got, want = jax.tree.leaves(unstack_cache(got_cache)), jax.tree.leaves(want_cache)
    for g, w in zip(got, want, strict=True):
        codes = w.dtype == jnp.int4
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        if codes:
            assert np.mean(g != w) < 0.01
        else:
            np.testing.assert_allclose(g, w, atol=5e-2, rtol=2e-2)
