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
    """One Llama block's weights. Fused (`fuse_projections`): `wqkv` and `w_gate_up` hold the
    projections that share an input, each row scaled by its RMSNorm weight, and wq, wk, wv,
    w_gate, w_up, attn_norm and mlp_norm are None."""

    attn_norm: Array | None  # [E] (None: folded into wqkv)
    wq: Array | None  # [E, Hq*D]
    wk: Array | None  # [E, Hkv*D]
    wv: Array | None  # [E, Hkv*D]
    wo: Array  # [Hq*D, E]
    bq: Array | None  # [Hq*D] (Qwen2) or None
    bk: Array | None  # [Hkv*D]
    bv: Array | None  # [Hkv*D]
    mlp_norm: Array | None  # [E] (None: folded into w_gate_up)
    w_gate: Array | None  # [E, F]
    w_up: Array | None  # [E, F]
    w_down: Array  # [F, E]
    # [E, Hkv*(G+2)*D]: per KV head h, its G query heads' columns, then k_h's, then v_h's
    wqkv: Array | None = None
    w_gate_up: Array | None = None  # [E, 2F]: gate column f at 2f, up column f at 2f + 1


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


def stack_params(
    params: Params, config: ModelConfig | None = None, *, fuse: bool | None = None
) -> Params:
    """The parameters with their layers stacked along a leading [L] axis (one copy of the layer
    weights; do it once, outside the loop), the form a layer scan over a stacked cache reads.

    Args:
        params: per-layer or already stacked parameters (stacked ones come back as they are,
            unless fuse=True asks for a fusion they lack).
        config: the model's config, which fusing needs.
        fuse: also fuse each Llama layer's projections of one input (`fuse_projections`), in
            the same copy. Default: when stacking per-layer parameters of a Llama-family
            config on GPU, where one weight-streaming GEMM of a fused weight is faster than
            the separate ones (docs/decisions.md).

    Raises:
        ValueError: the layers differ in shape; fuse=True without a Llama-family config.
    """
    per_layer = isinstance(params.layers, tuple)
    if fuse is None:
        gpu = jax.default_backend() == "gpu"
        fuse = per_layer and config is not None and config.arch != Arch.GPT2 and gpu
    if fuse and (config is None or not isinstance(params, LlamaParams)):
        raise ValueError("stack_params(fuse=True) needs a Llama-family model and its config")
    if per_layer:
        if fuse:  # stacked and fused in one compiled copy: no stacked unfused copy in between
            layers = jax.jit(_stack_fused, static_argnums=1)(params.layers, config)
        else:
            layers = stack_trees(params.layers, "the model's layer parameters")
        return params.replace(layers=layers)
    return params.replace(layers=fuse_projections(params.layers, config)) if fuse else params


def _stack_fused(layers: tuple[LlamaLayer, ...], config: ModelConfig) -> LlamaLayer:
    return fuse_projections(stack_trees(layers, "the model's layer parameters"), config)


def fuse_projections(layer: LlamaLayer, config: ModelConfig) -> LlamaLayer:
    """The layer (or a stack of layers, [L] leading) with its q, k, v weights as one `wqkv`
    and its gate and up weights as one `w_gate_up` (a copy of those weights; idempotent).

    A decode step multiplies a few rows by each weight, so its time is the weights' bytes read
    at the speed a GEMM of that shape reaches: one GEMM of the fused weight reads them faster
    than three (or two) small ones. The columns are grouped so that a split of the fused
    axis into equal parts (a model-parallel mesh) keeps each KV head's q, k and v together and
    each gate column beside its up column.

    Each fused weight's rows are also scaled by the RMSNorm weight of its input (attn_norm for
    wqkv, mlp_norm for w_gate_up; rounded once to the weights' dtype), which then become None:
    RMSNorm(x)·g @ W == (x / rms(x)) @ (diag(g) W). In a layer scan each stacked norm weight
    was a dynamic slice that the GPU copies on its own, one 1.7 µs launch a layer and step.
    """
    if layer.wqkv is not None:
        return layer
    hkv, d = config.num_kv_heads, config.head_dim
    g = config.num_heads // hkv
    lead = layer.wq.shape[:-1]  # [(L,) E]
    q = layer.wq.reshape(*lead, hkv, g, d)
    k = layer.wk.reshape(*lead, hkv, 1, d)
    v = layer.wv.reshape(*lead, hkv, 1, d)
    qkv = jnp.concatenate([q, k, v], axis=-2).reshape(*lead, hkv * (g + 2) * d)
    gate_up = jnp.stack([layer.w_gate, layer.w_up], axis=-1)
    gate_up = gate_up.reshape(*gate_up.shape[:-2], -1)
    qkv, gate_up = _scale_rows(qkv, layer.attn_norm), _scale_rows(gate_up, layer.mlp_norm)
    return layer.replace(
        wq=None, wk=None, wv=None, w_gate=None, w_up=None, wqkv=qkv, w_gate_up=gate_up,
        attn_norm=None, mlp_norm=None,
    )  # fmt: skip


def _scale_rows(w: Array, g: Array) -> Array:
    """w [(L,) E, N] with row e scaled by g [(L,) E] (in float32, back in w's dtype)."""
    return (w.astype(jnp.float32) * g.astype(jnp.float32)[..., :, None]).astype(w.dtype)
