"""`kvjax stream`: perplexity per chunk over a long stream of the essays (looped), per policy."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from kvjax.cli._common import DTYPES, add_model_args, add_policy_args, build_policy, emit, load
from kvjax.policies import BUDGETLESS


def register(sub) -> None:
    p = sub.add_parser("stream", help="perplexity per chunk of a long token stream, per policy")
    add_policy_args(p, multi=True)
    add_model_args(p)
    p.add_argument("--tokens", type=int, default=65536, help="stream length (essays, looped)")
    p.add_argument("--chunk", type=int, default=4096, help="tokens per reported chunk")
    p.add_argument("--segment", type=int, default=512, help="tokens per jitted call")
    p.add_argument(
        "--max-full",
        type=int,
        default=8192,
        help="full and kivi (caches that grow with the stream) stop here (the model's context)",
    )
    p.add_argument("--cache-dtype", default=None, choices=sorted(DTYPES))
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--out", default=None, help="also write the JSON to this file")
    p.add_argument("--plot", default=None, help="PNG: PPL per chunk, one line per policy")
    p.add_argument(
        "--from-json",
        nargs="+",
        default=None,
        metavar="FILE",
        help="run nothing: merge these --out files into one table and --plot",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvjax.eval import plot_stream, run_stream, stream_tokens

    if args.from_json:
        return _merge(args, plot_stream)

    if args.tokens < 2 or args.chunk < 1 or args.segment < 1 or args.chunk % args.segment:
        raise ValueError(
            f"--tokens ({args.tokens}) must be >= 2 and --chunk ({args.chunk}) a positive "
            f"multiple of --segment ({args.segment})"
        )
    for name in args.policy:
        build_policy(name, args)  # bad flags fail before the model loads
    model = load(args)
    tokens = stream_tokens(model, args.tokens + 1)
    rows: list = []

    def save(mine: list) -> None:  # every finished chunk reaches --out at once
        _write(args.out, rows + mine)

    for i, name in enumerate(args.policy):
        print(f"stream: policy {i + 1}/{len(args.policy)} {name}", file=sys.stderr, flush=True)
        policy = build_policy(name, args, model.config.num_layers)
        rows += run_stream(
            model,
            policy,
            tokens,
            budget=None if name in BUDGETLESS else args.budget,
            chunk=args.chunk,
            segment=args.segment,
            max_full=args.max_full,
            cache_dtype=DTYPES[args.cache_dtype] if args.cache_dtype else None,
            on_chunk=save if args.out else None,
        )
    if args.plot:
        title = f"{model.config.name}: {args.tokens} tokens of the essays, budget {args.budget}"
        plot_stream(rows, args.plot, title=title)
    _write(args.out, rows)
    emit([dataclasses.asdict(r) for r in rows], as_json=args.json, title="perplexity per chunk")
    return 0


def _write(path: str | None, rows: list) -> None:
    """The rows so far as `--out` JSON (written whole, then renamed: never half a file)."""
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps([dataclasses.asdict(r) for r in rows], indent=2) + "\n")
    os.replace(tmp, path)


def _merge(args: argparse.Namespace, plot_stream) -> int:
    from kvjax.eval import StreamChunk

    rows = []
    for path in args.from_json:
        try:
            with open(path) as f:
                rows += [StreamChunk(**r) for r in json.load(f)]
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"{path} is not a `kvjax stream --out` file: {e}") from None
    if args.plot:
        plot_stream(rows, args.plot, title=f"{len(args.from_json)} streams")
    emit(
        [dataclasses.asdict(r) for r in rows],
        as_json=args.json,
        title="perplexity per chunk",
        out=args.out,
    )
    return 0
