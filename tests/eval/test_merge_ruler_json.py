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
    assert lines[0] == "| policy | 1K 50% | 1K 75% |"
    assert lines[2] == "| full | 40 | 40 |"
    assert lines[3] == "| h2o | 20 | — |"
    assert lines[4] == "| knorm | — | 60 |"
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
