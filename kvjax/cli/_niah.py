"""`kvjax niah`: needle in a haystack over the Paul Graham essays, per policy and protocol."""

from __future__ import annotations

import argparse
import dataclasses

from kvjax._budget import budget_from_compression
from kvjax.cli._common import (
    add_model_args,
    add_policy_args,
    add_scan_arg,
    build_policy,
    check_scan,
    emit,
    load,
)
from kvjax.policies import BUDGETLESS

_PROTOCOLS = {
    "query-aware": ("query-aware",),
    "query-agnostic": ("query-agnostic",),
    "press": ("press",),
    "both": ("query-agnostic", "query-aware"),
    "all": ("query-agnostic", "query-aware", "press"),
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
        help="query-aware: question streamed with the context through the bounded cache; "
        "query-agnostic: context compressed first, then the question appended (it may evict "
        "context); press: kvpress's protocol, the context compressed once, then question and "
        "answer append without evicting it (full-precision policies); both: the two bounded "
        "ones; all: the three",
    )
    p.add_argument(
        "--ratios",
        type=float,
        nargs="+",
        default=None,
        help="compression ratios instead of --budget: each context length L runs at a budget of "
        "floor((1 - ratio) * L) tokens (kvpress's compression_ratio); one result per policy "
        "and ratio (full: once)",
    )
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--chunk-size", type=int, default=256, help="prefill chunk (tokens)")
    add_scan_arg(p)
    p.add_argument(
        "--out-dir",
        default="runs/niah",
        help="writes <policy>[-b<budget>|-r<ratio>]_<protocol>.json and .png here",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from kvjax.eval import check_niah_grid, niah_summary_rows, run_niah, write_niah_outputs
    from kvjax.models import stack_params

    check_niah_grid(args.lengths, args.depths)
    runs = _runs(args)  # bad flags, ratios and budgets fail before the model loads
    protocols = _PROTOCOLS[args.protocol]
    model = load(args)
    if args.scan_layers:
        _runs(args, model.config.num_layers)  # per-layer budgets need the layer count
        if "press" not in protocols:  # press reads the per-layer params too (run_niah stacks)
            # once for every run; the per-layer copy is dropped
            model = dataclasses.replace(model, params=stack_params(model.params, model.config))
    n_cells = len(runs) * len(protocols) * len(args.lengths) * len(args.depths)
    results, paths = [], []
    with tqdm(total=n_cells, desc="niah", unit="cell") as bar:
        for name, ratio in runs:
            if ratio is None:
                policy = build_policy(name, args, model.config.num_layers)
            else:
                policy = _at_ratio(name, ratio, args, model.config.num_layers)
            for protocol in protocols:
                bar.set_postfix_str(f"{name} {protocol}" + ("" if ratio is None else f" {ratio:g}"))
                r = run_niah(
                    model,
                    policy,
                    lengths=args.lengths,
                    depths=args.depths,
                    protocol=protocol,
                    label=name,
                    budget=None if name in BUDGETLESS else args.budget,
                    ratio=ratio,
                    max_new_tokens=args.max_new_tokens,
                    chunk_size=args.chunk_size,
                    on_cell=lambda _: bar.update(),
                    scan_layers=args.scan_layers,
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


def _runs(
    args: argparse.Namespace, num_layers: int | None = None
) -> list[tuple[str, float | None]]:
    """(policy, ratio) pairs to run, every policy built once per length here (so a bad value,
    or one that cannot scan its layers under --scan-layers, stops the command before the model
    loads; `num_layers`: again once it has, before any cell runs); ratio None: `--budget` as
    given."""
    if args.ratios is None:
        for name in args.policy:
            check_scan(build_policy(name, args, num_layers), args)
        return [(name, None) for name in args.policy]
    if args.budget is not None:
        raise ValueError(
            "give --budget (tokens per KV head) or --ratios (a compression of each context "
            "length), not both"
        )
    runs: list[tuple[str, float | None]] = []
    for name in args.policy:
        if name in BUDGETLESS:  # keeps every token: one run, no ratio
            check_scan(build_policy(name, args, num_layers), args)
            runs.append((name, None))
            continue
        for ratio in args.ratios:
            for length in args.lengths:
                check_scan(_at_ratio(name, ratio, args, num_layers)(length), args)
            runs.append((name, ratio))
    return runs


def _at_ratio(name: str, ratio: float, args: argparse.Namespace, num_layers: int | None = None):
    """Context length -> the policy at `ratio`'s budget for that length."""

    def policy(length: int):
        try:
            budget = budget_from_compression(ratio, length)
        except (TypeError, ValueError) as e:
            raise ValueError(f"--ratios {ratio:g}: {e}") from None
        try:
            return build_policy(
                name, argparse.Namespace(**{**vars(args), "budget": budget}), num_layers
            )
        except ValueError as e:
            raise ValueError(
                f"--ratios {ratio:g} of a {length}-token context gives {name} a budget of "
                f"{budget} tokens: {e}"
            ) from None

    return policy
