"""One leaderboard from several `kvjax ruler` outputs (groups run as separate processes, runs cut
by a time limit): `python scripts/merge_ruler_json.py OUT.png TASKS RULER.json [...]`.

TASKS is a comma-separated list of the tasks averaged into each cell (e.g.
`niah_single_1,niah_multikey_1,niah_multivalue`). A cell is (policy, length, ratio); it shows the
mean score over TASKS only when every one of them finished there, else `—` (a cut run leaves
cells half done). A cell found in two files must agree, or the merge stops. Prints a Markdown
table (rows: policies; columns: length × ratio, then the mean of the row's cells) and writes a
score-vs-ratio plot per length (OUT_LENGTH.png).

`kvjax niah --ratios` results (`<policy>-r<ratio>_<protocol>.json`, and the full cache's
`full_<protocol>.json`) merge the same way: each length of one is a cell of task
`niah/<protocol>` scored as its depths' mean × 100 (e.g. TASKS `niah/query-agnostic`). With a
full-cache result among them, a second table gives each (policy, ratio) its mean score and its
mean live KV bytes as a share of the full cache's in the same cells (equal bytes, not equal
tokens, is what compares a tiered policy with the others)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import tempfile

import numpy as np

from kvjax.eval._niah_plot import read_niah_result
from kvjax.eval._ruler import RulerRow, write_ruler_outputs


def read(paths: list[str]) -> list[RulerRow]:
    fields = {f.name for f in dataclasses.fields(RulerRow)}
    found: dict[tuple, RulerRow] = {}
    for path in paths:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"error: {path}: not a readable ruler JSON ({e})") from None
        if isinstance(data, dict) and "cells" in data and "protocol" in data:
            data = {"rows": niah_rows(path)}
        rows = data.get("rows") if isinstance(data, dict) else None
        if not isinstance(rows, list) or not all(
            isinstance(r, dict) and fields <= r.keys() for r in rows
        ):
            raise SystemExit(f"error: {path}: expected {{'rows': [...]}} with {sorted(fields)}")
        for r in rows:
            row = RulerRow(**{k: r[k] for k in fields})
            key = (row.policy, row.length, row.ratio, row.task)
            if key in found and found[key].score != row.score:
                raise SystemExit(
                    f"error: {path}: {key} scores {row.score}, another file {found[key].score}"
                )
            found[key] = row
    return list(found.values())


def niah_rows(path: str) -> list[dict]:
    """A `kvjax niah` result as ruler rows: one per length, task `niah/<protocol>`, score the
    mean over its depths × 100; a policy without a budget (full, kivi) at ratio 0."""
    try:
        r = read_niah_result(path)
        by_length = {n: [c for c in r.cells if c.length == n] for n in r.lengths}
        budgets = r.budgets or {}
        rows = [
            {
                "policy": r.policy,
                "ratio": float(r.ratio or 0.0),
                "task": f"niah/{r.protocol}",
                "length": int(n),
                "score": round(100 * float(r.mean_score_by_length[str(n)]), 1),
                "samples": len(cells),
                "kept_tokens": float(budgets.get(str(n), n)),
                "seconds_compress": float(np.mean([c.seconds for c in cells])),
                "answers": [c.answer for c in cells],
            }
            for n, cells in by_length.items()
        ]
    except (KeyError, TypeError, ValueError) as e:
        raise SystemExit(f"error: {path}: not a readable niah result ({e!r})") from None
    if r.ratio is None and r.budget is not None:
        raise SystemExit(f"error: {path}: a niah result of --budget (no ratio to place it at)")
    return rows


def niah_live_share(paths: list[str], task: str) -> list[tuple[str, float, float, float]]:
    """(policy, ratio, mean score × 100, mean live KV bytes as % of the full cache's in the same
    (length, depth) cells) of each `kvjax niah` result of `task`; [] without a full result."""
    results = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        if isinstance(data, dict) and f"niah/{data.get('protocol')}" == task:
            results.append(read_niah_result(path))
    full = {
        (c.length, c.depth): c.live_kv_bytes for r in results if r.policy == "full" for c in r.cells
    }
    out = []
    for r in results:
        share = [
            c.live_kv_bytes / full[c.length, c.depth]
            for c in r.cells
            if (c.length, c.depth) in full
        ]
        if full and share:
            score = 100 * float(np.mean([c.score for c in r.cells]))
            out.append((r.policy, float(r.ratio or 0.0), score, 100 * float(np.mean(share))))
    return sorted(set(out), key=lambda t: (t[0] != "full", t[0], t[1]))


def cells(rows: list[RulerRow], tasks: list[str]) -> dict[tuple, float]:
    """(policy, length, ratio) -> mean score over `tasks`, for the cells where all finished."""
    by_cell: dict[tuple, dict[str, float]] = {}
    for r in rows:
        by_cell.setdefault((r.policy, r.length, r.ratio), {})[r.task] = r.score
    return {
        k: round(float(np.mean([v[t] for t in tasks])), 1)
        for k, v in by_cell.items()
        if all(t in v for t in tasks)
    }


def main(argv: list[str]) -> None:
    if len(argv) < 3:
        raise SystemExit(__doc__)
    png, tasks, paths = argv[0], argv[1].split(","), argv[2:]
    rows = [r for r in read(paths) if r.task in tasks]
    table = cells(rows, tasks)
    columns = sorted({(length, ratio) for _, length, ratio in table if ratio > 0})
    policies = sorted({p for p, _, _ in table}, key=lambda p: (p != "full", p))
    head = [f"{length // 1024}K {ratio:.1%}".replace(".0%", "%") for length, ratio in columns]
    print("| policy | " + " | ".join(head) + " | mean |")
    print("|---" * (len(head) + 2) + "|")
    fixed = {p for p, _, _ in table} - {p for p, _, ratio in table if ratio > 0}
    for p in policies:
        if p in fixed:  # no budget (full, kivi): its one score in every column of its length
            vals = [table.get((p, length, 0.0)) for length, _ in columns]
        else:
            vals = [table.get((p, length, ratio)) for length, ratio in columns]
        done = [v for v in vals if v is not None]
        mean = f"{round(float(np.mean(done)), 1):g}" if done else "—"
        text = " | ".join("—" if v is None else f"{v:g}" for v in vals)
        print(f"| {p} | {text} | {mean} |")
    shares = [row for t in tasks if t.startswith("niah/") for row in niah_live_share(paths, t)]
    if shares:
        print("\n| policy | ratio | mean score | live KV, % of full |\n|---|---|---|---|")
        for p, ratio, score, share in shares:
            print(f"| {p} | {ratio:g} | {score:.1f} | {share:.1f} |")
    for length in sorted({length for length, _ in columns}):  # one plot per length
        keep = [r for r in rows if (r.policy, r.length, r.ratio) in table and r.length == length]
        what = f"mean of {len(tasks)} tasks" if len(tasks) > 1 else tasks[0]
        meta = {"model": "SmolLM2-135M", "lengths": f"{length} tokens, {what}"}
        with tempfile.TemporaryDirectory() as tmp:
            _, made = write_ruler_outputs(keep, tmp, meta)
            out = png.replace(".png", f"_{length}.png")
            shutil.move(made, out)
        print(f"plot: {out}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
