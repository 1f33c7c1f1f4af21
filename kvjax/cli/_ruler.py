"""`kvjax ruler`: RULER-style tasks under kvpress's protocol (context compressed once to
(1 − ratio) × its length, then the question), per policy and compression ratio."""

from __future__ import annotations

import argparse

from kvjax.cli._common import add_model_args, emit, load


def register(sub) -> None:
    from kvjax.eval import RULER_TASKS

    p = sub.add_parser(
        "ruler", help="RULER-style synthetic tasks, kvpress's compress-once protocol"
    )
    p.add_argument(
        "--policy",
        nargs="+",
        default=["full", "snapkv"],
        help="policies to compare: registry names (`adakv` wraps snapkv) or adakv-PRESS, adakv "
        "over PRESS with both their defaults (e.g. adakv-snapkv adakv-kvzip; a PRESS adakv "
        "cannot wrap is refused with the list of those it can)",
    )
    p.add_argument(
        "--ratios",
        type=float,
        nargs="+",
        default=[0.25, 0.5, 0.75, 0.875],
        help="compression ratios: the share of the context dropped",
    )
    p.add_argument("--tasks", nargs="+", default=list(RULER_TASKS), choices=list(RULER_TASKS))
    p.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=[1024],
        help="prompt lengths in tokens (context + question), fitted to the tokenizer",
    )
    p.add_argument("--samples", type=int, default=4, help="seeded prompts per task and length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--out-dir", default="runs/ruler", help="writes ruler.json and ruler.png")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_model_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from kvjax.eval import (
        check_ruler_args,
        check_ruler_policies,
        ruler_summary,
        run_ruler,
        write_ruler_json,
        write_ruler_outputs,
    )

    check_ruler_policies(args.policy)
    check_ruler_args(args.tasks, args.lengths, args.ratios, args.samples)
    model = load(args)
    per = len(args.tasks) * len(args.lengths) * args.samples
    total = per * sum(1 if n == "full" else len(args.ratios) for n in args.policy)
    meta = dict(
        model=model.config.name,
        lengths=args.lengths,
        tasks=args.tasks,
        samples=args.samples,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        protocol="compress once (kvpress), then question",
        scoring="string_match_all x100",
    )
    with tqdm(total=total, desc="ruler", unit="sample") as bar:  # stderr, also under --json

        def step(label: str) -> None:
            bar.set_postfix_str(label)
            bar.update()

        def partial(rows) -> None:  # a run cut short keeps every finished cell
            write_ruler_json(rows, args.out_dir, meta | {"complete": False})

        rows = run_ruler(
            model,
            args.policy,
            tasks=args.tasks,
            lengths=args.lengths,
            ratios=args.ratios,
            samples=args.samples,
            seed=args.seed,
            max_new_tokens=args.max_new_tokens,
            on_sample=step,
            on_row=partial,
        )
    j, png = write_ruler_outputs(rows, args.out_dir, meta | {"complete": True})
    emit(ruler_summary(rows), as_json=args.json, title=f"RULER score ({model.config.name})")
    if not args.json:
        print(f"wrote {j} and {png}")
    return 0
