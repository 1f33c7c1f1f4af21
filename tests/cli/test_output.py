"""CLI output: tables fit the terminal (80 columns when not a terminal); JSON is exact."""

import json

from kvjax.cli._common import emit


def test_wide_table_fits_80_columns(capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    row = {f"a_rather_long_column_name_{i}": 1234.56789 * i for i in range(8)}
    emit([row, row], as_json=False, title="wide")
    out = capsys.readouterr().out
    assert out.strip() and max(len(line) for line in out.splitlines()) <= 80
    emit(row, as_json=True, title="wide")
    assert json.loads(capsys.readouterr().out) == row
