"""scripts/plot_compare_json.py merges compare rows run as separate processes: every row of every
file in its table, in the shared row order, a PNG written; a file that is not compare output is
one clear error naming it."""

import dataclasses
import json
import runpy
import sys

import pytest

from kvjax.eval._compare import CompareRow

SCRIPT = "scripts/plot_compare_json.py"


def _row(label, window, budget, ppl):
    return CompareRow(
        label=label,
        window=window,
        budget=budget,
        target_bytes=1 << 20,
        peak_live_bytes=1 << 20,
        ppl=ppl,
        live_bytes_mean=5e5,
        live_bytes_peak=1 << 20,
        seconds=1.0,
    )


def _run(monkeypatch, args):
    monkeypatch.setattr(sys, "argv", [SCRIPT, *args])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(SCRIPT, run_name="__main__")
    return e.value.code


def _write(path, rows):
    path.write_text(json.dumps([dataclasses.asdict(r) for r in rows]))
    return str(path)


def test_rows_of_several_files_in_one_table_and_plot(tmp_path, monkeypatch, capsys):
    a = _write(tmp_path / "a.json", [_row("h2o", 512, 512, 15.9), _row("h2o", 256, 256, 16.6)])
    b = _write(tmp_path / "b.json", [_row("full", 512, None, 15.3)])
    png = tmp_path / "p.png"
    assert _run(monkeypatch, [str(png), a, b]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ")][1:]
    assert [ln.split(" | ")[:4] for ln in lines] == [
        ["| full", "—", "—", "15.300"],
        ["| h2o", "256", "256", "16.600"],
        ["| h2o", "512", "512", "15.900"],
    ]
    assert png.stat().st_size > 1000


UNKNOWN_ROW = json.dumps([dataclasses.asdict(_row("no-such-policy", 512, 512, 1.0))])


@pytest.mark.parametrize(
    "content", ["not json", json.dumps({"ppl": 1.0}), json.dumps([{"x": 1}]), UNKNOWN_ROW]
)
def test_a_file_that_is_not_compare_output_is_a_clear_error(tmp_path, monkeypatch, content):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    code = _run(monkeypatch, [str(tmp_path / "p.png"), str(bad)])
    assert "bad.json" in str(code) and str(code).startswith("error:")


def test_missing_arguments_give_the_usage(monkeypatch):
    assert "usage" in str(_run(monkeypatch, ["only.json"]))
