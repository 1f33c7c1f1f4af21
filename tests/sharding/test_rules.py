"""Sharding as data: every params / cache array is named, the rules resolve to the documented
layout (replication rule, errors), and placed caches split evenly over the devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from policy_cases import NAMES
from sharding_cases import CONFIG8, MESHES, mesh

from kvjax.generate import GenerateConfig, cache_spec_for, generate, new_cache
from kvjax.models import SMOLLM2_135M, TINY_GPT2, fuse_projections, init_params
from kvjax.sharding import (
    CONTEXT_PARALLEL,
    TENSOR_PARALLEL,
    Axis,
    Names,
    ShardingRules,
    bytes_per_device,
    cache_names,
    cache_shardings,
    make_mesh,
    param_names,
    param_shardings,
    resolve_layout,
)

is_names = lambda x: isinstance(x, Names)


def _layout(config, m, batch=8, rules=TENSOR_PARALLEL, slots=()):
    return resolve_layout(
        m, rules, batch=batch, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
        intermediate_size=config.intermediate_size, vocab_size=config.vocab_size,
        slot_counts=slots,
    )  # fmt: skip


@pytest.mark.parametrize("config", [CONFIG8, TINY_GPT2], ids=lambda c: c.name)
def test_every_param_is_named_with_its_rank(config):
    params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    names = param_names(params)
    pairs = jax.tree.leaves(jax.tree.map(lambda n, p: (n, p), names, params, is_leaf=is_names))
    assert len(pairs) == 2 * len(jax.tree.leaves(params))  # (Names, leaf) per array
    for n, p in zip(pairs[::2], pairs[1::2], strict=True):
        assert len(n.axes) == p.ndim


def test_megatron_split_of_a_llama_layer():
    layout = _layout(CONFIG8, mesh("2x4"))
    params = jax.eval_shape(lambda: init_params(CONFIG8, jax.random.key(0)))
    sh = param_shardings(params, layout)
    # Specs are canonical (trailing Nones dropped, as jit returns them): pad to the rank.
    spec = lambda s, ndim=2: tuple(s.spec) + (None,) * (ndim - len(s.spec))
    layer = sh.layers[0]
    assert spec(layer.wq) == spec(layer.wk) == (None, "model")  # column split (heads)
    assert spec(layer.wo) == ("model", None)  # row split: XLA all-reduces its output
    assert spec(layer.w_gate) == spec(layer.w_up) == (None, "model")
    assert spec(layer.w_down) == ("model", None)
    assert spec(sh.embed) == ("model", None) and spec(layer.attn_norm, 1) == (None,)


def test_fused_llama_params_are_named_and_split():
    """Fused layers (`fuse_projections`): q|k|v and gate|up weights, the norm weights folded
    into them (None, so nothing to name), still split by heads and MLP columns."""
    layout = _layout(CONFIG8, mesh("2x4"))

    def fused():
        p = init_params(CONFIG8, jax.random.key(0))
        return p.replace(layers=tuple(fuse_projections(lp, CONFIG8) for lp in p.layers))

    params = jax.eval_shape(fused)
    layer = param_shardings(params, layout).layers[0]
    assert params.layers[0].attn_norm is None and params.layers[0].mlp_norm is None
    spec = lambda s: tuple(s.spec) + (None,) * (2 - len(s.spec))
    assert spec(layer.wqkv) == spec(layer.w_gate_up) == (None, "model")
    assert spec(layer.w_down) == ("model", None)


def test_unknown_param_field_is_an_error():
    with pytest.raises(ValueError, match="no logical axis names for parameter"):
        param_names({"mystery": jnp.zeros(3)})


@pytest.mark.parametrize("case", NAMES)
def test_every_cache_array_is_named_and_tiers_follow_their_heads(policy8, case):
    policy = policy8(case)
    cache = jax.eval_shape(lambda: new_cache(CONFIG8, policy, batch=8, max_len=40, dtype="float32"))
    names = cache_names(cache)
    named = jax.tree.leaves(names, is_leaf=is_names)
    assert len(named) == len(jax.tree.leaves(cache))
    for layer, lnames in zip(cache.layers, names.layers, strict=True):
        tiers = [(layer, lnames)]
        tiers += [(layer.int8, lnames.int8)] if layer.int8 is not None else []
        tiers += [(layer.lowbit, lnames.lowbit)] if layer.lowbit is not None else []
        for _, tnames in tiers:
            for field in ("k", "v", "pos", "score"):
                assert getattr(tnames, field).axes[:3] == (Axis.BATCH, Axis.KV_HEADS, Axis.SLOTS)


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_cache_bytes_per_device_are_the_total_over_the_mesh(policy8, mesh_name):
    """Every tier array ([B, Hkv, ...]) splits 8 ways on every mesh, for every policy (per-device
    shapes from the shardings); counters [B] split over data only (replicated over model)."""
    layout = _layout(CONFIG8, mesh(mesh_name))
    for case in NAMES:
        policy = policy8(case)
        cache = jax.eval_shape(
            lambda p=policy: new_cache(CONFIG8, p, batch=8, max_len=40, dtype="float32")
        )
        shardings = cache_shardings(cache, layout)
        local = lambda x, s: int(np.prod(s.shard_shape(x.shape))) * x.dtype.itemsize
        per_device = jax.tree.map(local, cache, shardings)
        tiers = sum(jax.tree.leaves(per_device.layers))
        total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache.layers))
        assert tiers * 8 == total, case
        assert per_device.length * MESHES[mesh_name][0] == 8 * 4


def test_placed_cache_holds_its_share_on_every_device(policy8):
    """The real placement (QEvict: full, low-bit and ledger arrays) matches the shard shapes."""
    layout = _layout(CONFIG8, mesh("2x4"))
    cache = new_cache(CONFIG8, policy8("qevict"), batch=8, max_len=40, dtype=jnp.float32)
    placed = jax.device_put(cache, cache_shardings(cache, layout))
    total = sum(x.nbytes for x in jax.tree.leaves(cache.layers))
    assert set(bytes_per_device(placed.layers).values()) == {total // 8}
    assert len(bytes_per_device(placed.layers)) == 8


def test_kv_heads_that_do_not_divide_replicate_heads_not_mlp():
    """SmolLM2's 3 KV heads (9 query heads) on model=2: heads replicated, MLP and vocab split."""
    layout = _layout(SMOLLM2_135M, make_mesh(data=1, model=2), batch=1)
    assert layout.mesh_axis(Axis.KV_HEADS) is None and layout.mesh_axis(Axis.HEADS) is None
    assert layout.mesh_axis(Axis.MLP) == "model" and layout.mesh_axis(Axis.VOCAB) == "model"


def test_replicated_heads_generate_the_unsharded_tokens(tiny_llama):
    config, params = tiny_llama  # 2 KV heads on model=4: heads replicated
    gen = GenerateConfig(max_new_tokens=4, chunk_size=16)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    from policy_cases import build

    ref = generate(config, params, prompts, policy=build("h2o", 8), gen=gen)
    got = generate(
        config, params, prompts, policy=build("h2o", 8), gen=gen,
        mesh=make_mesh(data=2, model=4),
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))


def test_bad_layouts_get_one_clear_error():
    m = mesh("4x2")
    with pytest.raises(ValueError, match="batch 6 does not divide mesh axis 'data'"):
        _layout(CONFIG8, m, batch=6)
    with pytest.raises(ValueError, match=r"slot counts \[38\] do not divide mesh axis 'seq'"):
        seq = make_mesh(model=1, seq=4)
        _layout(CONFIG8, seq, batch=1, rules=CONTEXT_PARALLEL, slots=(38,))
    with pytest.raises(ValueError, match="name mesh axis 'seq'"):
        _layout(CONFIG8, m, rules=ShardingRules(slots="seq"))
    with pytest.raises(ValueError, match="must use different mesh axes"):
        ShardingRules(batch="model")
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh(data=4, model=4)


def test_generate_rejects_a_batch_the_data_axis_does_not_divide(tiny_llama):
    config, params = tiny_llama
    from policy_cases import build

    with pytest.raises(ValueError, match="batch 3 does not divide"):
        generate(
            config, params, [[1], [2], [3]], policy=build("full", 0),
            gen=GenerateConfig(max_new_tokens=2), mesh=make_mesh(data=2, model=1),
        )  # fmt: skip


def test_cache_spec_unchanged_by_sharding():
    # The sharded cache is the same pytree: its spec does not depend on the mesh.
    from policy_cases import build

    spec = cache_spec_for(CONFIG8, build("h2o", 16), batch=8, max_len=40, dtype=jnp.float32)
    assert spec.num_kv_heads == 8 and spec.batch == 8


def test_bench_mesh_flag_parses_and_rejects_bad_text():
    from kvjax.eval._bench_mesh import parse_mesh

    assert parse_mesh("data=1,model=1") == {"data": 1, "model": 1}
    assert parse_mesh("data=2, model=4") == {"data": 2, "model": 4}
    for bad in ("data", "data=0", "data=1,data=2", "model=x", ""):
        with pytest.raises(ValueError, match="--mesh must be name=size pairs"):
            parse_mesh(bad)


def test_without_a_layout_the_step_traces_as_before(model8, policy8):
    """mesh=None adds nothing to the traced step (no sharding constraint, no shard_map); under a
    layout the step pins the cache and runs the Pallas kernels under shard_map."""
    from kvjax.generate import model_step
    from kvjax.sharding import use_layout

    config, params = model8
    policy = policy8("window", 21)
    cache = new_cache(config, policy, batch=8, max_len=40, dtype=jnp.float32)
    tok, valid = jnp.zeros((8, 1), jnp.int32), jnp.ones((8, 1), bool)

    # A fresh function per trace: JAX keys its trace cache on the function, not on the layout
    # context (which is why `generate` passes the layout as a static argument).
    def step():
        return lambda p, c: model_step(config, policy, p, c, tok, valid, implementation="pallas")

    plain = str(jax.make_jaxpr(step())(params, cache))
    assert "sharding_constraint" not in plain and "shard_map" not in plain
    with use_layout(_layout(config, mesh("2x4"))):
        sharded = str(jax.make_jaxpr(step())(params, cache))
    assert "sharding_constraint" in sharded and "shard_map" in sharded
