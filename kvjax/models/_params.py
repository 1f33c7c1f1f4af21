"""Parameter pytrees. Layers are a tuple (one entry per layer) so the forward pass can index each
layer's cache buffer statically; see docs/decisions.md ("per-layer cache buffers")."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.cache import stack_trees
from kvjax.models._config import Arch, ModelConfig

Array = jax.Array


@struct.dataclass
class LlamaLayer:
    attn_norm: Array  # [E]
    wq: Array  # [E, Hq*D]
    wk: Array  # [E, Hkv*D]
    wv: Array  # [E, Hkv*D]
    wo: Array  # [Hq*D, E]
    bq: Array | None  # [Hq*D] (Qwen2) or None
    bk: Array | None  # [Hkv*D]
    bv: Array | None  # [Hkv*D]
    mlp_norm: Array  # [E]
    w_gate: Array  # [E, F]
    w_up: Array  # [E, F]
    w_down: Array  # [F, E]


@struct.dataclass
class LlamaParams:
    embed: Array  # [V, E]
    layers: tuple[LlamaLayer, ...]
    final_norm: Array  # [E]
    lm_head: Array | None  # [E, V], None when tied to embed


@struct.dataclass
class GPT2Layer:
    ln1_g: Array  # [E]
    ln1_b: Array  # [E]
    w_qkv: Array  # [E, 3*Hq*D]
    b_qkv: Array  # [3*Hq*D]
    wo: Array  # [Hq*D, E]
    bo: Array  # [E]
    ln2_g: Array  # [E]
    ln2_b: Array  # [E]
    w_fc: Array  # [E, F]
    b_fc: Array  # [F]
    w_proj: Array  # [F, E]
    b_proj: Array  # [E]


@struct.dataclass
class GPT2Params:
    wte: Array  # [V, E]
    wpe: Array  # [P, E]
    layers: tuple[GPT2Layer, ...]
    ln_f_g: Array  # [E]
    ln_f_b: Array  # [E]


Params = LlamaParams | GPT2Params


def init_params(config: ModelConfig, key: Array, dtype=jnp.float32) -> Params:
    """Random weights of the right shapes (std 0.02, norms near 1) for tests and benchmarks."""
    e, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    keys = iter(jax.random.split(key, 16 * config.num_layers + 8))

    def w(*shape, std=0.02):
        return (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    def norm(n):
        return (1.0 + w(n, std=0.1).astype(jnp.float32)).astype(dtype)

    if config.arch == Arch.GPT2:
        layers = tuple(
            GPT2Layer(
                ln1_g=norm(e),
                ln1_b=w(e),
                w_qkv=w(e, 3 * q),
                b_qkv=w(3 * q),
                wo=w(q, e),
                bo=w(e),
                ln2_g=norm(e),
                ln2_b=w(e),
                w_fc=w(e, f),
                b_fc=w(f),
                w_proj=w(f, e),
                b_proj=w(e),
            )
            for _ in range(config.num_layers)
        )
        return GPT2Params(
            wte=w(config.vocab_size, e),
            wpe=w(config.max_positions, e),
            layers=layers,
            ln_f_g=norm(e),
            ln_f_b=w(e),
        )
    bias = config.attn_bias
    layers = tuple(
        LlamaLayer(
            attn_norm=norm(e),
            wq=w(e, q),
            wk=w(e, kv),
            wv=w(e, kv),
            wo=w(q, e),
            bq=w(q) if bias else None,
            bk=w(kv) if bias else None,
            bv=w(kv) if bias else None,
            mlp_norm=norm(e),
            w_gate=w(e, f),
            w_up=w(e, f),
            w_down=w(f, e),
        )
        for _ in range(config.num_layers)
    )
    head = None if config.tie_embeddings else w(e, config.vocab_size)
    return LlamaParams(
        embed=w(config.vocab_size, e), layers=layers, final_norm=norm(e), lm_head=head
    )


def stack_params(params: Params) -> Params:
    """The parameters with their layers stacked along a leading [L] axis (one copy of the layer
    weights; do it once, outside the loop), the form a layer scan over a stacked cache reads.

    Raises:
        ValueError: the layers differ in shape.
    """
    if not isinstance(params.layers, tuple):
        return params
    return params.replace(layers=stack_trees(params.layers, "the model's layer parameters"))
