"""Read a Hugging Face `config.json` into a `ModelConfig`."""

from __future__ import annotations

import json
import pathlib
from typing import Any

from kvjax.models._config import Arch, ModelConfig

LLAMA_MODEL_TYPES = ("llama", "mistral", "qwen2")
GPT2_MODEL_TYPES = ("gpt2",)
SUPPORTED_MODEL_TYPES = LLAMA_MODEL_TYPES + GPT2_MODEL_TYPES
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")


def read_json(path: pathlib.Path) -> dict[str, Any]:
    """Parse a JSON object from a file.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not valid JSON, or not a JSON object.
    """
    if not path.is_file():
        raise FileNotFoundError(f"{path.name} not found: {path}")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def _require(raw: dict[str, Any], key: str, source: pathlib.Path) -> Any:
    if raw.get(key) is None:
        raise ValueError(f"{source} has no {key!r} (needed for model_type {raw['model_type']!r})")
    return raw[key]


def _rope_theta(raw: dict[str, Any], source: pathlib.Path) -> float:
    # transformers >= 5 writes `rope_parameters`; older files have `rope_theta` + `rope_scaling`.
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(
            f"{source}: RoPE scaling type {rope_type!r} is not supported (only plain RoPE)"
        )
    return float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))


def _llama_config(raw: dict[str, Any], source: pathlib.Path, name: str) -> ModelConfig:
    model_type = raw["model_type"]
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported (silu)")
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ValueError(
            f"{source}: attention_bias/mlp_bias on output or MLP projections are not supported"
        )
    hidden = int(_require(raw, "hidden_size", source))
    num_heads = int(_require(raw, "num_attention_heads", source))
    return ModelConfig(
        arch=Arch.LLAMA,
        vocab_size=int(_require(raw, "vocab_size", source)),
        hidden_size=hidden,
        num_layers=int(_require(raw, "num_hidden_layers", source)),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden // num_heads),
        intermediate_size=int(_require(raw, "intermediate_size", source)),
        rope_theta=_rope_theta(raw, source),
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attn_bias=model_type == "qwen2",
        name=name,
    )


def _gpt2_config(raw: dict[str, Any], source: pathlib.Path, name: str) -> ModelConfig:
    act = raw.get("activation_function", "gelu_new")
    if act not in _TANH_GELUS:
        raise ValueError(f"{source}: activation_function {act!r} is not supported {_TANH_GELUS}")
    if raw.get("scale_attn_by_inverse_layer_idx") or raw.get("scale_attn_weights") is False:
        raise ValueError(f"{source}: non-standard GPT-2 attention scaling is not supported")
    hidden = int(raw.get("n_embd", 768))
    num_heads = int(raw.get("n_head", 12))
    return ModelConfig(
        arch=Arch.GPT2,
        vocab_size=int(raw.get("vocab_size", 50257)),
        hidden_size=hidden,
        num_layers=int(raw.get("n_layer", 12)),
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=hidden // num_heads,
        intermediate_size=int(raw.get("n_inner") or 4 * hidden),
        norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
        tie_embeddings=True,
        max_positions=int(raw.get("n_positions", 1024)),
        name=name,
    )


def read_hf_config(directory: pathlib.Path) -> tuple[ModelConfig, dict[str, Any]]:
    """`ModelConfig` and the raw dict from `directory/config.json`.

    Raises:
        FileNotFoundError: no config.json.
        ValueError: invalid JSON, missing or unsupported `model_type`, unsupported options.
    """
    source = directory / "config.json"
    raw = read_json(source)
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{source}: unsupported model_type {model_type!r}; supported: "
            f"{list(SUPPORTED_MODEL_TYPES)}"
        )
    build = _gpt2_config if model_type in GPT2_MODEL_TYPES else _llama_config
    try:
        return build(raw, source, directory.name), raw
    except (TypeError, ValueError, ArithmeticError, AttributeError) as e:  # wrong values
        if str(source) in str(e):
            raise
        raise ValueError(f"{source}: invalid value ({type(e).__name__}: {e})") from None
