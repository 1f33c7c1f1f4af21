"""SnapKV's prefill selection against a brute-force version: pooled observation votes."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax.attention import AttnStats
from kvjax.cache import CacheSpec, init_cache
from kvjax.policies import SnapKVPolicy


@settings(max_examples=5)
@given(seed=st.integers(0, 1000), t=st.integers(12, 30))
def test_one_chunk_prefill_keeps_window_plus_top_pooled_votes(seed, t):
    policy = SnapKVPolicy(budget=10, window=3, observation=4, pool=3)
    rng = np.random.default_rng(seed)
    h = 2
    votes = rng.random((h, t)).astype(np.float32)  # mass of the observation queries per token
    # A budget of 10 attended tokens: the next step's own + 9 cached (3 window + 6 voted).
    assert policy.capacity(0) == 9
    layer = init_cache(CacheSpec(batch=1, num_kv_heads=h, head_dim=2, capacities=(9,))).layers[0]
    stats = AttnStats(
        slot_mass=jnp.zeros((1, h, 9)), new_mass=jnp.asarray(votes)[None], lse=jnp.zeros((1, t, 2))
    )
    k = jnp.zeros((1, t, h, 2))
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    out = policy.merge(layer, k, k, pos, jnp.ones((1, t), bool), stats, None, 0)
    for head in range(h):
        pooled = np.array([votes[head, max(0, i - 1) : i + 2].max() for i in range(t)])
        older = np.arange(t - 3)  # the last 3 are the window
        top = older[np.argsort(-pooled[: t - 3], kind="stable")[:6]]
        want = set(top.tolist()) | {t - 3, t - 2, t - 1}
        got = np.asarray(out.pos[0, head])
        assert set(got[got >= 0].tolist()) == want


def test_observation_weights_only_the_last_queries():
    policy = SnapKVPolicy(budget=10, window=3, observation=4)
    pos = jnp.arange(8, dtype=jnp.int32)[None]
    valid = jnp.asarray([[True] * 6 + [False] * 2])
    w = np.asarray(policy.query_weight(pos, valid))
    np.testing.assert_array_equal(w, [[0, 0, 1, 1, 1, 1, 0, 0]])
