"""Max |logit difference| of kvjax against the transformers golden of the tiny Llama-3.1 model
(tests/goldens/llama31_tiny), with its RoPE scaling and without: run from the repo root."""

import dataclasses

import jax.numpy as jnp
import numpy as np

from kvjax.cache import CacheSpec, init_cache
from kvjax.models import forward
from kvjax.weights import load_hf_dir


def logits(c, p, ids):
    b, s = ids.shape
    spec = CacheSpec(
        batch=b, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, capacities=(1,) * c.num_layers
    )
    return np.asarray(
        forward(
            c,
            p,
            jnp.asarray(ids),
            jnp.broadcast_to(jnp.arange(s), (b, s)),
            jnp.ones((b, s), bool),
            init_cache(spec),
        ).logits
    )


c, p, _ = load_hf_dir("tests/goldens/llama31_tiny")
g = np.load("tests/goldens/llama31_tiny/golden.npz")
print("llama3 scaling: max |dlogit| =", np.abs(logits(c, p, g["input_ids"]) - g["logits"]).max())
print(
    "plain RoPE:     max |dlogit| =",
    np.abs(
        logits(dataclasses.replace(c, rope_scaling=None), p, g["input_ids"]) - g["logits"]
    ).max(),
)
