"""`kvjax confidence-kl`: CONF-KV's check that confidence tracks dependence on recent context."""

from __future__ import annotations

import argparse
import dataclasses
import json

from kvjax.cli._common import add_model_args, emit, load


def register(sub) -> None:
    p = sub.add_parser(
        "confidence-kl",
        help="correlate next-token confidence with the KL shift from ablating recent context",
    )
    add_model_args(p)
    p.add_argument(
        "--essays",
        type=int,
        default=4,
        help="use the last N essays (sorted names) with at least --tokens tokens",
    )
    p.add_argument(
        "--texts", nargs="+", default=None, help="essay file names instead (e.g. vw.txt web20.txt)"
    )
    p.add_argument("--tokens", type=int, default=1024, help="first N tokens of each essay")
    p.add_argument(
        "--samples",
        type=int,
        default=128,
        help="evenly spaced positions per essay in [--min-context, tokens - 1]",
    )
    p.add_argument(
        "--ablate",
        type=int,
        default=32,
        help="R: the R tokens before x_t are hidden from it in the ablated pass",
    )
    p.add_argument("--min-context", type=int, default=256, help="first sampled position")
    p.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples (95%% CI)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    p.add_argument(
        "--json", action="store_true", help="print JSON (all numbers and the per-sample arrays)"
    )
    p.add_argument("--out", default=None, help="also write the full JSON to this file")
    p.add_argument("--plot", default=None, help="write a PNG scatter of c vs KL here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvjax.eval import (
        check_confidence_kl_args,
        confidence_kl_rows,
        plot_confidence_kl,
        run_confidence_kl,
    )

    settings = dict(
        n_tokens=args.tokens, samples=args.samples, ablate=args.ablate, min_context=args.min_context
    )
    check_confidence_kl_args(**settings, texts=args.texts, essays=args.essays)  # before loading
    model = load(args)
    res = run_confidence_kl(
        model,
        **settings,
        texts=args.texts,
        essays=args.essays,
        resamples=args.resamples,
        seed=args.seed,
        progress=True,
    )
    full = dataclasses.asdict(res)
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(full, indent=2) + "\n")
    if args.plot:
        plot_confidence_kl(res, args.plot)
    if args.json:
        emit(full, as_json=True, title="confidence-kl")
        return 0
    emit(
        confidence_kl_rows(res),
        as_json=False,
        title=f"confidence vs KL(full || last {res.ablate} tokens ablated), {res.model}",
    )
    print(
        f"n = {res.n} ({len(res.texts)} essays x {res.samples} positions in "
        f"[{res.min_context}, {res.tokens - 1}]: {', '.join(res.texts)}); "
        f"mean KL = {res.mean_kl:.4g} nats, median {res.median_kl:.4g}; "
        f"{res.seconds:.1f} s. CONF-KV paper: r = -0.77."
    )
    for path in (args.out, args.plot):
        if path:
            print(f"wrote {path}")
    return 0
