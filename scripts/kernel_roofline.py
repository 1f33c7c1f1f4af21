"""Roofline table of one `kvjax bench kernel` run (its --out JSON): per row and shape, µs, the
speed against the same run's cuDNN BF16, bytes a slot, and the fraction of its floor (the row's
bytes at the same run's copy bandwidth, read + written, for the same batch and length).

Usage: python scripts/kernel_roofline.py runs/gpu/kernel.json [--rows ROW ...] [--best]
--best keeps, per row and shape, the fastest of the row's knob settings (the sweep), naming them.
Markdown on stdout.
"""

import argparse
import json
import pathlib
import sys


def _knobs(r: dict) -> dict:
    """A row's knob settings (the JSON holds them as a JSON string)."""
    k = r.get("knobs") or {}
    return json.loads(k) if isinstance(k, str) else k


def _knob_text(r: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(_knobs(r).items()))


def _label(r: dict) -> str:
    knobs = _knob_text(r)
    return f"{r['row']} [{knobs}]" if knobs else r["row"]


def table(rows: list[dict], only: list[str] | None, best: bool) -> str:
    ok = [r for r in rows if not r.get("error") and r.get("us")]
    shapes = sorted({(r["batch"], r["context"]) for r in ok})
    ref = {(r["batch"], r["context"]): r for r in ok if r["row"] == "cudnn-bf16" and not _knobs(r)}
    copy = {(r["batch"], r["context"]): r for r in ok if r["row"] == "copy"}
    names = only or list(dict.fromkeys(r["row"] for r in ok if r["row"] != "copy"))
    head = "| row (bytes/slot) | " + " | ".join(f"B{b} S{s // 1024}K µs (vs cuDNN, of floor)"
                                                for b, s in shapes) + " |"  # fmt: skip
    out = [head, "|---" * (len(shapes) + 1) + "|"]
    for name in names:
        cands = [r for r in ok if r["row"] == name]
        groups = [cands] if best else [[r for r in cands if _label(r) == lab]
                                       for lab in dict.fromkeys(map(_label, cands))]  # fmt: skip
        for grp in groups:
            if not grp:
                continue
            cells, per_slot = [], None
            for shape in shapes:
                here = [r for r in grp if (r["batch"], r["context"]) == shape]
                if not here:
                    cells.append("—")
                    continue
                r = min(here, key=lambda r: r["us"])
                b, s = shape
                per_slot = r["bytes_read"] / (b * s * r["kv_heads"])
                vs = f"{ref[shape]['us'] / r['us']:.2f}×" if shape in ref else "—"
                floor = "—"
                if shape in copy:  # copy bandwidth: its bytes read and written
                    bw = 2 * copy[shape]["bytes_read"] / copy[shape]["us"]
                    floor = f"{r['bytes_read'] / bw / r['us']:.0%}"
                knob = f" [{_knob_text(r)}]" if best and _knobs(r) else ""
                cells.append(f"{r['us']:.1f} ({vs}, {floor}){knob}")
            label = name if best else _label(grp[0])
            out.append(f"| {label} ({per_slot:.0f}) | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", type=pathlib.Path)
    ap.add_argument("--rows", nargs="+")
    ap.add_argument("--best", action="store_true")
    args = ap.parse_args()
    try:
        rows = json.loads(args.json.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"kernel_roofline: cannot read {args.json}: {e}") from e
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "row" in r for r in rows):
        raise SystemExit(f"kernel_roofline: {args.json} is not a `bench kernel` --out file")
    dev = {r.get("device") for r in rows} - {None}
    print(f"device: {', '.join(sorted(dev)) or '?'}\n")
    print(table(rows, args.rows, args.best))


if __name__ == "__main__":
    sys.exit(main())
