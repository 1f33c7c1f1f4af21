"""`kvjax diagnostics` end to end on the tiny random Llama checkpoint (with a character-level
tokenizer written next to it), and its one-line errors for bad input."""

import json
import re
import shutil

import pytest

from kvjax.cli import main

TEXT = "It was the best of times, it was the worst of times, it was the age of wisdom. " * 2


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, goldens):
    """tests/goldens/llama_tiny plus a tokenizer.json: one id per printable ASCII character."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    d = tmp_path_factory.mktemp("llama_tiny")
    for f in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(goldens / "llama_tiny" / f, d / f)
    vocab = {"<unk>": 0, "\n": 3} | {chr(c): c - 28 for c in range(32, 127)}  # ids 4..98
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.save(str(d / "tokenizer.json"))
    (d / "text.txt").write_text(TEXT)
    return d


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_diagnostics_json_and_png(capsys, tiny_dir, tmp_path):
    # 48 tokens: 13 prefilled, then events every 4 decode steps at 16, 20, ..., 44.
    argv = ["diagnostics", "--model", str(tiny_dir), "--text", str(tiny_dir / "text.txt")]
    argv += ["--policy", "full", "window", "--budget", "8", "--tokens", "48"]
    argv += ["--prompt-tokens", "13", "--window", "4", "--horizon", "8"]
    argv += ["--lir-m", "2", "--lir-h", "2", "--json", "--out-dir", str(tmp_path)]
    code, out, _ = run(capsys, *argv)
    assert code == 0
    doc = json.loads(out)
    assert doc == json.loads((tmp_path / "diagnostics.json").read_text())
    assert (tmp_path / "diagnostics.png").stat().st_size > 10_000
    assert doc["settings"]["lir_k"] == 2  # budget 8 // window 4
    full, window = doc["results"]
    assert (full["policy"], window["policy"]) == ("full", "window")
    assert full["event_pos"] == list(range(16, 48, 4))
    assert full["fmm"] == 0 and full["churn"] == 0 and full["lost"] == 0
    assert 0 < window["fmm"] < 1 and 0 < window["churn"] <= 1
    # the last 2 events (40, 44) have no full 8-step horizon
    assert window["fmm_per_event"][-2:] == [None, None]
    # Global LIR depends only on the full model's attention: the same for both policies.
    assert full["candidates"] == window["candidates"]


def test_diagnostics_table(capsys, tiny_dir, tmp_path):
    argv = ["diagnostics", "--model", str(tiny_dir), "--text", str(tiny_dir / "text.txt")]
    argv += ["--policy", "h2o", "--budget", "8", "--tokens", "40", "--prompt-tokens", "8"]
    argv += ["--window", "4", "--horizon", "4", "--out-dir", str(tmp_path)]
    code, out, _ = run(capsys, *argv)
    assert code == 0
    for column in ("policy", "fmm", "churn", "fp_churn", "global_lir", "reactivations_lost"):
        assert column in out
    assert "diagnostics.png" in out


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--policy", "nope", "--budget", "64"], "unknown policy 'nope'"),
        (["--policy", "streaming", "--budget", "3"], r"budget \(3\) must be larger than sinks"),
        (["--policy", "h2o", "--budget", "64", "--horizon", "0"], "--horizon must be >= 1"),
        (["--policy", "full"], "give --budget"),
        (
            ["--policy", "h2o", "--budget", "64", "--tokens", "40", "--prompt-tokens", "16"],
            r"--tokens \(40\) must be >= prompt tokens \+ window \+ horizon \(56\)",
        ),
    ],
)
def test_bad_input_exits_2_before_loading(capsys, extra, match):
    code, _, err = run(capsys, "diagnostics", "--model", "/nonexistent", *extra)
    assert code == 2
    assert err.startswith("error: ") and re.search(match, err), err


def test_text_too_short_exits_2(capsys, tiny_dir, tmp_path):
    argv = ["diagnostics", "--model", str(tiny_dir), "--text", str(tiny_dir / "text.txt")]
    argv += ["--policy", "h2o", "--budget", "8", "--tokens", "5000", "--prompt-tokens", "8"]
    code, _, err = run(capsys, *argv, "--out-dir", str(tmp_path))
    assert code == 2
    assert re.search(r"has only 158 tokens; --tokens asks for 5000", err), err  # 1 per char
