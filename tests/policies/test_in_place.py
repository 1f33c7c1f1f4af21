"""A decode write must update the cache in place: the compiled policy-only decode loop holds no
copy of a cache-sized array. (On the H200 a lax.cond that carried confkv's INT8 tier made XLA
copy it every step: ~9 ms/step at Llama-3-8B shapes. XLA's CPU compiler inserts the same
copies, so the check runs here; the GPU check is `scripts/find_cache_copies.py`.)"""

import re

import jax
import jax.numpy as jnp
import pytest
from policy_cases import build

from kvjax.cache import stack_cache
from kvjax.eval._bench import _decode, _policy_only, cache_sized_shapes, hlo_copies
from kvjax.generate import new_cache
from kvjax.models import Arch, ModelConfig, init_params, stack_params
from kvjax.policies import H2OPolicy, StreamingPolicy


def cache_copies(
    policy, config, *, model: bool = False, stacked: bool = False, fuse: bool = False
) -> list[str]:
    """Copies of cache-sized arrays in the compiled loop of policy writes alone, or (model) of
    whole model decode steps; `stacked`: a layer scan over a stacked cache, where a copy of one
    layer's slice or of the whole stack counts; `fuse`: the stacked params' projections fused
    (`stack_params(fuse=True)`, the GPU's default)."""
    cache = new_cache(config, policy, batch=2, max_len=512, dtype=jnp.bfloat16)
    big = cache_sized_shapes(cache, config.head_dim)
    assert big, "the case has no cache-sized arrays to check"
    if stacked:
        big |= {(config.num_layers, *s) for s in big}
        cache = stack_cache(cache)
    if model:
        params = init_params(config, jax.random.key(0), dtype=jnp.bfloat16)
        params = stack_params(params, config, fuse=fuse) if stacked else params
        tok = jnp.zeros((2,), jnp.int32)
        lowered = _decode.lower(config, policy, 3, "xla", params, cache, tok)
    else:
        lowered = _policy_only.lower(policy, 3, cache, jax.random.key(0))
    return hlo_copies(lowered.compile().as_text(), big)


CONFIG = dict(
    arch=Arch.LLAMA, vocab_size=64, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
    head_dim=32, intermediate_size=64, name="tiny",
)  # fmt: skip


@pytest.mark.parametrize("case", ["h2o", "tova", "confkv-int8", "confkv", "qevict"])
def test_decode_write_copies_no_cache_sized_array(case):
    assert cache_copies(build(case, 200), ModelConfig(**CONFIG)) == []


@pytest.mark.parametrize("case", ["full", "h2o", "qevict"])
def test_model_decode_step_copies_no_cache_sized_array(case):
    # Attention reads the cache and the policy then writes into it, in one jitted step.
    policy = build(case, 200)
    assert cache_copies(policy, ModelConfig(**CONFIG), model=True) == []


@pytest.mark.parametrize("fuse", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("case", ["full", "qevict"])  # the plainest and the busiest write
def test_layer_scan_decode_step_copies_no_cache_sized_array(case, fuse):
    # Two layers in a lax.scan over the stacked cache, read by attention in the scan and written
    # by the policy over the whole stack (QEvict: one cond and one pair of move loops for both
    # layers); XLA must do all of it in place.
    config = ModelConfig(**{**CONFIG, "num_layers": 2})
    assert cache_copies(build(case, 200), config, model=True, stacked=True, fuse=fuse) == []


def test_cache_sized_shapes_are_the_big_kv_arrays_not_the_ring():
    config = ModelConfig(**CONFIG)
    cache = new_cache(config, build("confkv-int8", 200), batch=2, max_len=512, dtype=jnp.bfloat16)
    kv = [x for x in jax.tree.leaves(cache) if x.ndim == 4 and x.shape[3] == config.head_dim]
    small = {tuple(x.shape) for x in kv if x.shape[2] <= 64}
    big = cache_sized_shapes(cache, config.head_dim)
    assert big and small, (big, small)  # this case has both a ring and cache-sized tiers
    assert big == {tuple(x.shape) for x in kv} - small
    assert cache_sized_shapes(cache, config.head_dim, ring=10**6) == set()


@pytest.mark.parametrize("model", [False, True], ids=["write", "model-step"])
def test_kivi_decode_copies_no_residual(model):
    """KIVI's decode writes its token into the residual in place (a 128-slot residual counts as
    cache-sized here: the general path rebuilt it, 12 copies a step at 2 layers)."""
    from kvjax.policies import make_policy

    policy = make_policy("kivi", residual=128, group=32, bits=2, value_group=32)
    assert cache_copies(policy, ModelConfig(**CONFIG), model=model) == []


@pytest.mark.parametrize("stacked", [False, True], ids=["per-layer", "layer-scan"])
def test_ranked_decode_step_has_one_budget_cond_for_all_layers(stacked):
    """One budget shrink (a host sync on GPU) per decode step of a 3-layer confkv write, not one
    per layer, and it still copies no cache-sized array. Per layer: one lax.cond. Stacked: one
    loop of at most one trip that rewrites the stack's positions in place (a cond passing them
    through copied them every step), not a select that would run the eviction's sort on every
    step (a vmap of the per-layer write)."""
    from kvjax.eval._bench import hlo_loop_launches

    config = ModelConfig(**CONFIG | dict(num_layers=3))
    policy = build("confkv-int8", 200)
    cache = new_cache(config, policy, batch=2, max_len=512, dtype=jnp.bfloat16, stacked=stacked)
    text = _policy_only.lower(policy, 3, cache, jax.random.key(0)).compile().as_text()
    launches = hlo_loop_launches(text)
    assert hlo_copies(text, cache_sized_shapes(cache, config.head_dim)) == []
    # Its result: the ranked positions (each layer's, or the stack's) and the statistics of
    # all layers stacked in two arrays (a branch passing an array through copies it: 4
    # statistics per layer cost 4 device copies per layer on the H200).
    if not stacked:
        assert launches.get("conditional") == 1 and "while (dynamic)" not in launches
        [result] = re.findall(r"= \(([^=]*)\) conditional\(", text)
        shapes = re.findall(r"\w+\[[0-9,]*\]", result)
        assert len(shapes) == 3 + 2, shapes
    else:
        assert launches.get("while (dynamic)") == 1 and "conditional" not in launches
        loops = [re.findall(r"\w+\[[0-9,]*\]", x) for x in re.findall(r"= \((.*?)\) while\(", text)]
        [shapes] = [x for x in loops if x[0] == "pred[]"]  # its carry: the trip flag first
        assert shapes[1] == "s32[3,2,2,195]", shapes  # the positions [L, B, H, M]
    assert {"s32[3,3,2,2]", "f32[3,2,2]"} <= set(shapes), shapes  # [L, 3, B, H], [L, B, H]


@pytest.mark.parametrize("stacked", [False, True], ids=["per-layer", "layer-scan"])
def test_position_shift_decode_step_copies_no_cache_sized_array(stacked):
    # The sink slots' keys are rewritten after every write (StreamingLLM's cache positions):
    # a slice update of the donated buffer, never a new cache.
    config = ModelConfig(**{**CONFIG, "num_layers": 2})
    policy = StreamingPolicy(budget=200, position_shift=True)
    assert cache_copies(policy, config, model=True, stacked=stacked) == []


@pytest.mark.parametrize("stacked", [False, True], ids=["per-layer", "layer-scan"])
def test_ranked_position_shift_decode_step_copies_no_cache_sized_array(stacked):
    # Attention turns the keys it reads (positions within the cache); the cache itself is
    # still written in place, never copied.
    config = ModelConfig(**{**CONFIG, "num_layers": 2})
    policy = H2OPolicy(budget=200, position_shift=True)
    assert cache_copies(policy, config, model=True, stacked=stacked) == []


def test_layer_scan_qevict_many_heads_copies_no_cache_sized_array(monkeypatch):
    """QEvict's forms for many heads (a GPU's: the flat move list, the routing event reading
    moved windows' rows from each kind's arrays), forced at these few heads, in place too."""
    from kvjax.policies import _qevict_move

    monkeypatch.setattr(_qevict_move, "_FLAT_MIN_HEADS", 0)
    config = ModelConfig(**{**CONFIG, "num_layers": 2})
    assert cache_copies(build("qevict", 200), config, model=True, stacked=True, fuse=True) == []
