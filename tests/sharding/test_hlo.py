"""The compiled sharded decode step communicates no cache data: no all-gather (or other
collective) and no copy of a cache-sized array, global or per device; it does hold the
all-reduces of the Megatron split. (The collectives it holds are listed in docs/sharding.md.)"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from sharding_cases import CONFIG8, mesh

from kvjax.eval._bench import hlo_copies
from kvjax.eval._bench_mesh import collective_counts, decode_layout, place, sharded_decode
from kvjax.generate import new_cache
from kvjax.models import init_params
from kvjax.sharding import (
    CONTEXT_PARALLEL,
    TENSOR_PARALLEL,
    cache_shardings,
    collectives,
    large_collectives,
    make_mesh,
)


def _big_shapes(cache, layout) -> set[tuple[int, ...]]:
    """Global and per-device shapes of every tier's K/V code arrays (more than 8 slots or
    pages: the recent ring excluded, as in tests/policies/test_in_place.py)."""
    shardings = cache_shardings(cache, layout)
    big = set()
    for layer, sh in zip(cache.layers, shardings.layers, strict=True):
        tiers = [(layer, sh), (layer.int8, sh.int8), (layer.lowbit, sh.lowbit)]
        for tier, tier_sh in tiers:
            if tier is None or tier.k.shape[2] <= 8:
                continue
            for x, s in ((tier.k, tier_sh.k), (tier.v, tier_sh.v)):
                big |= {tuple(x.shape), tuple(s.shard_shape(x.shape))}
    return big


def _step_hlo(policy, m, rules=TENSOR_PARALLEL, batch=8):
    params = init_params(CONFIG8, jax.random.key(0))
    cache = new_cache(CONFIG8, policy, batch=batch, max_len=256, dtype=jnp.float32)
    layout = decode_layout(CONFIG8, cache, m, rules)
    p, c = place(layout, params, cache)
    tok = jnp.zeros((batch,), jnp.int32)
    text = sharded_decode.lower(CONFIG8, policy, 1, "xla", layout, p, c, tok).compile().as_text()
    return text, _big_shapes(cache, layout)


@pytest.mark.parametrize("case", ["confkv-int8", "qevict"])
def test_tensor_parallel_step_moves_no_cache_data(policy8, case):
    text, big = _step_hlo(policy8(case, 65), mesh("2x4"))
    assert big
    assert large_collectives(text, big) == []
    assert hlo_copies(text, big) == []
    assert collective_counts(text).get("all-reduce", 0) > 0  # attention / MLP outputs


@pytest.mark.parametrize("case", ["window", "streaming", "h2o"])
def test_context_parallel_step_communicates_no_cache_data(policy8, case):
    """Each device writes the tokens aimed at its own slots: nothing of the cache crosses
    devices. H2O's ring token that moves to the ranked region is read where its slot lives and
    merged by a psum of one row per head; only per-slot positions and scores travel."""
    text, big = _step_hlo(policy8(case, 65), make_mesh(model=2, seq=4), CONTEXT_PARALLEL, 1)
    assert big
    assert large_collectives(text, big) == []
    if case == "h2o":  # the moved token: [B, Hkv/2, 1, D] rows, not a slot shard
        assert ("all-reduce", "f32", (1, 4, 1, 16)) in collectives(text)


def test_the_check_sees_a_gathered_cache(policy8):
    """The same check on a step that replicates the cache's keys finds the all-gather."""
    cache = new_cache(CONFIG8, policy8("window", 65), batch=8, max_len=256, dtype=jnp.float32)
    layout = decode_layout(CONFIG8, cache, mesh("2x4"), TENSOR_PARALLEL)
    cache = jax.device_put(cache, cache_shardings(cache, layout))
    everywhere = NamedSharding(layout.mesh, PartitionSpec())
    gather = jax.jit(lambda k: jax.lax.with_sharding_constraint(k * 2, everywhere))
    text = gather.lower(cache.layers[0].k).compile().as_text()
    assert large_collectives(text, {tuple(cache.layers[0].k.shape)}) == [
        "all-gather f32[8, 8, 64, 16]"
    ]
