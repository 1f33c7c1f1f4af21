"""GGUF loading: the real model's config and shapes, llama.cpp's Q/K permutation, tiny GGUFs
converted from the golden HF checkpoints, and errors on bad files."""

from __future__ import annotations

import dataclasses
import pathlib
import shutil

import gguf
import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from kvjax.models._config import SMOLLM2_135M
from kvjax.weights import default_model_path, load_gguf, load_hf_dir
from kvjax.weights._common import unpermute_rope_rows


def llamacpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`: HF rows -> interleaved rope pairs."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


@pytest.mark.parametrize(("heads", "head_dim", "cols"), [(9, 64, 576), (3, 64, 576), (2, 8, 0)])
def test_unpermute_inverts_llamacpp_permute(heads, head_dim, cols):
    rng = np.random.default_rng(0)
    shape = (heads * head_dim, cols) if cols else (heads * head_dim,)  # weight or bias
    w = rng.standard_normal(shape).astype(np.float32)
    np.testing.assert_array_equal(unpermute_rope_rows(llamacpp_permute(w, heads), heads), w)
    np.testing.assert_array_equal(llamacpp_permute(unpermute_rope_rows(w, heads), heads), w)


def test_unpermute_on_one_head():
    # One head, D=4: HF rows are [x0, x1 | y0, y1] (halves); llama.cpp stores [x0, y0, x1, y1].
    stored = np.array([0.0, 2.0, 1.0, 3.0])
    np.testing.assert_array_equal(unpermute_rope_rows(stored, 1), [0.0, 1.0, 2.0, 3.0])


def write_gguf(
    path,
    arch: str,
    hf: dict[str, np.ndarray],
    config: dict,
    *,
    permute: bool,
    drop: str = "",
    quantize: tuple[str, ...] = (),
) -> None:
    """Write HF llama-layout weights as a GGUF the way llama.cpp's converter does."""
    writer = gguf.GGUFWriter(path, arch)
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    for key, value in {
        "block_count": config["num_hidden_layers"],
        "embedding_length": config["hidden_size"],
        "feed_forward_length": config["intermediate_size"],
        "attention.head_count": n_heads,
        "attention.head_count_kv": n_kv,
        "vocab_size": config["vocab_size"],
    }.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.rope.freq_base", 10000.0)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    renames = {
        "model.embed_tokens.weight": "token_embd.weight",
        "lm_head.weight": "output.weight",
        "model.norm.weight": "output_norm.weight",
    }
    parts = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for name, array in sorted(hf.items()):
        if name in renames:
            out = renames[name]
        else:
            _, _, i, *rest = name.split(".")
            module, leaf = ".".join(rest[:-1]), rest[-1]
            out = f"blk.{i}.{parts[module]}.{leaf}"
        if permute and ".attn_q." in out:
            array = llamacpp_permute(array, n_heads)
        if permute and ".attn_k." in out:
            array = llamacpp_permute(array, n_kv)
        if out == drop:
            continue
        if any(q in out for q in quantize):
            writer.add_tensor(
                out,
                gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0),
                raw_dtype=gguf.GGMLQuantizationType.Q8_0,
            )
        else:
            writer.add_tensor(out, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny(folder: pathlib.Path) -> tuple[dict[str, np.ndarray], dict]:
    import json

    return load_file(folder / "model.safetensors"), json.loads((folder / "config.json").read_text())


def assert_same_params(a, b, atol: float = 0.0):
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=atol)


@pytest.mark.parametrize(
    ("name", "arch", "permute"),
    [
        ("llama_tiny", "llama", True),
        ("llama_tiny", "mistral", True),
        ("qwen2_tiny", "qwen2", False),
    ],
)
def test_gguf_matches_hf_checkpoint(tmp_path, name, arch, permute, goldens):
    # Same weights through both loaders: proves the un-permute, transposes and tying agree.
    hf, config = tiny(goldens / name)
    write_gguf(tmp_path / "m.gguf", arch, hf, config, permute=permute)
    got_config, got, meta = load_gguf(tmp_path / "m.gguf")
    want_config, want, _ = load_hf_dir(goldens / name)
    assert dataclasses.replace(got_config, name="") == dataclasses.replace(want_config, name="")
    assert meta["general.architecture"] == arch and meta["tensor_types"] == {"F32": len(hf)}
    assert_same_params(got, want)


def test_quantized_tensors_dequantize(tmp_path, goldens):
    hf, config = tiny(goldens / "llama_tiny")
    write_gguf(
        tmp_path / "q.gguf",
        "llama",
        hf,
        config,
        permute=True,
        quantize=("ffn_gate", "ffn_up", "ffn_down", "attn_q"),
    )
    _, got, meta = load_gguf(tmp_path / "q.gguf")
    _, want, _ = load_hf_dir(goldens / "llama_tiny")
    assert meta["tensor_types"]["Q8_0"] == 8
    assert_same_params(got, want, atol=0.01)  # Q8_0: error <= block max / 254


@pytest.mark.slow
def test_real_model_config_and_shapes(smollm):
    config, params = smollm.config, smollm.params
    assert config == dataclasses.replace(SMOLLM2_135M, name=config.name)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        30,
        9,
        3,
        64,
    )
    assert config.rope_theta == 1e5 and config.tie_embeddings and config.vocab_size == 49152
    assert params.embed.shape == (49152, 576) and params.lm_head is None
    assert len(params.layers) == 30 and params.final_norm.shape == (576,)
    layer = params.layers[0]
    shapes = {k: v.shape for k, v in vars(layer).items() if v is not None}
    assert shapes == {
        "attn_norm": (576,),
        "wq": (576, 576),
        "wk": (576, 192),
        "wv": (576, 192),
        "wo": (576, 576),
        "mlp_norm": (576,),
        "w_gate": (576, 1536),
        "w_up": (576, 1536),
        "w_down": (1536, 576),
    }
    assert layer.bq is None and all(x.dtype == np.float32 for x in jax.tree.leaves(params))
    assert all(bool(np.isfinite(np.asarray(x)).all()) for x in jax.tree.leaves(params))


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf(tmp_path / "nope.gguf")


def test_random_bytes(tmp_path):
    path = tmp_path / "random.gguf"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ValueError, match="is not a valid GGUF file"):
        load_gguf(path)


def test_truncated_real_file(tmp_path):
    path = tmp_path / "truncated.gguf"
    with open(default_model_path(), "rb") as src, open(path, "wb") as dst:
        dst.write(src.read(1 << 20))
    with pytest.raises(ValueError, match="is not a valid GGUF file"):
        load_gguf(path)


def test_unsupported_architecture(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "g.gguf", "gpt2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'gpt2'.*supported: \['llama', 'mistral', 'qwen2'\]"):
        load_gguf(tmp_path / "g.gguf")


def test_missing_metadata_key(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "k.gguf", "llama")
    writer.add_uint32("llama.block_count", 2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="no metadata key 'llama.embedding_length'"):
        load_gguf(tmp_path / "k.gguf")


def test_rope_scaling_refused(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "r.gguf", "llama")
    for key in ("block_count", "embedding_length", "attention.head_count"):
        writer.add_uint32(f"llama.{key}", 4)
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="RoPE scaling"):
        load_gguf(tmp_path / "r.gguf")


def test_missing_tensor(tmp_path, goldens):
    hf, config = tiny(goldens / "llama_tiny")
    write_gguf(tmp_path / "m.gguf", "llama", hf, config, permute=True, drop="blk.1.ffn_up.weight")
    with pytest.raises(ValueError, match="'blk.1.ffn_up.weight' is missing"):
        load_gguf(tmp_path / "m.gguf")


def test_shape_mismatch(tmp_path, goldens):
    hf, config = tiny(goldens / "llama_tiny")
    write_gguf(tmp_path / "m.gguf", "llama", hf, dict(config, intermediate_size=96), permute=True)
    # The file's MLP is 128 wide; the header now claims 96.
    with pytest.raises(
        ValueError, match=r"'blk.0.ffn_gate.weight'.*\(128, 64\), expected \(96, 64\)"
    ):
        load_gguf(tmp_path / "m.gguf")


def test_directory_is_not_a_gguf(tmp_path, goldens):
    shutil.copy(goldens / "llama_tiny" / "config.json", tmp_path)
    with pytest.raises(ValueError, match="is not a valid GGUF file"):
        load_gguf(tmp_path)
