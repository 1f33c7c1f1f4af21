"""`kvjax bench decode` (decode tokens/s per policy and context) and `kvjax bench kernel`
(decode-attention kernels vs cuDNN/XLA in µs and TB/s)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys

import jax

from kvjax.attention import IMPLEMENTATIONS
from kvjax.cli._common import DTYPES, add_policy_args, add_scan_arg, build_policy, check_scan, emit
from kvjax.models import PRESETS, init_params, stack_params
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
    d.add_argument(
        "--attention",
        default="xla",
        choices=list(IMPLEMENTATIONS),
        help="attention implementation (auto: Pallas on GPU/TPU, XLA on CPU)",
    )
    d.add_argument(
        "--mesh",
        default=None,
        metavar="AXIS=N,...",
        help="run the decode steps sharded over a device mesh, e.g. data=1,model=1 (axes data, "
        "model; docs/sharding.md); adds per-device KV bytes and the collectives per step",
    )
    add_scan_arg(d)
    d.add_argument("--json", action="store_true")
    d.add_argument("--out", default=None, help="also write JSON here")
    d.set_defaults(func=run_decode)
    _register_kernel(bsub)


def _register_kernel(bsub) -> None:
    from kvjax.eval._bench_kernel import ITERS, ROWS

    k = bsub.add_parser("kernel", help="decode-attention kernels vs cuDNN / XLA (µs, TB/s)")
    k.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    k.add_argument("--contexts", type=int, nargs="+", default=[16384, 32768, 65536])
    k.add_argument("--q-heads", type=int, default=32)
    k.add_argument("--kv-heads", type=int, default=8)
    k.add_argument("--head-dim", type=int, default=128)
    k.add_argument("--page", type=int, default=32, help="tokens per low-bit page")
    k.add_argument("--value-group", type=int, default=32, help="channels per value scale")
    k.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    k.add_argument(
        "--iters",
        type=int,
        default=ITERS,
        help="calls per timed loop (each loop's fixed dispatch cost falls on all of them)",
    )
    k.add_argument("--repeats", type=int, default=5, help="timed loops (median)")
    k.add_argument(
        "--unroll",
        type=int,
        default=1,
        help="calls per iteration of the timed loop (a divisor of --iters): the loop's own "
        "per-iteration cost falls on one call in UNROLL",
    )
    k.add_argument(
        "--sweep",
        nargs="*",
        default=[],
        metavar="KNOB=V1,V2",
        help="also time --sweep-rows over a grid of knobs (block_k, num_splits, "
        "num_warps, num_stages; int8_qk=0,1 and v_words=0,1 for pallas-int8; "
        "stack_pages=0,1, asm_unpack=0,1 and tokens_m=0,1 for the low-bit rows), "
        "e.g. --sweep block_k=32,64 num_warps=4,8",
    )
    k.add_argument("--sweep-rows", nargs="+", default=["pallas-bf16"], choices=list(ROWS))
    k.add_argument("--json", action="store_true")
    k.add_argument("--out", default=None, help="also write JSON here")
    k.set_defaults(func=run_kernel)


def _grid(specs: list[str]) -> list[dict[str, int]]:
    """["block_k=32,64", "num_warps=4"] -> every combination as a dict (one empty dict if none)."""
    from kvjax.eval._bench_kernel import SWEEP_KNOBS

    grid: list[dict[str, int]] = [{}]
    for spec in specs:
        name, _, values = spec.partition("=")
        if name not in SWEEP_KNOBS or not values:
            raise SystemExit(f"error: bad --sweep entry {spec!r}")
        grid = [{**g, name: int(v)} for g in grid for v in values.split(",")]
    return grid


def _print_row(r, file=None) -> None:
    t = f"{r.us:9.1f} us {r.tbps:6.2f} TB/s" if r.error is None else r.error
    if r.error is None and r.build_s is not None:
        t += f"  (arrays {r.build_s:.1f} s" + (
            f", first loop {r.first_s:.1f} s)" if r.first_s is not None else ")"
        )
    print(f"B={r.batch} S={r.context:>6} {r.row:>20} {r.knobs}: {t}", file=file, flush=True)


def run_kernel(args: argparse.Namespace) -> int:
    from kvjax.eval import bench_kernel

    sweep = tuple(_grid(args.sweep)) if args.sweep else ()
    rows = []
    for b in args.batch:
        for ctx in args.contexts:
            res = bench_kernel(
                batch=b,
                context=ctx,
                q_heads=args.q_heads,
                kv_heads=args.kv_heads,
                head_dim=args.head_dim,
                page=args.page,
                value_group=args.value_group,
                rows=tuple(args.rows),
                iters=args.iters,
                repeats=args.repeats,
                unroll=args.unroll,
                sweep=sweep,
                sweep_rows=tuple(args.sweep_rows),
                on_row=functools.partial(_print_row, file=sys.stderr if args.json else None),
            )
            rows += [dataclasses.asdict(r) for r in res]
    emit(rows, as_json=args.json, title="decode-attention kernel benchmark", out=args.out)
    return 0


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
    if args.scan_layers:
        if args.mesh is not None:
            raise ValueError("--scan-layers does not run with --mesh yet")
        for name in args.policy:  # every policy checked before anything runs
            check_scan(build_policy(name, args, config.num_layers), args)
        params = stack_params(params, config)  # once for every row; the per-layer copy is dropped
    mesh = None
    if args.mesh is not None:
        from kvjax.eval._bench_mesh import parse_mesh
        from kvjax.sharding import make_mesh

        mesh = make_mesh(**parse_mesh(args.mesh))  # ValueError: exit 2 with its line
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
                implementation=args.attention,
                progress=True,
                mesh=mesh,
                scan_layers=args.scan_layers,
            )
            rows.append(dataclasses.asdict(r))
            if not args.json:
                print(
                    f"{name:>10} ctx={ctx:>6}: {r.ms_per_step:8.2f} ms/step "
                    f"{r.tokens_per_s:9.1f} tok/s, policy alone {r.policy_ms_per_step:.3f} ms, "
                    f"first call {r.first_call_s:.1f} s{' (layer scan)' if r.scan_layers else ''}"
                    + (f", KVJAX_TUNING {r.tuning}" if r.tuning else ""),
                    flush=True,
                )
                if r.mesh is not None:
                    print(
                        f"{'':>10} mesh {r.mesh}: live KV per device "
                        f"{r.live_kv_bytes_per_device} B, collectives {r.collectives_per_step}",
                        flush=True,
                    )
    emit(rows, as_json=args.json, title="decode benchmark", out=args.out)
    return 0
