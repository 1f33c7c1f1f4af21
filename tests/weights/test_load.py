"""`load_model`: default embedded GGUF, HF directories, GGUF files, and a missing path."""

from __future__ import annotations

import dataclasses
import shutil

import jax.numpy as jnp
import pytest

import kvjax.weights
from kvjax.models._config import Arch
from kvjax.weights import LoadedModel, Tokenizer, default_model_path, load_model


def test_public_api():
    assert sorted(kvjax.weights.__all__) == sorted(
        [
            "load_model",
            "LoadedModel",
            "Tokenizer",
            "load_gguf",
            "load_hf_dir",
            "default_model_path",
            "essays_dir",
            "essay_text",
            "essay_names",
        ]
    )


@pytest.mark.slow
def test_default_is_embedded_smollm(smollm):
    assert isinstance(smollm, LoadedModel) and isinstance(smollm.tokenizer, Tokenizer)
    assert smollm.source == str(default_model_path())
    assert smollm.config.arch == Arch.LLAMA and smollm.tokenizer.vocab_size == 49152
    with pytest.raises(dataclasses.FrozenInstanceError):
        smollm.source = "x"  # type: ignore[misc]


def test_hf_directory(tmp_path, goldens):
    model = load_model(goldens / "gpt2_tiny", dtype=jnp.bfloat16)
    assert model.config.arch == Arch.GPT2 and model.tokenizer is None
    assert model.params.wte.dtype == jnp.bfloat16 and model.source == str(goldens / "gpt2_tiny")


def test_hf_directory_with_tokenizer(tmp_path, goldens):
    folder = shutil.copytree(goldens / "llama_tiny", tmp_path / "llama")
    (folder / "tokenizer.json").write_text(
        '{"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1}, '
        '"unk_token": "a"}, "pre_tokenizer": {"type": "Whitespace"}}'
    )
    model = load_model(folder)
    assert model.tokenizer is not None and model.tokenizer.encode("b a b") == [1, 0, 1]
    assert model.tokenizer.eos_ids == (2,)  # from config.json's eos_token_id


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="No model file or directory"):
        load_model(tmp_path / "missing")
