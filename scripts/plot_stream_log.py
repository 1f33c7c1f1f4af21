"""PPL per chunk from `kvjax stream` progress lines (stderr logs), for runs cut before their
JSON was written: `python scripts/plot_stream_log.py OUT.png LOG [LOG ...]` prints a Markdown
table (chunk end, PPL per policy) and writes the plot."""

from __future__ import annotations

import re
import sys

LINE = re.compile(
    r"stream \[(?P<policy>[^\]]+)\] tokens (?P<start>\d+)-(?P<end>\d+) of \d+: "
    r"ppl (?P<ppl>[0-9.]+|nan|inf), live (?P<mib>[0-9.]+) MiB, (?P<ms>[0-9.]+|nan) ms/token"
)


def read(paths: list[str]) -> dict[str, list[tuple[int, float, float]]]:
    """policy → [(end, ppl, ms/token)] in file order."""
    out: dict[str, list[tuple[int, float, float]]] = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                m = LINE.search(line)
                if m:
                    row = (int(m["end"]), float(m["ppl"]), float(m["ms"]))
                    out.setdefault(m["policy"], []).append(row)
    if not out:
        raise SystemExit(f"error: no `stream [...]` progress lines in {', '.join(paths)}")
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        raise SystemExit(__doc__)
    png, logs = argv[0], argv[1:]
    data = read(logs)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.2, 4.4))
    for name, rows in data.items():
        ax.plot([r[0] for r in rows], [r[1] for r in rows], marker=".", label=name)
    ax.set_xlabel("tokens streamed")
    ax.set_ylabel("perplexity of the chunk")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    names = list(data)
    print("| tokens | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    ends = sorted({r[0] for rows in data.values() for r in rows})
    for end in ends:
        cells = [next((f"{r[1]:.1f}" for r in data[n] if r[0] == end), "—") for n in names]
        print(f"| {end} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
