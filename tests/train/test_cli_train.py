"""Essay split, token windows and `kvjax train-scorer` (one short real-model run)."""

import json

import pytest

from kvjax.cli import main
from kvjax.scorers import load_scorer
from kvjax.train import split_essays, token_windows
from kvjax.weights import essay_names


def test_split_is_by_file_deterministic_and_disjoint():
    a, b = split_essays(), split_essays()
    assert a == b
    assert not set(a.train) & set(a.held_out)
    assert sorted(a.train + a.held_out) == essay_names()
    assert "avg.txt" in a.held_out  # `kvjax ppl`'s default text is never trained on
    assert a.held_out == tuple(essay_names()[:8])  # the start of every NIAH haystack
    with pytest.raises(ValueError, match="held_out must be in"):
        split_essays(held_out=0)


class _WordTokenizer:
    def encode(self, text):
        return [len(w) % 50 for w in text.split()]


def test_token_windows():
    names = ["avg.txt", "pow.txt"]  # pow.txt is short
    out = token_windows(_WordTokenizer(), names, seq_len=100)
    assert out.shape[1] == 100 and out.dtype.name == "int32"
    assert len(token_windows(_WordTokenizer(), names, seq_len=100, limit=2)) == 2
    with pytest.raises(ValueError, match="seq_len must be >= 2"):
        token_windows(_WordTokenizer(), names, seq_len=1)
    with pytest.raises(ValueError, match="has 100000 tokens"):
        token_windows(_WordTokenizer(), names, seq_len=100000)


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--seq-len", "64", "--window", "32", "--k", "40"], "must be < --seq-len 64"),
        (["--scorer", "mlp", "--immediate"], "--immediate is an ablation"),
        (["--batch", "8", "--train-seqs", "4"], "--batch 8 exceeds --train-seqs 4"),
        (["--steps", "10", "--warmup", "10"], "warmup"),
        (["--eval-seqs", "0"], "--eval-seqs must be >= 1"),
    ],
)
def test_bad_flags_exit_2_before_loading(argv, match, capsys):
    assert main(["train-scorer", "--model", "/nonexistent.gguf", *argv]) == 2
    assert match in capsys.readouterr().err


@pytest.mark.slow
def test_train_scorer_end_to_end(tmp_path, capsys):
    out, log, png = tmp_path / "s.msgpack", tmp_path / "log.json", tmp_path / "loss.png"
    argv = ["train-scorer", "--seq-len", "48", "--window", "8", "--k", "12", "--train-seqs", "2"]
    argv += ["--eval-seqs", "1", "--steps", "2", "--batch", "1", "--warmup", "0", "--scorer"]
    argv += ["mlp", "--out", str(out), "--log", str(log), "--plot", str(png), "--json"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 2
    record = json.loads(log.read_text())
    acc = record["boundary_accuracy"]
    assert acc["decisions"] > 0 and 0 <= acc["scorer"] <= 1 and 0 <= acc["h2o"] <= 1
    assert not set(record["held_out_essays"]) & set(record["train_essays"])
    assert png.stat().st_size > 1000
    cfg, params, meta = load_scorer(out)
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) == (30, 3, 64)
    assert meta["accuracy"] == acc
    # --evaluate reports the same numbers for the written file (its stored float16 parameters).
    argv = ["train-scorer", "--seq-len", "48", "--window", "8", "--k", "12", "--eval-seqs", "1"]
    assert main([*argv, "--evaluate", str(out), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert {k: row[k] for k in acc} == acc
    # A rank decay that dwarfs every score ranks by position alone: the newest always stays,
    # which is exactly the recency baseline's decision.
    assert main([*argv, "--evaluate", str(out), "--rank-decay", "1e6", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["rank_decay"] == 1e6 and row["scorer"] == row["recency"] != acc["scorer"]
