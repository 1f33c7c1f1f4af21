"""`kvjax diagnostics`: future missed mass, selection churn and Global LIR of policies, measured
against a full-cache shadow pass on the same tokens; table + JSON + PNG."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib

from kvjax.cli._common import add_model_args, add_policy_args, build_policy, emit, load
from kvjax.policies import BUDGETLESS


def register(sub) -> None:
    p = sub.add_parser(
        "diagnostics",
        help="FMM, selection churn and Global LIR of policies against a full-cache shadow pass",
    )
    add_policy_args(p, multi=True)
    p.set_defaults(policy=["h2o", "tova", "confkv"])
    add_model_args(p)
    p.add_argument("--tokens", type=int, default=1024, help="S: tokens of the stream")
    p.add_argument(
        "--prompt-tokens", type=int, default=512, help="P: prefilled in chunks before decoding"
    )
    p.add_argument(
        "--text",
        default="avg.txt",
        help="a text file, or an essay name from the Paul Graham essays (default avg.txt)",
    )
    p.add_argument(
        "--window", type=int, default=8, help="ω: positions per window and steps per event"
    )
    p.add_argument("--horizon", type=int, default=32, help="H: FMM look-ahead in decode steps")
    p.add_argument("--lir-m", type=int, default=4, help="LIR: inactive events before a candidate")
    p.add_argument("--lir-h", type=int, default=8, help="LIR: events to become active again")
    p.add_argument(
        "--lir-k",
        type=int,
        default=None,
        help="LIR: active windows per event (default budget // window, at least 1)",
    )
    p.add_argument(
        "--generate",
        action="store_true",
        help="after the prompt, feed the policy model's greedy tokens instead of the text",
    )
    p.add_argument(
        "--cache-dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="cache dtype of both caches (default: --dtype)",
    )
    p.add_argument("--out-dir", default="runs/diagnostics", help="writes diagnostics.json/.png")
    p.add_argument("--json", action="store_true", help="print the JSON instead of a table")
    p.set_defaults(func=run)


def _finite(x):
    """NaN -> None, recursively (JSON has no NaN)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def run(args: argparse.Namespace) -> int:
    from kvjax.eval import (
        DiagnosticsSettings,
        check_diagnostics_args,
        diagnostics_rows,
        plot_diagnostics,
        run_diagnostics,
    )

    if args.budget is not None and args.budget < 1:
        raise ValueError(f"--budget must be >= 1, got {args.budget}")
    for name in args.policy:
        build_policy(name, args)  # unknown names and bad budgets fail before the model loads
    if args.lir_k is None and args.budget is None:
        raise ValueError("give --budget (LIR's top-k is budget // window) or --lir-k")
    top_k = args.lir_k if args.lir_k is not None else max(1, args.budget // max(args.window, 1))
    settings = dict(
        tokens=args.tokens,
        prompt_tokens=args.prompt_tokens,
        window=args.window,
        horizon=args.horizon,
        m=args.lir_m,
        h=args.lir_h,
        top_k=top_k,
    )
    check_diagnostics_args(**settings)
    model = load(args)
    if model.config.max_positions and args.tokens > model.config.max_positions:
        raise ValueError(
            f"--tokens {args.tokens} exceeds the model's {model.config.max_positions} positions"
        )
    policies = [build_policy(n, args, model.config.num_layers) for n in args.policy]
    budget = None if all(n in BUDGETLESS for n in args.policy) else args.budget
    config = DiagnosticsSettings(
        model=model.config.name,
        text=args.text,
        tokens=args.tokens,
        prompt_tokens=args.prompt_tokens,
        budget=budget,
        window=args.window,
        horizon=args.horizon,
        lir_m=args.lir_m,
        lir_h=args.lir_h,
        lir_k=top_k,
        generate=args.generate,
    )
    results = run_diagnostics(model, policies, config, cache_dtype=args.cache_dtype, progress=True)
    results = [dataclasses.replace(r, policy=n) for r, n in zip(results, args.policy, strict=True)]
    doc = _finite(
        {
            "settings": dataclasses.asdict(config),
            "results": [dataclasses.asdict(r) for r in results],
        }
    )
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "diagnostics.json").write_text(json.dumps(doc, indent=2) + "\n")
    mode = "greedy" if args.generate else "teacher-forced"
    plot_diagnostics(
        results,
        str(out / "diagnostics.png"),
        title=f"{model.config.name}: {args.tokens} tokens of {args.text} ({mode}), "
        f"P={args.prompt_tokens}, budget {budget}, ω={args.window}, H={args.horizon}",
    )
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        emit(_finite(diagnostics_rows(results)), as_json=False, title=f"cache diagnostics ({mode})")
        print(f"wrote {out / 'diagnostics.json'} and {out / 'diagnostics.png'}")
    return 0
