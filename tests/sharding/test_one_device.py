"""The sharded code path on a one-device mesh (`--mesh data=1,model=1`) is the unsharded step:
the same compiled loop body (no extra copy, transpose or custom call) and, fed its own outputs,
the same executable (on the H200 a second compilation in the timed call made the 1x1 mesh
4-14% slower: docs/lab/2026-12-01-mesh-one-gpu.md)."""

import collections

import jax
import jax.numpy as jnp
import pytest
from policy_cases import build
from sharding_cases import MESHES

from kvjax.eval._bench import _decode, cache_sized_shapes, hlo_copies, hlo_loop_launches
from kvjax.eval._bench_mesh import decode_layout, place, sharded_decode
from kvjax.generate import new_cache
from kvjax.models import Arch, ModelConfig, init_params
from kvjax.sharding import TENSOR_PARALLEL, Axis, Names, make_mesh

CONFIG = ModelConfig(
    arch=Arch.LLAMA, vocab_size=64, hidden_size=32, num_layers=1, num_heads=8, num_kv_heads=8,
    head_dim=16, intermediate_size=64, name="tiny-1-layer",
)  # fmt: skip
BATCH = 8
BUDGET = 100  # confkv-int8: a 95-slot INT8 tier, more than the 64 of a ring (cache_sized_shapes)


def _placed(policy, m):
    params = init_params(CONFIG, jax.random.key(0), dtype=jnp.bfloat16)
    cache = new_cache(CONFIG, policy, batch=BATCH, max_len=128, dtype=jnp.bfloat16)
    layout = decode_layout(CONFIG, cache, m, TENSOR_PARALLEL)
    p, c = place(layout, params, cache)
    rows = layout.sharding(Names((Axis.BATCH,)))
    return params, cache, layout, p, c, jax.device_put(jnp.zeros((BATCH,), jnp.int32), rows)


@pytest.mark.parametrize(("case", "impl"), [("confkv-int8", "xla"), ("full", "pallas")])
def test_one_device_mesh_step_compiles_to_the_unsharded_step(case, impl):
    """Op for op: the decode loop's launches (fusions, copies, custom calls, sorts, inner
    loops) and copies of cache-sized arrays are those of the unsharded step; the Pallas case
    runs its kernels under shard_map."""
    policy = build(case, BUDGET)
    params, cache, layout, p, c, tok = _placed(policy, make_mesh(data=1, model=1))
    big = cache_sized_shapes(cache, CONFIG.head_dim)
    assert big
    plain = _decode.lower(CONFIG, policy, 2, impl, params, cache, tok).compile().as_text()
    meshed = sharded_decode.lower(CONFIG, policy, 2, impl, layout, p, c, tok).compile().as_text()
    assert hlo_loop_launches(meshed) == hlo_loop_launches(plain)
    copies = lambda text: collections.Counter(hlo_copies(text, big))
    assert copies(meshed) == copies(plain)


@pytest.mark.parametrize("mesh_name", ["1x1", "1x8"])
def test_a_step_fed_its_own_outputs_compiles_once(mesh_name):
    """Outputs come back with the shardings the inputs were placed with (canonical specs: no
    size-1 mesh axis, no trailing None), so the second call reuses the first executable."""
    data, model = (1, 1) if mesh_name == "1x1" else MESHES[mesh_name]
    policy = build("confkv-int8", BUDGET)
    _, _, layout, p, c, tok = _placed(policy, make_mesh(data=data, model=model))
    shardings = lambda tree: [x.sharding for x in jax.tree.leaves(tree)]
    before = sharded_decode._cache_size()
    placed = shardings((c, tok))
    out = sharded_decode(CONFIG, policy, 1, "xla", layout, p, c, tok)
    assert shardings(out) == placed
    sharded_decode(CONFIG, policy, 1, "xla", layout, p, *out)
    assert sharded_decode._cache_size() == before + 1
