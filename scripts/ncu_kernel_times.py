"""Summarizes an `ncu --csv --metrics gpu__time_duration.sum` log: the last N kernels launched
(a steady-state window of a probe's loop), their total time and the time per kernel name.

Usage: python scripts/ncu_kernel_times.py NCU.csv [N]
"""

import collections
import csv
import sys


def rows(path: str) -> list[tuple[str, float]]:
    """(kernel name, ns) per launch, in launch order, from ncu's CSV (lines before the header,
    the profiled program's own output, are skipped)."""
    with open(path) as f:
        lines = f.read().splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if start is None:
        raise SystemExit(f"{path}: no ncu CSV header (did ncu run? see the .err file)")
    out = []
    for r in csv.DictReader(lines[start:]):
        if r.get("Metric Name") == "gpu__time_duration.sum":
            out.append((r["Kernel Name"], float(r["Metric Value"].replace(",", ""))))
    return out


def main() -> None:
    path = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 400
    launches = rows(path)[-n:]
    total = sum(ns for _, ns in launches)
    print(f"{len(launches)} kernels, {total / 1e3:.1f} us in all")
    by_name = collections.defaultdict(list)
    for name, ns in launches:
        by_name[name[:90]].append(ns)
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    for name, times in ranked:
        mean = sum(times) / len(times)
        print(f"{sum(times) / 1e3:9.1f} us  {len(times):5d} x {mean / 1e3:7.2f} us  {name}")


if __name__ == "__main__":
    main()
