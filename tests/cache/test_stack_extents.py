"""`tier_extents`: one past the last occupied slot (page) of each tier, for one layer and for a
stack at once, against a brute-force loop over the positions."""

import jax.numpy as jnp
import numpy as np
import pytest
from policy_cases import build

from kvjax.cache import layer_at, tier_extents
from kvjax.generate import new_cache


def brute(pos: np.ndarray) -> np.ndarray:
    """[..., N] positions -> [...] one past the last index holding a position >= 0."""
    out = np.zeros(pos.shape[:-1], np.int32)
    for idx in np.ndindex(*pos.shape[:-1]):
        hits = np.nonzero(pos[idx] >= 0)[0]
        out[idx] = hits[-1] + 1 if hits.size else 0
    return out


def _randomized(arr, rng):
    """Positions with holes, empty rows and a full row: -1 or a position, at random."""
    pos = np.where(rng.random(arr.shape) < 0.4, rng.integers(0, 500, arr.shape), -1)
    pos.reshape(-1, arr.shape[-1])[0] = -1  # an empty row
    pos.reshape(-1, arr.shape[-1])[1] = 7  # a full one
    return jnp.asarray(pos, arr.dtype)


@pytest.mark.parametrize("name", ["h2o", "confkv-int8", "kivi", "qevict"])
def test_stack_extents_match_each_layer_and_brute_force(tiny_llama, name):
    config = tiny_llama[0]
    cache = new_cache(config, build(name, 24), batch=2, max_len=96, dtype=jnp.float32,
                      stacked=True)  # fmt: skip
    rng = np.random.default_rng(0)
    stack = cache.layers
    stack = stack.replace(pos=_randomized(stack.pos, rng))
    if stack.int8 is not None:
        stack = stack.replace(int8=stack.int8.replace(pos=_randomized(stack.int8.pos, rng)))
    if stack.lowbit is not None:
        lb = stack.lowbit
        stack = stack.replace(lowbit=lb.replace(pos=_randomized(lb.pos, rng)))
    got = tier_extents(stack)
    np.testing.assert_array_equal(np.asarray(got.full), brute(np.asarray(stack.pos)))
    assert (got.int8 is None) == (stack.int8 is None)
    if stack.int8 is not None:
        np.testing.assert_array_equal(np.asarray(got.int8), brute(np.asarray(stack.int8.pos)))
    assert (got.lowbit is None) == (stack.lowbit is None)
    if stack.lowbit is not None:  # pages: a page counts if any of its slots holds a token
        pages = np.asarray(stack.lowbit.pos).max(axis=-1)
        np.testing.assert_array_equal(np.asarray(got.lowbit), brute(pages))
    for i in range(stack.pos.shape[0]):  # the stack's row i is layer i's own
        one = tier_extents(layer_at(stack, jnp.int32(i)))
        np.testing.assert_array_equal(np.asarray(one.full), np.asarray(got.full[i]))
        np.testing.assert_array_equal(
            np.asarray(one.full), np.asarray(layer_at(stack, jnp.int32(i)).live_extent())
        )
