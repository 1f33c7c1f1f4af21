"""Llama-3.1 RoPE scaling against transformers (tests/goldens/llama31_tiny, made by
tools/goldens/make_goldens.py) and against a float64 NumPy transcription of the formula;
sliding-window configs are honoured within the window and refused beyond it."""

import dataclasses
import json
import math
import shutil

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from model_forward import full_logits

from kvjax.generate import GenerateConfig, generate, score_tokens
from kvjax.models import RopeScaling
from kvjax.models._layers import rope_frequencies
from kvjax.policies import make_policy
from kvjax.weights import load_hf_dir


def test_llama31_tiny_matches_transformers(goldens):
    config, params, _ = load_hf_dir(goldens / "llama31_tiny")
    assert config.rope_scaling == RopeScaling(
        kind="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_positions=64,
    )
    g = np.load(goldens / "llama31_tiny" / "golden.npz")
    assert g["input_ids"].shape == (2, 96)
    logits = full_logits(config, params, g["input_ids"])
    assert np.abs(logits - g["logits"]).max() <= 1e-4
    # The golden tells the scaling apart: plain RoPE with the same weights is far off.
    plain = full_logits(dataclasses.replace(config, rope_scaling=None), params, g["input_ids"])
    assert np.abs(plain - g["logits"]).max() > 1e-2


def test_legacy_rope_scaling_key_reads_the_same(goldens, tmp_path):
    """Llama-3.1's own config.json spells it `rope_scaling` + `rope_theta` (transformers < 5)."""
    folder = shutil.copytree(goldens / "llama31_tiny", tmp_path / "llama31_tiny")
    raw = json.loads((folder / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope.pop("rope_theta")
    raw["rope_scaling"] = rope
    (folder / "config.json").write_text(json.dumps(raw))
    assert load_hf_dir(folder)[0] == load_hf_dir(goldens / "llama31_tiny")[0]


def llama3_reference(d, theta, factor, low, high, old):
    """The Llama-3.1 frequency rule, one frequency at a time, in float64."""
    out = []
    for i in range(0, d, 2):
        f = 1.0 / theta ** (i / d)
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(f)
        elif wavelen > old / low:
            out.append(f / factor)
        else:
            s = (old / wavelen - low) / (high - low)
            out.append((1 - s) * f / factor + s * f)
    return np.array(out)


@given(
    d=st.sampled_from([8, 16, 64, 128]),
    theta=st.sampled_from([1e4, 5e5]),
    factor=st.floats(1.0, 32.0),
    low=st.floats(0.5, 2.0),
    gap=st.floats(0.5, 4.0),
    old=st.integers(16, 8192),
)
def test_llama3_frequencies_match_the_formula(d, theta, factor, low, gap, old):
    scaling = RopeScaling(
        kind="llama3",
        factor=factor,
        low_freq_factor=low,
        high_freq_factor=low + gap,
        original_max_positions=old,
    )
    ref = llama3_reference(d, theta, factor, low, low + gap, old)
    np.testing.assert_allclose(np.asarray(rope_frequencies(d, theta, scaling)), ref, rtol=2e-5)


def test_linear_scaling_divides_every_frequency():
    plain = np.asarray(rope_frequencies(16, 1e4))
    scaled = np.asarray(rope_frequencies(16, 1e4, RopeScaling(kind="linear", factor=4.0)))
    np.testing.assert_allclose(scaled, plain / 4.0, rtol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(kind="yarn", factor=2.0), "kind"),
        (dict(kind="llama3", factor=0.5), "factor"),
        (dict(kind="llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0), "low_freq"),
        (dict(kind="llama3", factor=8.0, original_max_positions=0), "original_max_positions"),
    ],
)
def test_bad_scaling_is_refused(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RopeScaling(**kwargs)


def as_mistral(goldens, tmp_path, **changes):
    folder = shutil.copytree(goldens / "llama_tiny", tmp_path / "mistral")
    raw = json.loads((folder / "config.json").read_text()) | {"model_type": "mistral"} | changes
    (folder / "config.json").write_text(json.dumps(raw))
    return load_hf_dir(folder)


def test_sliding_window_exact_inside_refused_beyond(goldens, tmp_path):
    config, params, _ = as_mistral(goldens, tmp_path, sliding_window=20)
    assert config.sliding_window == 20
    g = np.load(goldens / "llama_tiny" / "golden.npz")
    # 8 + 12 = 20 tokens fit the window: the same greedy tokens as transformers' Llama.
    prompts = [list(map(int, row[:8])) for row in g["input_ids"]]
    gen = GenerateConfig(max_new_tokens=12, chunk_size=8)
    out = generate(config, params, prompts, policy=make_policy("full"), gen=gen)
    np.testing.assert_array_equal(np.asarray(out.tokens), g["greedy_ids"])
    with pytest.raises(ValueError, match="sliding attention window of 20"):
        generate(
            config,
            params,
            prompts,
            policy=make_policy("full"),
            gen=dataclasses.replace(gen, max_new_tokens=13),
        )
    with pytest.raises(ValueError, match="sliding attention window of 20"):
        score_tokens(config, params, np.zeros((1, 21), np.int32), policy=make_policy("full"))


def test_no_sliding_window_and_mixed_layers(goldens, tmp_path):
    assert as_mistral(goldens, tmp_path, sliding_window=None)[0].sliding_window is None
    folder = shutil.copytree(goldens / "qwen2_tiny", tmp_path / "q")
    raw = json.loads((folder / "config.json").read_text())
    raw |= {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}
    raw.pop("layer_types", None)  # transformers derives it: layer 0 full, layer 1 sliding
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="mixing sliding-window and full attention"):
        load_hf_dir(folder)
