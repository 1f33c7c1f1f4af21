"""`kvjax bench decode`: decode tokens/s per policy and context length."""

from __future__ import annotations

import argparse
import dataclasses

import jax

from kvjax.cli._common import DTYPES, add_policy_args, build_policy, emit
from kvjax.models import PRESETS, init_params
from kvjax.policies import BUDGETLESS


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench", required=True)
    d = bsub.add_parser("decode", help="steady-state decode speed at given context lengths")
    add_policy_args(d, multi=True)
    d.add_argument(
        "--preset", default="SmolLM2-135M", help=f"random-init model shapes: {', '.join(PRESETS)}"
    )
    d.add_argument("--model", default=None, help="real weights instead of a preset")
    d.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    d.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    d.add_argument("--batch", type=int, default=1)
    d.add_argument("--steps", type=int, default=32, help="timed decode steps")
    d.add_argument("--fill-chunk", type=int, default=512)
    d.add_argument("--copy-mib", type=int, default=256, help="size of the bandwidth probe")
    d.add_argument("--json", action="store_true")
    d.add_argument("--out", default=None, help="also write JSON here")
    d.set_defaults(func=run_decode)


def run_decode(args: argparse.Namespace) -> int:
    from kvjax.eval import bench_decode

    dtype = DTYPES[args.dtype]
    if args.model:
        from kvjax.weights import load_model

        m = load_model(args.model, dtype=dtype)
        config, params = m.config, m.params
    else:
        by_lower = {k.lower(): v for k, v in PRESETS.items()}
        if args.preset.lower() not in by_lower:
            raise SystemExit(
                f"error: unknown preset {args.preset!r}; choose one of {', '.join(PRESETS)}"
            )
        config = by_lower[args.preset.lower()]
        params = init_params(config, jax.random.key(0), dtype=dtype)
    rows = []
    for name in args.policy:
        policy = build_policy(name, args, config.num_layers)
        for ctx in args.contexts:
            r = bench_decode(
                config,
                params,
                policy,
                context=ctx,
                batch=args.batch,
                steps=args.steps,
                budget=None if name in BUDGETLESS else args.budget,
                fill_chunk=min(args.fill_chunk, ctx),
                copy_bytes=args.copy_mib << 20,
            )
            rows.append(dataclasses.asdict(r))
            if not args.json:
                print(
                    f"{name:>10} ctx={ctx:>6}: {r.ms_per_step:8.2f} ms/step "
                    f"{r.tokens_per_s:9.1f} tok/s",
                    flush=True,
                )
    emit(rows, as_json=args.json, title="decode benchmark", out=args.out)
    return 0
