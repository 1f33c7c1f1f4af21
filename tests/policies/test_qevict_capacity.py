"""QEvictPolicy honours the Policy contract: `capacity` is the full-precision tier its cache
spec allocates, whatever the head dim and dtype (the byte budget and a window's bytes scale
alike)."""

import jax.numpy as jnp
from hypothesis import assume, given
from hypothesis import strategies as st

from kvjax.policies import QEvictPolicy


@given(
    budget=st.integers(8, 600),
    window=st.sampled_from([2, 4, 8, 16]),
    sinks=st.integers(0, 8),
    band=st.one_of(st.none(), st.sampled_from([0, 16, 32])),
    head_dim=st.sampled_from([8, 16, 64, 128]),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    layers=st.integers(1, 4),
    max_len=st.integers(0, 10_000),
)
def test_capacity_is_the_full_precision_tier_of_the_spec(
    budget, window, sinks, band, head_dim, dtype, layers, max_len
):
    try:
        policy = QEvictPolicy(budget=budget, window=window, sinks=sinks, band=band, bits=2)
        layout = policy.layout(head_dim, dtype)
    except ValueError:
        assume(False)
    spec = policy.cache_spec(
        batch=1,
        num_layers=layers,
        num_kv_heads=2,
        head_dim=head_dim,
        max_len=max_len,
        dtype=dtype,
    )
    assert policy.capacity(max_len) == layout.capacity
    assert spec.capacities == policy.capacities(layers, max_len) == (layout.capacity,) * layers
    assert policy.capacity(max_len) <= budget  # the full tier alone never exceeds the budget
