"""`kvjax ppl`: perplexity of the essay avg.txt through a policy's cache."""

from __future__ import annotations

import argparse
import dataclasses

from kvjax.cli._common import (
    add_model_args,
    add_policy_args,
    add_scan_arg,
    build_policy,
    check_scan,
    emit,
    load,
)


def register(sub) -> None:
    p = sub.add_parser("ppl", help="teacher-forced perplexity through a policy's cache")
    add_policy_args(p)
    add_model_args(p)
    p.add_argument("--tokens", type=int, default=2048, help="first N tokens of the essay")
    p.add_argument("--text", default="avg.txt", help="essay file name (Paul Graham essays)")
    p.add_argument(
        "--chunk", type=int, default=1, help="tokens per model call (1 = exact decode semantics)"
    )
    p.add_argument(
        "--cache-dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="full-precision cache tier dtype (default: --dtype)",
    )
    add_scan_arg(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--out", default=None, help="also write the JSON to this file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvjax.eval import run_ppl

    check_scan(build_policy(args.policy, args), args)  # bad flags fail before the model loads
    model = load(args)
    policy = build_policy(args.policy, args, model.config.num_layers)
    check_scan(policy, args)
    res = run_ppl(
        model,
        policy,
        n_tokens=args.tokens,
        text=args.text,
        chunk=args.chunk,
        budget=args.budget,
        cache_dtype=args.cache_dtype,
        progress=True,
        scan_layers=args.scan_layers,
    )
    emit(dataclasses.asdict(res), as_json=args.json, title="perplexity", out=args.out)
    return 0
