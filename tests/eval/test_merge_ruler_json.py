"""scripts/merge_ruler_json.py merges `kvjax ruler` outputs of separate (and cut) processes: a
cell is the mean over the named tasks only where every one finished, the full cache's 0% row is
its reference in every column, two files disagreeing on a cell stop the merge, and a file that is
not ruler output is one clear error naming it."""

import dataclasses
import json
import runpy
import sys

import pytest

from kvjax.eval._ruler import RulerRow

SCRIPT = "scripts/merge_ruler_json.py"
TASKS = "niah_single_1,niah_multikey_1"


def _row(policy, ratio, task, length, score):
    return RulerRow(
        policy=policy,
        ratio=ratio,
        task=task,
        length=length,
        score=score,
        samples=5,
        kept_tokens=length * (1 - ratio),
        seconds_compress=0.1,
        answers=["x"] * 5,
    )


def _write(path, rows):
    path.write_text(json.dumps({"model": "m", "rows": [dataclasses.asdict(r) for r in rows]}))
    return str(path)


def _run(monkeypatch, args):
    monkeypatch.setattr(sys, "argv", [SCRIPT, *args])
    try:
        runpy.run_path(SCRIPT, run_name="__main__")
    except SystemExit as e:
        return e.code
    return 0


def test_cells_average_finished_tasks_only(tmp_path, monkeypatch, capsys):
    a = _write(
        tmp_path / "a.json",
        [
            _row("full", 0.0, "niah_single_1", 1024, 60.0),
            _row("full", 0.0, "niah_multikey_1", 1024, 20.0),
            _row("h2o", 0.5, "niah_single_1", 1024, 40.0),
            _row("h2o", 0.5, "niah_multikey_1", 1024, 0.0),
            _row("h2o", 0.75, "niah_single_1", 1024, 20.0),  # its second task never finished
            _row("h2o", 0.5, "vt", 1024, 100.0),  # not one of TASKS: left out
        ],
    )
    b = _write(  # the same cell again (agrees) and one more ratio, from another process
        tmp_path / "b.json",
        [
            _row("h2o", 0.5, "niah_single_1", 1024, 40.0),
            _row("knorm", 0.75, "niah_single_1", 1024, 80.0),
            _row("knorm", 0.75, "niah_multikey_1", 1024, 40.0),
        ],
    )
    png = tmp_path / "board.png"
    assert _run(monkeypatch, [str(png), TASKS, a, b]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "| policy | 1K 50% | 1K 75% | mean |"
    assert lines[2] == "| full | 40 | 40 | 40 |"
    assert lines[3] == "| h2o | 20 | — | 20 |"
    assert lines[4] == "| knorm | — | 60 | 60 |"
    assert (tmp_path / "board_1024.png").stat().st_size > 0


def test_disagreeing_files_stop_the_merge(tmp_path, monkeypatch):
    a = _write(tmp_path / "a.json", [_row("h2o", 0.5, "niah_single_1", 1024, 40.0)])
    b = _write(tmp_path / "b.json", [_row("h2o", 0.5, "niah_single_1", 1024, 60.0)])
    code = _run(monkeypatch, [str(tmp_path / "x.png"), TASKS, a, b])
    assert "b.json" in code and "60.0" in code and "40.0" in code


@pytest.mark.parametrize("text", ["not json", "[1, 2]", '{"rows": [{"policy": "h2o"}]}'])
def test_a_file_that_is_not_ruler_output_is_named(tmp_path, monkeypatch, text):
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    code = _run(monkeypatch, [str(tmp_path / "x.png"), TASKS, str(bad)])
    assert isinstance(code, str) and code.startswith(f"error: {bad}")


def _niah(path, policy, protocol, scores, *, ratio=None, budget=None, live=8):
    """A `kvjax niah` result JSON: scores {length: [score per depth]}."""
    from kvjax.eval._niah import NiahCell, NiahResult

    cells = [
        NiahCell(
            length=length,
            depth=25.0 * i,
            needle_depth=25.0 * i,
            score=s,
            soft_score=s,
            answer=f"a{i}",
            answer_tokens=[1],
            prompt_tokens=length,
            live_kv_bytes=live,
            seconds=0.5,
        )
        for length, per_depth in scores.items()
        for i, s in enumerate(per_depth)
    ]
    result = NiahResult(
        model="m",
        policy=policy,
        budget=budget,
        protocol=protocol,
        lengths=list(scores),
        depths=[25.0 * i for i in range(len(next(iter(scores.values()))))],
        mean_score=0.0,
        mean_score_by_length={str(n): sum(v) / len(v) for n, v in scores.items()},
        needle="n",
        question="q",
        scoring="s",
        template={"user": "{context}"},
        buffer=8,
        max_new_tokens=4,
        cells=cells,
        ratio=ratio,
        budgets=None if ratio is None else {str(n): int(n * (1 - ratio)) for n in scores},
    )
    path.write_text(json.dumps(dataclasses.asdict(result)))
    return str(path)


def test_niah_results_merge_as_one_task_per_protocol(tmp_path, monkeypatch, capsys):
    """Each length of a niah result is a cell (its depths' mean × 100); a budgetless policy
    (full, kivi) is its one score in every column; the other protocol is another task."""
    agn = "query-agnostic"
    files = [
        _niah(tmp_path / "full.json", "full", agn, {1024: [1, 1, 0, 1], 2048: [1, 1, 1, 1]}),
        _niah(
            tmp_path / "kivi.json", "kivi", agn, {1024: [0, 1, 0, 0], 2048: [0, 0, 0, 0]}, live=2
        ),
        _niah(
            tmp_path / "h5.json",
            "h2o",
            agn,
            {1024: [1, 0, 0, 0], 2048: [1, 1, 0, 0]},
            ratio=0.5,
            live=4,
        ),
        _niah(tmp_path / "h7.json", "h2o", agn, {1024: [0, 0, 0, 0]}, ratio=0.75),
        _niah(tmp_path / "aw.json", "h2o", "query-aware", {1024: [1, 1, 1, 1]}, ratio=0.75),
    ]
    assert _run(monkeypatch, [str(tmp_path / "n.png"), f"niah/{agn}", *files]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "| policy | 1K 50% | 1K 75% | 2K 50% | mean |"
    assert lines[2] == "| full | 75 | 75 | 100 | 83.3 |"
    assert lines[3] == "| h2o | 25 | 0 | 50 | 25 |"
    assert lines[4] == "| kivi | 25 | 25 | 0 | 16.7 |"
    # equal bytes: each result's mean score and live bytes as a share of full's same cells (the
    # query-aware result is another task and is left out)
    assert lines[6:] == [
        "| policy | ratio | mean score | live KV, % of full |",
        "|---|---|---|---|",
        "| full | 0 | 87.5 | 100.0 |",
        "| h2o | 0.5 | 37.5 | 50.0 |",
        "| h2o | 0.75 | 0.0 | 100.0 |",
        "| kivi | 0 | 12.5 | 25.0 |",
    ]
    assert (tmp_path / "n_2048.png").stat().st_size > 0


def test_niah_result_of_a_budget_is_refused(tmp_path, monkeypatch):
    path = _niah(tmp_path / "b.json", "h2o", "query-agnostic", {1024: [1, 0]}, budget=256)
    code = _run(monkeypatch, [str(tmp_path / "x.png"), "niah/query-agnostic", path])
    assert isinstance(code, str) and code.startswith(f"error: {path}") and "--budget" in code


def test_a_broken_niah_result_is_named(tmp_path, monkeypatch):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"policy": "h2o", "protocol": "query-agnostic", "cells": [{}]}))
    code = _run(monkeypatch, [str(tmp_path / "x.png"), "niah/query-agnostic", str(bad)])
    assert isinstance(code, str) and code.startswith(f"error: {bad}: not a readable niah result")
