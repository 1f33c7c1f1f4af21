"""`kvjax stream` / run_stream at tiny sizes: per-chunk perplexity equals teacher-forced scoring
through the same policy, memory stays flat for bounded policies, full and kivi stop at their
limit."""

import dataclasses
import json
import math

import numpy as np
import pytest
from reliability.char_tokenizer import CharTokenizer

from kvjax.cli import main
from kvjax.eval import plot_stream, run_stream, stream_tokens
from kvjax.generate import score_tokens
from kvjax.policies import make_policy
from kvjax.weights import LoadedModel, essay_names, essay_text


@pytest.fixture(scope="module")
def tiny_model(tiny_llama):
    config, params = tiny_llama
    return LoadedModel(config=config, params=params, tokenizer=CharTokenizer(), source="tiny")


def test_stream_tokens_concatenates_and_loops(tiny_model):
    toks = stream_tokens(tiny_model, 50_000)  # every essay's first 300 characters, looped
    assert toks.shape == (50_000,) and toks.dtype == np.int32
    period = sum(len(CharTokenizer().encode(essay_text(n))) for n in essay_names())
    assert period < 50_000
    first = CharTokenizer().encode(essay_text(essay_names()[0]))
    np.testing.assert_array_equal(toks[: len(first)], first)
    np.testing.assert_array_equal(toks[:1000], toks[period : period + 1000])


@pytest.mark.parametrize(
    "name,budget", [("streaming", 12), ("window", 12), ("full", None), ("kivi", None)]
)
def test_chunk_ppl_equals_scoring_and_memory_stays_bounded(tiny_model, tmp_path, name, budget):
    tokens = np.random.default_rng(0).integers(0, 128, 97).astype(np.int32)
    policy = make_policy(name, budget)
    seen = []
    rows = run_stream(
        tiny_model,
        policy,
        tokens,
        budget=budget,
        chunk=32,
        segment=16,
        max_full=64,
        on_chunk=seen.append,
    )
    assert seen == [rows[: i + 1] for i in range(len(rows))]  # each chunk reported as it ends
    nll = np.asarray(score_tokens(tiny_model.config, tiny_model.params, tokens, policy=policy).nll)[
        0
    ]
    ends = [r.end for r in rows]
    assert ends == ([32, 64] if budget is None else [32, 64, 96])  # full, kivi: max_full
    for r in rows:
        assert math.isclose(r.ppl, math.exp(nll[r.start : r.end].mean()), rel_tol=1e-5)
    if budget is not None:  # live bytes: at most the budget's worth (2 layers, 2 KV heads)
        assert max(r.live_bytes_peak for r in rows) == 2 * 2 * budget * 2 * 16 * 4
    plot_stream(rows, str(tmp_path / "s.png"), title="t")
    assert (tmp_path / "s.png").stat().st_size > 1000


def test_stream_out_file_holds_the_rows_so_far(tiny_model, tmp_path):
    from kvjax.cli._stream import _write

    tokens = np.random.default_rng(1).integers(0, 128, 65).astype(np.int32)
    out = tmp_path / "s.json"
    saved = []

    def save(rows):
        _write(str(out), rows)
        saved.append(json.loads(out.read_text()))

    rows = run_stream(
        tiny_model,
        make_policy("window", 12),
        tokens,
        budget=12,
        chunk=16,
        segment=16,
        on_chunk=save,
    )
    assert [len(s) for s in saved] == [1, 2, 3, 4]
    # (as JSON text: the first chunk's ms_per_token is NaN, it only compiles)
    assert json.dumps(saved[-1]) == json.dumps([dataclasses.asdict(r) for r in rows])
    assert not (tmp_path / "s.json.tmp").exists()  # written whole, then renamed


@pytest.mark.parametrize(
    "argv",
    [
        ["stream", "--policy", "window", "--budget", "8", "--chunk", "100", "--segment", "64"],
        ["stream", "--policy", "nope", "--budget", "8"],
        ["stream", "--policy", "window"],
    ],
)
def test_stream_cli_bad_arguments_exit_2(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:")
