"""`kvjax demo`'s table fits 80 columns (its width when piped) without cutting a cell."""

import io

from rich.console import Console
from rich.table import Table

from kvjax.cli._demo import demo_table

ROWS = [
    {"prompt": p, "policy": pol, "budget": b, "prompt_tokens": n, "new_tokens": 40,
     "tokens_per_s": 5.123456, "live_kv_KiB": kib, "agree_with_full": a, "first_diff": d,
     "text": "x" * 70}
    for p, n in (("chat", 42), ("essay", 1536))
    for pol, b, kib, a, d in (("full", None, 70960.0, 1.0, -1), ("window", 256, 11520.0, 0.025, 0),
                              ("streaming", 256, 11520.0, 0.175, 7))
]  # fmt: skip


def test_the_demo_table_fits_80_columns_uncut():
    cells = demo_table(ROWS)
    table = Table(title="kvjax demo")
    for k in cells[0]:
        table.add_column(k)
    for r in cells:
        table.add_row(*r.values())
    out = io.StringIO()
    Console(file=out, width=80).print(table)
    text = out.getvalue()
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
    for r in cells:  # every cell whole, on one line
        assert all(v in text for v in r.values())
    assert cells[0]["budget"] == "-" and cells[0]["diff at"] == "-" and cells[5]["diff at"] == "7"
    assert cells[3]["live MiB"] == "69.30" and cells[3]["in/new"] == "1536/40"
