"""A plain forward over an empty cache, shared by the model tests."""

import jax.numpy as jnp
import numpy as np

from kvjax.cache import CacheSpec, init_cache, stack_cache
from kvjax.models import forward


def empty_forward(config, params, ids: np.ndarray, *, stacked: bool = False):
    """Plain forward with an empty (1-slot) cache: every token attends to its own prefix.
    `stacked`: the cache's layers stacked (the layer scan)."""
    b, s = ids.shape
    spec = CacheSpec(
        batch=b,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        capacities=(1,) * config.num_layers,
    )
    cache = init_cache(spec)
    return forward(
        config,
        params,
        jnp.asarray(ids),
        jnp.broadcast_to(jnp.arange(s), (b, s)),
        jnp.ones((b, s), bool),
        stack_cache(cache) if stacked else cache,
    )


def full_logits(config, params, ids: np.ndarray) -> np.ndarray:
    """[B, S, V] logits of `empty_forward` (each token sees its prefix)."""
    return np.asarray(empty_forward(config, params, ids).logits)
