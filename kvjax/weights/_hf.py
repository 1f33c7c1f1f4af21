"""Load a Hugging Face checkpoint directory (config.json + safetensors) into kvjax params.

Supports Llama / Mistral / Qwen2 (-> `LlamaParams`) and GPT-2 (-> `GPT2Params`). Only safetensors
are read: `pytorch_model.bin` is a pickle and is refused.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike
from safetensors import SafetensorError, safe_open

from kvjax.models._config import Arch, ModelConfig
from kvjax.models._params import GPT2Layer, GPT2Params, LlamaLayer, LlamaParams, Params
from kvjax.weights._common import check_shape, to_jax
from kvjax.weights._hf_config import read_hf_config, read_json

_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"


class _SafetensorsDir:
    """Name -> file map over one or many safetensors files, read lazily with `safe_open`."""

    def __init__(self, directory: pathlib.Path):
        if (directory / _INDEX).is_file():
            weight_map = read_json(directory / _INDEX).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{directory / _INDEX} has no 'weight_map' object")
            self.files = {name: directory / file for name, file in weight_map.items()}
        elif (directory / _SINGLE).is_file():
            path = directory / _SINGLE
            self.files = dict.fromkeys(self._open(path).keys(), path)
        else:
            found = sorted(p.name for p in directory.iterdir())
            raise FileNotFoundError(
                f"No {_SINGLE} or {_INDEX} in {directory} (found {found}); only safetensors "
                "checkpoints are supported, never pickles."
            )
        self.directory = directory
        self._handles: dict[pathlib.Path, Any] = {}

    @staticmethod
    def _open(path: pathlib.Path) -> Any:
        if not path.is_file():
            raise FileNotFoundError(f"Safetensors shard not found: {path}")
        try:
            return safe_open(path, framework="np")
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"{path} is not a valid safetensors file: {e}") from e

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """Tensor `name` as numpy (bf16 comes back as ml_dtypes.bfloat16), shape-checked."""
        path = self.files.get(name)
        if path is None:
            shards = sorted({p.name for p in self.files.values()})
            raise ValueError(
                f"Tensor {name!r} is missing from the checkpoint in {self.directory} "
                f"(files {shards})"
            )
        if path not in self._handles:
            self._handles[path] = self._open(path)
        try:
            array = self._handles[path].get_tensor(name)
        except (SafetensorError, OSError, ValueError, TypeError) as e:
            raise ValueError(
                f"{path} is not a valid safetensors file: reading {name!r}: {e}"
            ) from e
        check_shape(name, array, shape, f"{path}")
        return array


def _prefix(tensors: _SafetensorsDir, candidates: tuple[str, ...], probe: str) -> str:
    for prefix in candidates:
        if prefix + probe in tensors:
            return prefix
    return candidates[0]  # let the first lookup raise the missing-tensor error


def _load_llama(config: ModelConfig, tensors: _SafetensorsDir, dtype: DTypeLike) -> LlamaParams:
    e, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    root = _prefix(tensors, ("model.", ""), "embed_tokens.weight")

    def get(name: str, shape: tuple[int, ...], transpose: bool = False):
        array = tensors.get(name, shape)
        return to_jax(array.T if transpose else array, dtype)

    def layer(i: int) -> LlamaLayer:
        b = f"{root}layers.{i}."
        bias = config.attn_bias
        return LlamaLayer(
            attn_norm=get(b + "input_layernorm.weight", (e,)),
            # torch Linear stores (out, in); we keep [in, out].
            wq=get(b + "self_attn.q_proj.weight", (q, e), transpose=True),
            wk=get(b + "self_attn.k_proj.weight", (kv, e), transpose=True),
            wv=get(b + "self_attn.v_proj.weight", (kv, e), transpose=True),
            wo=get(b + "self_attn.o_proj.weight", (e, q), transpose=True),
            bq=get(b + "self_attn.q_proj.bias", (q,)) if bias else None,
            bk=get(b + "self_attn.k_proj.bias", (kv,)) if bias else None,
            bv=get(b + "self_attn.v_proj.bias", (kv,)) if bias else None,
            mlp_norm=get(b + "post_attention_layernorm.weight", (e,)),
            w_gate=get(b + "mlp.gate_proj.weight", (f, e), transpose=True),
            w_up=get(b + "mlp.up_proj.weight", (f, e), transpose=True),
            w_down=get(b + "mlp.down_proj.weight", (e, f), transpose=True),
        )

    return LlamaParams(
        embed=get(root + "embed_tokens.weight", (v, e)),
        layers=tuple(layer(i) for i in range(config.num_layers)),
        final_norm=get(root + "norm.weight", (e,)),
        lm_head=None if config.tie_embeddings else get("lm_head.weight", (v, e), transpose=True),
    )


def _load_gpt2(config: ModelConfig, tensors: _SafetensorsDir, dtype: DTypeLike) -> GPT2Params:
    e, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    root = _prefix(tensors, ("transformer.", ""), "wte.weight")

    def get(name: str, shape: tuple[int, ...]):
        # GPT-2 uses Conv1D, whose weight is already [in, out]: no transpose.
        return to_jax(tensors.get(root + name, shape), dtype)

    def layer(i: int) -> GPT2Layer:
        b = f"h.{i}."
        return GPT2Layer(
            ln1_g=get(b + "ln_1.weight", (e,)),
            ln1_b=get(b + "ln_1.bias", (e,)),
            w_qkv=get(b + "attn.c_attn.weight", (e, 3 * e)),
            b_qkv=get(b + "attn.c_attn.bias", (3 * e,)),
            wo=get(b + "attn.c_proj.weight", (e, e)),
            bo=get(b + "attn.c_proj.bias", (e,)),
            ln2_g=get(b + "ln_2.weight", (e,)),
            ln2_b=get(b + "ln_2.bias", (e,)),
            w_fc=get(b + "mlp.c_fc.weight", (e, f)),
            b_fc=get(b + "mlp.c_fc.bias", (f,)),
            w_proj=get(b + "mlp.c_proj.weight", (f, e)),
            b_proj=get(b + "mlp.c_proj.bias", (e,)),
        )

    return GPT2Params(
        wte=get("wte.weight", (v, e)),
        wpe=get("wpe.weight", (config.max_positions, e)),
        layers=tuple(layer(i) for i in range(config.num_layers)),
        ln_f_g=get("ln_f.weight", (e,)),
        ln_f_b=get("ln_f.bias", (e,)),
    )


def load_hf_dir(
    path: str | os.PathLike, *, dtype: DTypeLike = jnp.float32
) -> tuple[ModelConfig, Params, dict[str, Any]]:
    """Load a Hugging Face model directory.

    Args:
        path: directory with `config.json` and `model.safetensors` (or a sharded
            `model.safetensors.index.json`). model_type llama, mistral, qwen2 or gpt2.
        dtype: dtype of the returned weights (bf16/f16/f32 files are all accepted).

    Returns:
        `(config, params, metadata)`. Llama family: `LlamaParams` with `wq` [E, Hq*D],
        `wk`/`wv` [E, Hkv*D], `wo` [Hq*D, E], MLP [E, F]/[F, E], `lm_head` [E, V] or None when
        tied. GPT-2: `GPT2Params` (`w_qkv` [E, 3E], `wpe` [P, E]). `metadata` holds `format`,
        `path` and the raw `config` dict.

    Raises:
        FileNotFoundError: no such directory, no config.json, or no safetensors file.
        ValueError: unsupported model_type/option, corrupt safetensors, missing tensor, or a
            tensor whose shape disagrees with config.json.
    """
    directory = pathlib.Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"Model directory not found: {directory}")
    config, raw = read_hf_config(directory)
    tensors = _SafetensorsDir(directory)
    load = _load_gpt2 if config.arch == Arch.GPT2 else _load_llama
    params = load(config, tensors, dtype)
    return config, params, {"format": "hf", "path": str(directory), "config": raw}
