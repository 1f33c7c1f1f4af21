"""One Pareto plot and one Markdown table from several `kvjax compare --json` outputs (rows run
as separate processes): `python scripts/plot_compare_json.py OUT.png COMPARE.json [...]`.
Rows without a budget (`full`, `kivi`) do not depend on the window: their window shows as —."""

from __future__ import annotations

import dataclasses
import json
import sys

from kvjax.eval._compare import ROWS, CompareRow, plot_pareto


def read(paths: list[str]) -> list[CompareRow]:
    fields = {f.name for f in dataclasses.fields(CompareRow)}
    rows: list[CompareRow] = []
    for path in paths:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"error: {path}: not a readable compare JSON ({e})") from None
        if not isinstance(data, list) or not all(
            isinstance(d, dict) and fields <= d.keys() for d in data
        ):
            raise SystemExit(
                f"error: {path}: expected a list of compare rows with {sorted(fields)}"
            )
        unknown = sorted({d["label"] for d in data} - ROWS.keys())
        if unknown:
            raise SystemExit(f"error: {path}: rows {unknown} are not compare rows ({list(ROWS)})")
        rows += [CompareRow(**{k: d[k] for k in fields}) for d in data]
    if not rows:
        raise SystemExit(f"error: no rows in {', '.join(paths)}")
    return rows


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].endswith(".png"):
        raise SystemExit("usage: plot_compare_json.py OUT.png COMPARE.json [COMPARE.json ...]")
    rows = read(argv[1:])
    rows.sort(key=lambda r: (list(ROWS).index(r.label), r.window))
    print("| policy | window matched | budget | ppl | mean live MiB | peak live MiB | s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        window = "—" if r.budget is None else str(r.window)
        budget = "—" if r.budget is None else str(r.budget)
        print(
            f"| {r.label} | {window} | {budget} | {r.ppl:.3f} | {r.live_bytes_mean / 2**20:.2f} "
            f"| {r.live_bytes_peak / 2**20:.2f} | {r.seconds:.0f} |"
        )
    plot_pareto(rows, argv[0], title="matched-memory perplexity (rows run one per process)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
