"""The `kvjax` command: real-model generation, JSON output, and one-line errors for bad input."""

import json

import pytest

from kvjax.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_chat_answers_paris(capsys):
    code, out, err = run(
        capsys,
        "generate",
        "--chat",
        "--prompt",
        "What is the capital of France? Answer in one sentence.",
        "--policy",
        "full",
        "--max-new-tokens",
        "30",
        "--json",
    )
    assert code == 0
    res = json.loads(out)
    assert "Paris" in res["text"]
    assert res["new_ids"] == [504, 3575, 282, 4649, 314, 7042, 30, 2]  # transformers golden
    assert res["text"] == "The capital of France is Paris."  # without <|im_end|> (id 2)
    assert "[kvjax] loading" in err and "[kvjax] generating" in err  # progress, also with --json
    assert res["live_kv_bytes"] > 0


def test_ppl_json_fields(capsys):
    code, out, _ = run(
        capsys, "ppl", "--policy", "window", "--budget", "16", "--tokens", "40", "--json"
    )
    assert code == 0
    res = json.loads(out)
    assert {"ppl", "tokens", "live_bytes_mean", "live_bytes_peak"} <= set(res)
    assert res["tokens"] == 40
    # 30 layers x 3 KV heads x 16 slots x (K+V) 64 dims x 4 bytes once the window is full.
    assert res["live_bytes_peak"] == 30 * 3 * 16 * 2 * 64 * 4
    assert 1 < res["ppl"] < 1000


@pytest.mark.parametrize(
    "argv,match",
    [
        (["ppl", "--policy", "nope", "--tokens", "8"], "unknown policy 'nope'"),
        (
            ["ppl", "--policy", "streaming", "--budget", "3", "--tokens", "8"],
            r"budget \(3\) must be larger than sinks \(4\)",
        ),
        (["ppl", "--policy", "window", "--tokens", "8"], "needs a budget"),
        (["generate", "--prompt", "hi", "--model", "/nonexistent/model.gguf"], "/nonexistent"),
        (["ppl", "--policy", "full", "--tokens", "1"], "--tokens must be >= 2"),
        (["ppl", "--policy", "full", "--tokens", "8", "--text", "missing.txt"], "missing.txt"),
        (
            ["ppl", "--policy", "confkv-l", "--budget", "512", "--scan-layers", "--tokens", "8"],
            r"--scan-layers: policy 'confkv'.*per-layer budgets",
        ),
        (  # adakv over a base press, spelled adakv-PRESS; a bad PRESS is named with the choices
            ["ruler", "--policy", "full", "adakv-nope", "--lengths", "512"],
            r"policy 'adakv-nope': 'nope' is not a press adakv wraps; choose one of \[.*'snapkv'",
        ),
        (
            ["ruler", "--policy", "adakv-confkv"],
            r"'confkv' is not a press adakv wraps; choose one of \['chunkkv'.*'tova'\]$",
        ),
        (["ruler", "--policy", "nope"], r"unknown policy 'nope'; .* or adakv-<press>"),
        (  # checked before any sample runs, not when the grid reaches them
            ["ruler", "--policy", "streaming", "confkv"],
            r"policy 'confkv' is tiered \(INT8/low-bit\).*bounded protocol",
        ),
        (["ruler", "--policy", "qevict"], r"policy 'qevict' is tiered"),
        (["ruler", "--policy", "kivi"], r"policy 'kivi' takes no budget"),
    ],
)
def test_bad_input_exits_2_with_one_clear_line(capsys, argv, match):
    import re

    code, _, err = run(capsys, *argv)
    assert code == 2
    # Progress lines ("[kvjax] loading ...") may come first; the error is one line.
    lines = [line for line in err.splitlines() if not line.startswith("[kvjax] ")]
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert re.search(match, lines[0])


def test_corrupt_model_file_is_reported(capsys, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(200)))
    code, _, err = run(capsys, "generate", "--prompt", "hi", "--model", str(bad))
    assert code == 2
    assert "bad.gguf" in err
