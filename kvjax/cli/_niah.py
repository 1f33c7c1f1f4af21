"""`kvjax niah`: needle in a haystack over the Paul Graham essays, per policy and protocol."""

from __future__ import annotations

import argparse

from kvjax.cli._common import add_model_args, add_policy_args, build_policy, emit, load
from kvjax.policies import BUDGETLESS

_PROTOCOLS = {
    "query-aware": ("query-aware",),
    "query-agnostic": ("query-agnostic",),
    "both": ("query-agnostic", "query-aware"),
}


def register(sub) -> None:
    p = sub.add_parser("niah", help="needle in a haystack (gkamradt) through a policy's cache")
    add_policy_args(p, multi=True)
    p.set_defaults(policy=["full"])
    add_model_args(p)
    p.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=[1024, 2048, 4096],
        help="context lengths in tokens (prompt + answer)",
    )
    p.add_argument(
        "--depths",
        type=float,
        nargs="+",
        default=[0, 25, 50, 75, 100],
        help="needle depths in percent of the haystack",
    )
    p.add_argument(
        "--protocol",
        choices=sorted(_PROTOCOLS),
        default="both",
        help="query-aware: question streamed with the context; query-agnostic: "
        "context compressed first, question appended after",
    )
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--chunk-size", type=int, default=256, help="prefill chunk (tokens)")
    p.add_argument(
        "--out-dir",
        default="runs/niah",
        help="writes <policy>[-b<budget>]_<protocol>.json and .png here",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from kvjax.eval import check_niah_grid, niah_summary_rows, run_niah, write_niah_outputs

    for name in args.policy:
        build_policy(name, args)  # bad flags fail before the model loads
    check_niah_grid(args.lengths, args.depths)
    protocols = _PROTOCOLS[args.protocol]
    model = load(args)
    n_cells = len(args.policy) * len(protocols) * len(args.lengths) * len(args.depths)
    results, paths = [], []
    with tqdm(total=n_cells, desc="niah", unit="cell") as bar:
        for name in args.policy:
            policy = build_policy(name, args, model.config.num_layers)
            for protocol in protocols:
                bar.set_postfix_str(f"{name} {protocol}")
                r = run_niah(
                    model,
                    policy,
                    lengths=args.lengths,
                    depths=args.depths,
                    protocol=protocol,
                    label=name,
                    budget=None if name in BUDGETLESS else args.budget,
                    max_new_tokens=args.max_new_tokens,
                    chunk_size=args.chunk_size,
                    on_cell=lambda _: bar.update(),
                )
                results.append(r)
                paths.append(write_niah_outputs(r, args.out_dir))
    rows = niah_summary_rows(results)
    if args.json:
        rows = [row | {"json": j, "png": p} for row, (j, p) in zip(rows, paths, strict=True)]
    emit(rows, as_json=args.json, title=f"NIAH mean score ({model.config.name})")
    if not args.json:
        print(f"wrote {len(paths)} JSON + PNG pairs under {args.out_dir}")
    return 0
