"""Hugging Face directories: the golden tiny llama / qwen2 / gpt2 checkpoints, dtypes, shards,
and errors on bad directories."""

from __future__ import annotations

import json
import pathlib
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from kvjax.models._config import Arch, ModelConfig
from kvjax.models._params import GPT2Params, LlamaParams
from kvjax.weights import load_hf_dir


def copy_tiny(folder: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    return shutil.copytree(folder, tmp_path / folder.name)


def test_llama_tiny(goldens):
    config, params, meta = load_hf_dir(goldens / "llama_tiny")
    assert config == ModelConfig(
        arch=Arch.LLAMA,
        vocab_size=128,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        rope_theta=10000.0,
        norm_eps=1e-5,
        tie_embeddings=False,
        attn_bias=False,
        name="llama_tiny",
    )
    assert isinstance(params, LlamaParams) and meta["config"]["model_type"] == "llama"
    raw = load_file(goldens / "llama_tiny" / "model.safetensors")
    layer = params.layers[1]
    assert (layer.wq.shape, layer.wk.shape, layer.wo.shape) == ((64, 64), (64, 32), (64, 64))
    assert (layer.w_gate.shape, layer.w_down.shape, params.lm_head.shape) == (
        (64, 128),
        (128, 64),
        (64, 128),
    )
    # torch Linear is (out, in); ours is [in, out].
    np.testing.assert_array_equal(layer.wk, raw["model.layers.1.self_attn.k_proj.weight"].T)
    np.testing.assert_array_equal(params.lm_head, raw["lm_head.weight"].T)
    np.testing.assert_array_equal(params.embed, raw["model.embed_tokens.weight"])


def test_qwen2_tiny_has_biases_and_tied_head(goldens):
    config, params, _ = load_hf_dir(goldens / "qwen2_tiny")
    assert config.attn_bias and config.tie_embeddings and config.num_kv_heads == 2
    assert params.lm_head is None
    raw = load_file(goldens / "qwen2_tiny" / "model.safetensors")
    layer = params.layers[0]
    assert (layer.bq.shape, layer.bk.shape, layer.bv.shape) == ((64,), (32,), (32,))
    np.testing.assert_array_equal(layer.bk, raw["model.layers.0.self_attn.k_proj.bias"])


def test_gpt2_tiny(goldens):
    config, params, _ = load_hf_dir(goldens / "gpt2_tiny")
    assert config == ModelConfig(
        arch=Arch.GPT2,
        vocab_size=128,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=4,
        head_dim=16,
        intermediate_size=256,
        norm_eps=1e-5,
        tie_embeddings=True,
        max_positions=64,
        name="gpt2_tiny",
    )
    assert isinstance(params, GPT2Params)
    raw = load_file(goldens / "gpt2_tiny" / "model.safetensors")
    layer = params.layers[1]
    assert (params.wte.shape, params.wpe.shape) == ((128, 64), (64, 64))
    assert (layer.w_qkv.shape, layer.w_fc.shape, layer.w_proj.shape) == (
        (64, 192),
        (64, 256),
        (256, 64),
    )
    # Conv1D weights are already [in, out]: no transpose.
    np.testing.assert_array_equal(layer.w_qkv, raw["transformer.h.1.attn.c_attn.weight"])


def test_gpt2_without_transformer_prefix(tmp_path, goldens):
    folder = copy_tiny(goldens / "gpt2_tiny", tmp_path)
    raw = load_file(folder / "model.safetensors")
    save_file(
        {k.removeprefix("transformer."): v for k, v in raw.items()}, folder / "model.safetensors"
    )
    _, params, _ = load_hf_dir(folder)
    np.testing.assert_array_equal(params.ln_f_b, raw["transformer.ln_f.bias"])


def test_bf16_file_and_dtype(tmp_path, goldens):
    folder = copy_tiny(goldens / "llama_tiny", tmp_path)
    raw = load_file(folder / "model.safetensors")
    save_file(
        {k: v.astype(ml_dtypes.bfloat16) for k, v in raw.items()}, folder / "model.safetensors"
    )
    _, params, _ = load_hf_dir(folder, dtype=jnp.bfloat16)
    assert params.embed.dtype == jnp.bfloat16
    want = raw["model.embed_tokens.weight"].astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(params.embed), want)


def test_sharded_checkpoint(tmp_path, goldens):
    folder = copy_tiny(goldens / "llama_tiny", tmp_path)
    raw = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(raw)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, keys in shards.items():
        save_file({k: raw[k] for k in keys}, folder / file)
    index = {"weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    _, params, _ = load_hf_dir(folder)
    np.testing.assert_array_equal(params.final_norm, raw["model.norm.weight"])


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_hf_dir(tmp_path / "nowhere")


def test_missing_config_json(tmp_path, goldens):
    folder = copy_tiny(goldens / "llama_tiny", tmp_path)
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_dir(folder)


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | changes))


def test_unknown_model_type(tmp_path, goldens):
    folder = copy_tiny(goldens / "llama_tiny", tmp_path)
    edit_config(folder, model_type="bert")
    with pytest.raises(ValueError, match=r"unsupported model_type 'bert'.*'llama'"):
        load_hf_dir(folder)


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        ({"rope_type": "yarn", "rope_theta": 5e5, "factor": 2.0}, "RoPE scaling type 'yarn'"),
        ({"rope_type": "llama3", "rope_theta": 5e5}, "transformers rejects.*factor"),
    ],
)
def test_unsupported_or_incomplete_rope_scaling_refused(tmp_path, goldens, rope, message):
    folder = copy_tiny(goldens / "llama_tiny", tmp_path)
    edit_config(folder, rope_parameters=rope)
    with pytest.raises(ValueError, match=message):
        load_hf_dir(folder)


def test_missing_tensor(tmp_path, goldens):
    folder = copy_tiny(goldens / "llama_tiny", tmp_path)
    raw = load_file(folder / "model.safetensors")
    del raw["model.layers.1.mlp.up_proj.weight"]
    save_file(raw, folder / "model.safetensors")
    with pytest.raises(ValueError, match="'model.layers.1.mlp.up_proj.weight' is missing"):
        load_hf_dir(folder)


def test_untied_head_missing(tmp_path, goldens):
    folder = copy_tiny(goldens / "qwen2_tiny", tmp_path)
    edit_config(folder, tie_word_embeddings=False)
    with pytest.raises(ValueError, match="'lm_head.weight' is missing"):
        load_hf_dir(folder)


def test_shape_mismatch(tmp_path, goldens):
    folder = copy_tiny(goldens / "gpt2_tiny", tmp_path)
    edit_config(folder, n_inner=96)
    with pytest.raises(ValueError, match=r"'transformer.h.0.mlp.c_fc.weight'.*\(64, 256\)"):
        load_hf_dir(folder)


@pytest.mark.parametrize("content", [b"\x01", b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}xxxxxx"])
def test_corrupt_safetensors(tmp_path, content, goldens):
    folder = copy_tiny(goldens / "llama_tiny", tmp_path)
    (folder / "model.safetensors").write_bytes(content)
    with pytest.raises(ValueError, match=r"model.safetensors is not a valid safetensors file"):
        load_hf_dir(folder)


def test_pickle_checkpoints_refused(tmp_path, goldens):
    folder = copy_tiny(goldens / "llama_tiny", tmp_path)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="only safetensors"):
        load_hf_dir(folder)
