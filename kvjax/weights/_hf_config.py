"""Read a Hugging Face `config.json` into a `ModelConfig`."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

from kvjax.models._config import Arch, ModelConfig, RopeScaling

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


def _transformers_config(raw: dict[str, Any], source: pathlib.Path):
    """transformers' own parse of a llama-family config.json (no torch needed): it fills
    defaults and standardizes RoPE settings (legacy `rope_scaling` / `rope_theta` and the
    newer `rope_parameters` alike) and validates them."""
    # transformers announces at import that torch is absent; kvjax needs only its configs.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers import AutoConfig

    fields = {k: v for k, v in raw.items() if k not in ("model_type", "transformers_version")}
    try:
        return AutoConfig.for_model(raw["model_type"], **fields)
    except Exception as e:  # noqa: BLE001 - transformers' validators raise their own types
        raise ValueError(f"{source}: transformers rejects this config: {e}") from None


def _rope(hf, source: pathlib.Path) -> tuple[float, RopeScaling | None]:
    """RoPE base and scaling from transformers' standardized `rope_parameters`."""
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    if any(isinstance(v, dict) for v in rope.values()):
        raise ValueError(f"{source}: per-layer-type RoPE parameters are not supported")
    theta = float(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in ("llama3", "linear"):
        raise ValueError(
            f"{source}: RoPE scaling type {kind!r} is not supported (default, linear, llama3)"
        )
    args: dict[str, Any] = {"kind": kind, "factor": float(rope["factor"])}
    if kind == "llama3":
        args |= {
            "low_freq_factor": float(rope["low_freq_factor"]),
            "high_freq_factor": float(rope["high_freq_factor"]),
            "original_max_positions": int(rope["original_max_position_embeddings"]),
        }
    return theta, RopeScaling(**args)


def _sliding_window(hf, source: pathlib.Path) -> int | None:
    """The attention window of every layer, None for full attention; mixed layers are refused."""
    window = getattr(hf, "sliding_window", None)
    if getattr(hf, "use_sliding_window", True) is False or window is None:
        return None
    kinds = set(getattr(hf, "layer_types", None) or ["sliding_attention"])
    if kinds == {"full_attention"}:
        return None
    if kinds != {"sliding_attention"}:
        raise ValueError(
            f"{source}: layers mixing sliding-window and full attention are not supported"
        )
    return int(window)


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
    hf = _transformers_config(raw, source)
    theta, scaling = _rope(hf, source)
    return ModelConfig(
        arch=Arch.LLAMA,
        vocab_size=int(_require(raw, "vocab_size", source)),
        hidden_size=hidden,
        num_layers=int(_require(raw, "num_hidden_layers", source)),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden // num_heads),
        intermediate_size=int(_require(raw, "intermediate_size", source)),
        rope_theta=theta,
        rope_scaling=scaling,
        sliding_window=_sliding_window(hf, source),
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
