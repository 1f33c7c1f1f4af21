"""The sharding tests' model, meshes and prompts: a tiny model whose every axis divides 8
devices (8 KV heads, 16 query heads, batch 8)."""

import jax
import numpy as np

from kvjax.models import Arch, ModelConfig
from kvjax.sharding import make_mesh

CONFIG8 = ModelConfig(
    arch=Arch.LLAMA, vocab_size=64, hidden_size=32, num_layers=2, num_heads=16, num_kv_heads=8,
    head_dim=16, intermediate_size=64, name="tiny-8-heads",
)  # fmt: skip
MESHES = {"1x8": (1, 8), "2x4": (2, 4), "4x2": (4, 2), "8x1": (8, 1)}  # data x model
# 8 prompts of 9..30 tokens: one 32-token prefill chunk, 8 new tokens -> max_len 40 (divides 8).
PROMPTS = [
    [int(t) for t in np.random.default_rng(i).integers(1, 64, size=9 + 3 * i)] for i in range(8)
]
BUDGET = 20  # confkv-l's smallest budget for its shared case is 19 (its deepest layer)


def mesh(name: str) -> jax.sharding.Mesh:
    data, model = MESHES[name]
    return make_mesh(data=data, model=model)
