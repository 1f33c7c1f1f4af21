"""Load a llama-family GGUF file (llama.cpp's format) into `ModelConfig` + `LlamaParams`.

Every tensor is dequantized to float32 with `gguf.quants.dequantize`, then cast to the requested
dtype, so the model runs on the values llama.cpp would see, not on the quantized codes.
"""

from __future__ import annotations

import collections
import os
import pathlib
from typing import Any

import gguf
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike
from tqdm import tqdm

from kvjax.models._config import Arch, ModelConfig
from kvjax.models._params import LlamaLayer, LlamaParams
from kvjax.weights._common import check_shape, clean_float, to_jax, unpermute_rope_rows
from kvjax.weights._gguf_check import check_gguf_sizes

# GGUF architecture names we read as Arch.LLAMA. llama.cpp's converter permutes the Q/K rows of the
# families that use its "normal" (interleaved) RoPE; Qwen2 uses NEOX RoPE and keeps the HF order.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
_PERMUTED_QK = frozenset({"llama", "mistral"})
_BULKY_FIELDS = frozenset(
    {
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.scores",
    }
)
_MISSING = object()


def open_gguf(path: str | os.PathLike) -> gguf.GGUFReader:
    """Open (memory-map) a GGUF file, turning whatever `gguf` raises into a clear error.

    Raises:
        FileNotFoundError: no file at `path`.
        ValueError: the file is not a valid GGUF file (wrong magic, truncated, corrupt).
    """
    path = pathlib.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    if not path.is_file():
        raise ValueError(f"{path} is not a valid GGUF file: it is not a regular file")
    check_gguf_sizes(path)  # declared sizes against the file's, before the reader allocates
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # gguf raises ValueError, IndexError, struct.error, OSError, ...
        raise ValueError(f"{path} is not a valid GGUF file: {type(e).__name__}: {e}") from e


def gguf_field(reader: gguf.GGUFReader, key: str, default: Any = _MISSING) -> Any:
    """Value of a metadata key as plain Python (str, int, float, bool or list).

    Raises:
        ValueError: the key is absent and no default was given.
    """
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"GGUF file {reader.data.filename} has no metadata key {key!r}")
        return default
    return _contents(reader, key, field)


def _contents(reader: gguf.GGUFReader, key: str, field: Any) -> Any:
    """A field's value; a corrupt one (bad UTF-8, bad type tag) is one error naming the file."""
    try:
        return field.contents()
    except Exception as e:  # gguf decodes lazily: UnicodeDecodeError, IndexError, KeyError, ...
        raise ValueError(
            f"{reader.data.filename} is not a valid GGUF file: metadata key {key!r} is corrupt "
            f"({type(e).__name__}: {e})"
        ) from None


def _read_config(reader: gguf.GGUFReader, name: str) -> ModelConfig:
    arch = gguf_field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"Unsupported GGUF architecture {arch!r} in {reader.data.filename}; supported: "
            f"{list(SUPPORTED_ARCHITECTURES)}"
        )
    hidden = int(gguf_field(reader, f"{arch}.embedding_length"))
    num_heads = int(gguf_field(reader, f"{arch}.attention.head_count"))
    head_dim = int(gguf_field(reader, f"{arch}.attention.key_length", hidden // num_heads))
    rope_dims = int(gguf_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ValueError(
            f"{reader.data.filename}: partial rotary embeddings ({arch}.rope.dimension_count="
            f"{rope_dims}, head_dim={head_dim}) are not supported"
        )
    scaling = gguf_field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling != "none" or any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError(
            f"{reader.data.filename}: RoPE scaling ({scaling!r} or a rope_freqs tensor) is not "
            "supported (only plain RoPE)"
        )
    vocab = gguf_field(reader, f"{arch}.vocab_size", None)
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        embed = [t for t in reader.tensors if t.name == "token_embd.weight"]
        vocab = len(tokens.data) if tokens is not None else embed[0].shape[-1] if embed else 0
    has_bias = any(t.name == "blk.0.attn_q.bias" for t in reader.tensors)
    return ModelConfig(
        arch=Arch.LLAMA,
        vocab_size=int(vocab),
        hidden_size=hidden,
        num_layers=int(gguf_field(reader, f"{arch}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(gguf_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        intermediate_size=int(gguf_field(reader, f"{arch}.feed_forward_length")),
        rope_theta=clean_float(gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        norm_eps=clean_float(gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        tie_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        attn_bias=has_bias or arch == "qwen2",
        name=name,
    )


def _metadata(reader: gguf.GGUFReader, path: pathlib.Path) -> dict[str, Any]:
    meta: dict[str, Any] = {"format": "gguf", "path": str(path)}
    for key, field in reader.fields.items():
        if key in _BULKY_FIELDS or key.startswith("GGUF."):
            continue
        meta[key] = _contents(reader, key, field)
    meta["tensor_types"] = dict(collections.Counter(t.tensor_type.name for t in reader.tensors))
    return meta


def load_gguf_reader(
    reader: gguf.GGUFReader, *, dtype: DTypeLike = jnp.float32
) -> tuple[ModelConfig, LlamaParams, dict[str, Any]]:
    """`load_gguf` on an already opened reader (lets `load_model` share it with the tokenizer)."""
    path = pathlib.Path(reader.data.filename)
    try:
        config = _read_config(reader, name=path.stem)
    except (ValueError, TypeError, ArithmeticError) as e:  # metadata values ModelConfig refuses
        if str(path) in str(e):
            raise
        raise ValueError(f"GGUF file {path}: invalid model metadata ({e})") from None
    arch = gguf_field(reader, "general.architecture")
    tensors = {t.name: t for t in reader.tensors}
    e, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    permute = arch in _PERMUTED_QK
    progress = tqdm(
        total=config.num_layers + 2,
        desc="Dequantizing GGUF",
        unit="tensor",
        leave=False,
        disable=None,
    )

    def get(name: str, shape: tuple[int, ...], *, heads: int = 0, transpose: bool = False):
        """Dequantized tensor in numpy (out, in) order, checked, un-permuted, maybe transposed."""
        tensor = tensors.get(name)
        if tensor is None:
            raise ValueError(f"Tensor {name!r} is missing from GGUF file {path}")
        # ggml lists dims fastest-first; numpy wants them reversed.
        file_shape = tuple(int(d) for d in reversed(tensor.shape))
        try:
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            array = np.asarray(array, dtype=np.float32).reshape(file_shape)
        except Exception as e:
            raise ValueError(
                f"{path} is not a valid GGUF file: cannot dequantize {name!r} "
                f"({tensor.tensor_type.name}): {e}"
            ) from e
        check_shape(name, array, shape, f"GGUF file {path}")
        if heads and permute:
            array = unpermute_rope_rows(array, heads)
        return to_jax(array.T if transpose else array, dtype)

    def layer(i: int) -> LlamaLayer:
        b = f"blk.{i}."
        bias = config.attn_bias
        return LlamaLayer(
            attn_norm=get(b + "attn_norm.weight", (e,)),
            wq=get(b + "attn_q.weight", (q, e), heads=config.num_heads, transpose=True),
            wk=get(b + "attn_k.weight", (kv, e), heads=config.num_kv_heads, transpose=True),
            wv=get(b + "attn_v.weight", (kv, e), transpose=True),
            wo=get(b + "attn_output.weight", (e, q), transpose=True),
            bq=get(b + "attn_q.bias", (q,), heads=config.num_heads) if bias else None,
            bk=get(b + "attn_k.bias", (kv,), heads=config.num_kv_heads) if bias else None,
            bv=get(b + "attn_v.bias", (kv,)) if bias else None,
            mlp_norm=get(b + "ffn_norm.weight", (e,)),
            w_gate=get(b + "ffn_gate.weight", (f, e), transpose=True),
            w_up=get(b + "ffn_up.weight", (f, e), transpose=True),
            w_down=get(b + "ffn_down.weight", (e, f), transpose=True),
        )

    with progress:
        embed = get("token_embd.weight", (v, e))
        progress.update()
        layers = []
        for i in range(config.num_layers):
            layers.append(layer(i))
            progress.update()
        final_norm = get("output_norm.weight", (e,))
        lm_head = None if config.tie_embeddings else get("output.weight", (v, e), transpose=True)
        progress.update()
    params = LlamaParams(embed=embed, layers=tuple(layers), final_norm=final_norm, lm_head=lm_head)
    return config, params, _metadata(reader, path)


def load_gguf(
    path: str | os.PathLike, *, dtype: DTypeLike = jnp.float32
) -> tuple[ModelConfig, LlamaParams, dict[str, Any]]:
    """Load a llama-family GGUF file (llama, mistral, qwen2).

    Args:
        path: the `.gguf` file.
        dtype: dtype of the returned weights (dequantization itself runs in float32).

    Returns:
        `(config, params, metadata)`: `params.embed` is [V, E], `wq` [E, Hq*D], `wk`/`wv`
        [E, Hkv*D], `wo` [Hq*D, E], `lm_head` [E, V] or None when tied; `metadata` holds the
        file's scalar keys (chat template included), its `path` and a count of `tensor_types`.

    Raises:
        FileNotFoundError: no file at `path`.
        ValueError: not a valid GGUF file, unsupported architecture, missing metadata key,
            missing tensor, or a tensor whose shape disagrees with the config.
    """
    return load_gguf_reader(open_gguf(path), dtype=dtype)
