"""Context-parallel decode: batch 1, the cache's slot axis split over `seq` (and heads over
`model`); each device attends its slots, partials merge by log-sum-exp. Positional policies and
a score-ranked one generate the unsharded tokens (the ranked choice is a global top-k: XLA
reduces the per-shard candidates, docs/decisions.md)."""

import numpy as np
import pytest
from sharding_cases import CONFIG8, PROMPTS

from kvjax.generate import GenerateConfig, generate
from kvjax.sharding import CONTEXT_PARALLEL, make_mesh

PROMPT = [PROMPTS[-1]]  # 30 tokens → max_len 40: every slot axis divides seq=4
# A budget of N attends N tokens, the current one included: N - 1 cached slots, so 17 gives
# bounded policies 16 slots, which divide seq=4.
CP_BUDGET = 17


def _run(model8, policy, implementation, mesh=None):
    config, params = model8
    gen = GenerateConfig(max_new_tokens=8, chunk_size=32, implementation=implementation)
    kw = {} if mesh is None else dict(mesh=mesh, rules=CONTEXT_PARALLEL)
    return generate(config, params, PROMPT, policy=policy, gen=gen, **kw)


@pytest.mark.parametrize("case", ["full", "window", "streaming", "h2o"])
def test_slot_sharded_decode_matches_unsharded(model8, policy8, case):
    policy = policy8(case, budget=CP_BUDGET)
    ref = _run(model8, policy, "xla")
    got = _run(model8, policy, "xla", make_mesh(model=2, seq=4))
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(
        np.asarray(got.telemetry.live_slots), np.asarray(ref.telemetry.live_slots)
    )
    np.testing.assert_allclose(
        np.asarray(got.telemetry.confidence), np.asarray(ref.telemetry.confidence), atol=1e-5
    )


def test_pallas_kernels_merge_slot_shards_by_log_sum_exp(model8, policy8):
    """The Pallas decode kernel and slot-write kernel per (head, slot) shard under shard_map;
    each device's partial (out, lse) merges with the others' before the new token joins."""
    policy = policy8("h2o", budget=CP_BUDGET, write_kernel="pallas")
    ref = _run(model8, policy, "xla")
    got = _run(model8, policy, "pallas", make_mesh(model=2, seq=4))
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
    np.testing.assert_allclose(
        np.asarray(got.telemetry.confidence), np.asarray(ref.telemetry.confidence), atol=1e-5
    )


def test_context_parallel_needs_slots_that_divide_seq(model8, policy8):
    with pytest.raises(ValueError, match=r"slot counts \[.*\] do not divide mesh axis 'seq'"):
        _run(model8, policy8("window", budget=18), "xla", make_mesh(model=1, seq=4))
    assert CONFIG8.num_kv_heads % 2 == 0
