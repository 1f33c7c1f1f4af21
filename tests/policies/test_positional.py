"""Full, window and streaming against brute-force kept sets on random chunk schedules."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvjax.attention import AttnStats
from kvjax.cache import CacheSpec, init_cache
from kvjax.policies import POLICIES, FullPolicy, StreamingPolicy, WindowPolicy, make_policy


def expected_kept(policy, n: int) -> set[int]:
    """The obvious answer: which positions stay cached after n tokens. A budget counts the
    tokens the next step attends, its own token included, so the cache keeps budget - 1."""
    if isinstance(policy, FullPolicy):
        return set(range(n))
    if isinstance(policy, WindowPolicy):
        return set(range(max(0, n - (policy.budget - 1)), n))
    sinks, ring = policy.sinks, policy.budget - 1 - policy.sinks
    return set(range(min(sinks, n))) | set(range(max(sinks, n - ring), n))


def feed(policy, chunks: list[int], batch_valid_last: bool = True):
    """Write tokens through policy.write, chunk by chunk; K/V encode the position."""
    n_total = sum(chunks)
    h, d = 2, 3
    cap = policy.capacity(n_total)
    layer = init_cache(CacheSpec(batch=1, num_kv_heads=h, head_dim=d, capacities=(cap,))).layers[0]
    start = 0
    live = []
    for t in chunks:
        pos = jnp.arange(start, start + t, dtype=jnp.int32)[None]
        kv = jnp.broadcast_to(pos[:, :, None, None].astype(jnp.float32), (1, t, h, d))
        stats = AttnStats(
            slot_mass=jnp.zeros((1, h, cap)),
            new_mass=jnp.zeros((1, h, t)),
            lse=jnp.zeros((1, t, 4)),
        )
        layer = policy.write(
            layer, kv, -kv, pos, jnp.ones((1, t), bool), stats, None, layer_index=0
        )
        start += t
        live.append(int(layer.live_slots().max()))
    return layer, live


policies = st.one_of(
    st.just(FullPolicy()),
    st.integers(1, 12).map(lambda b: WindowPolicy(budget=b)),
    st.tuples(st.integers(0, 4), st.integers(1, 10)).map(
        lambda sr: StreamingPolicy(budget=sr[0] + sr[1], sinks=sr[0])
    ),
)


@given(policy=policies, chunks=st.lists(st.integers(1, 9), min_size=1, max_size=6))
def test_kept_set_equals_brute_force(policy, chunks):
    layer, live = feed(policy, chunks)
    n = sum(chunks)
    want = expected_kept(policy, n)
    for h in range(layer.pos.shape[1]):
        pos = np.asarray(layer.pos[0, h])
        kept = pos[pos >= 0]
        assert len(kept) == len(set(kept.tolist())), "positions must be unique"
        assert set(kept.tolist()) == want
        # Data integrity: each slot holds the K/V of the token at its recorded position.
        for slot in np.nonzero(pos >= 0)[0]:
            assert np.all(np.asarray(layer.k[0, h, slot]) == pos[slot])
            assert np.all(np.asarray(layer.v[0, h, slot]) == -pos[slot])
    assert max(live) <= policy.capacity(n)
    if not isinstance(policy, FullPolicy):
        assert max(live) <= policy.budget - 1  # + the current token = the budget


def test_registry_knows_the_foundation_policies():
    assert {"full", "window", "streaming"} <= set(POLICIES)


@pytest.mark.parametrize(
    "name,budget,kwargs,match",
    [
        ("nope", 8, {}, "unknown policy 'nope'"),
        ("window", None, {}, "needs a budget"),
        ("full", 8, {}, "takes no budget"),
        ("window", 0, {}, "budget must be >= 1"),
        ("streaming", 4, {}, r"budget \(4\) must be larger than sinks \(4\)"),
        ("streaming", 6, {"sinks": -1}, "sinks must be >= 0"),
    ],
)
def test_bad_policy_arguments_are_named(name, budget, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_policy(name, budget, **kwargs)


def test_policies_are_frozen_and_hashable():
    p = make_policy("streaming", 16, sinks=2)
    assert hash(p) == hash(make_policy("streaming", 16, sinks=2))
    with pytest.raises(AttributeError):
        p.budget = 3  # type: ignore[misc]
