"""Opcode histogram of one kernel's SASS from ncu's source page (a kernel-development aid).

Usage: ncu -i REPORT --page source --csv --print-source sass > sass.csv
       python scripts/ncu_sass_histogram.py sass.csv [--pages N] [--top K] [--json]
Every SASS line carries its executed warp-instruction count and its warp-stall samples; this
sums them by opcode (the first word after any predicate, with its modifiers: `LOP3.LUT`,
`HMMA.16816.F32`) so that a kernel's instructions per page and where its warps wait can be read
and compared between variants. --pages N divides the counts by N (e.g. the 64-token pages a
call reads: B·Hkv·S/64). A readable table on stdout, or JSON with --json.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import pathlib
import re
import sys

_PRED = re.compile(r"^@!?U?P[T0-9]+\s+")


def opcode(source: str) -> str:
    """The opcode of one SASS line, modifiers kept ('@P0 LOP3.LUT R1, ...' -> 'LOP3.LUT')."""
    text = _PRED.sub("", source.strip())
    return text.split(None, 1)[0].rstrip(";") if text else ""


def _column(header: list[str], *names: str) -> int | None:
    for name in names:
        for i, h in enumerate(header):
            if h.strip().lower() == name.lower():
                return i
    return None


def read_rows(text: str) -> list[tuple[str, float, float]]:
    """(opcode, executed warp instructions, stall samples) of every SASS line of the CSV."""
    lines = text.splitlines()
    start = next(
        (i for i, ln in enumerate(lines) if '"Source"' in ln or ln.startswith("Source")), None
    )
    if start is None:
        raise ValueError("no header with a 'Source' column: not ncu's --page source --csv output")
    reader = csv.reader(io.StringIO("\n".join(lines[start:])))
    header = next(reader)
    src = _column(header, "Source")
    execd = _column(header, "Instructions Executed", "Warp Instructions Executed")
    stall = _column(header, "Warp Stall Sampling (All Samples)", "Sampling Data (All)")
    if src is None or execd is None:
        raise ValueError(f"the CSV lacks a Source or an Instructions Executed column: {header}")

    def num(row: list[str], i: int | None) -> float:
        if i is None or i >= len(row):
            return 0.0
        try:
            return float(row[i].replace(",", "") or 0)
        except ValueError:
            return 0.0

    return [
        (opcode(r[src]), num(r, execd), num(r, stall))
        for r in reader
        if len(r) > src and r[src].strip()
    ]


def histogram(rows: list[tuple[str, float, float]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for op, n, s in rows:
        if not op:
            continue
        d = out.setdefault(op, {"executed": 0.0, "stalls": 0.0, "lines": 0})
        d["executed"] += n
        d["stalls"] += s
        d["lines"] += 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", type=pathlib.Path)
    ap.add_argument(
        "--pages", type=float, default=1.0, help="divide counts by this (pages a call reads)"
    )
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not args.csv.is_file():
        raise SystemExit(f"ncu_sass_histogram: no file {args.csv}")
    if args.pages <= 0:
        raise SystemExit(f"ncu_sass_histogram: --pages must be > 0, got {args.pages}")
    try:
        hist = histogram(read_rows(args.csv.read_text(errors="replace")))
    except ValueError as e:
        raise SystemExit(f"ncu_sass_histogram: {args.csv}: {e}") from None
    total = sum(d["executed"] for d in hist.values())
    stalls = sum(d["stalls"] for d in hist.values()) or 1.0
    top = sorted(hist.items(), key=lambda kv: -kv[1]["executed"])[: args.top]
    if args.json:
        json.dump(
            {
                "executed_per_page": total / args.pages,
                "lines": sum(d["lines"] for d in hist.values()),
                "opcodes": {k: {**v, "executed": v["executed"] / args.pages} for k, v in top},
            },
            sys.stdout,
            indent=1,
        )
        print()
        return
    print(
        f"{args.csv.name}: {total / args.pages:,.1f} warp instructions per page "
        f"({sum(d['lines'] for d in hist.values())} SASS lines)"
    )
    print(f"{'opcode':<28}{'per page':>12}{'share':>8}{'stalls':>8}{'lines':>7}")
    for op, d in top:
        print(
            f"{op:<28}{d['executed'] / args.pages:>12,.1f}{d['executed'] / max(total, 1):>8.1%}"
            f"{d['stalls'] / stalls:>8.1%}{d['lines']:>7}"
        )


if __name__ == "__main__":
    main()
