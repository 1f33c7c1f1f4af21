"""`kvjax compare`: every policy at the live bytes of a sliding window; table + Pareto plot."""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib

from kvjax.cli._common import add_model_args, emit, load


def register(sub) -> None:
    from kvjax.eval._compare import ROWS

    p = sub.add_parser("compare", help="matched-memory perplexity of all policies")
    add_model_args(p)
    p.add_argument("--rows", nargs="+", default=list(ROWS), help=f"from {list(ROWS)}")
    p.add_argument(
        "--windows",
        type=int,
        nargs="+",
        default=[512],
        help="match the peak live bytes of these window sizes",
    )
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--text", default="avg.txt")
    p.add_argument("--cache-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--out-dir", default="runs/compare")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvjax.eval._compare import ROWS, plot_pareto, run_compare

    unknown = [x for x in args.rows if x not in ROWS]
    if unknown:
        raise ValueError(f"unknown rows {unknown}; choose from {list(ROWS)}")
    model = load(args)
    rows = run_compare(
        model,
        args.rows,
        windows=args.windows,
        n_tokens=args.tokens,
        text=args.text,
        cache_dtype=args.cache_dtype,
        progress=True,
    )
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = [dataclasses.asdict(r) for r in rows]
    (out / "compare.json").write_text(json.dumps(data, indent=2) + "\n")
    plot_pareto(
        rows,
        str(out / "pareto.png"),
        title=f"{model.config.name}: {args.tokens} tokens of {args.text}, {args.cache_dtype} cache",
    )
    emit(data, as_json=args.json, title="matched-memory perplexity")
    return 0
