"""Shared CLI plumbing: model loading, policy flags, output as JSON or a table."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import sys
from typing import Any

import jax.numpy as jnp

from kvjax.policies import BUDGETLESS, POLICIES, Policy, make_policy

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="GGUF file or Hugging Face safetensors folder (default: the embedded "
        "SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=sorted(DTYPES),
        help="weights and cache dtype (default float32)",
    )


def add_policy_args(p: argparse.ArgumentParser, *, multi: bool = False) -> None:
    if multi:
        p.add_argument(
            "--policy",
            nargs="+",
            default=["full", "window"],
            help=f"policies ({', '.join(sorted(POLICIES))})",
        )
    else:
        p.add_argument("--policy", default="full", help=f"one of {', '.join(sorted(POLICIES))}")
    p.add_argument(
        "--budget",
        type=int,
        default=None,
        help="tokens kept per KV head per layer (all policies but full)",
    )
    p.add_argument("--sinks", type=int, default=None, help="attention sinks (streaming)")
    p.add_argument(
        "--int8",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="confkv: store retained tokens older than the fp window in INT8 (default on)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="any policy hyperparameter, e.g. --set tau=0.6 --set protected=16",
    )


def add_scan_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--scan-layers",
        action="store_true",
        help="run the layers in one lax.scan over a stacked cache: compiled once, not per layer "
        "(a shorter first call, the same results; not for per-layer budgets; docs/compile.md)",
    )


def check_scan(policy: Policy, args: argparse.Namespace) -> None:
    """With --scan-layers, one clear error (exit 2) for a policy that cannot scan its layers
    (the library's own check, run before the model loads)."""
    if getattr(args, "scan_layers", False):
        from kvjax.generate._step import check_scannable  # the library, only when asked

        check_scannable(policy, "--scan-layers")


def policy_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Hyperparameters given on the command line (--sinks, --int8, --set k=v; a value is a
    Python literal, true/false in any case a bool, anything else a string)."""
    kwargs: dict[str, Any] = {}
    if getattr(args, "sinks", None) is not None:
        kwargs["sinks"] = args.sinks
    if getattr(args, "int8", None) is not None:
        kwargs["int8"] = args.int8
    for item in getattr(args, "set", []):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects FIELD=VALUE, got {item!r}")
        if value.lower() in ("true", "false"):  # --set position_shift=true
            kwargs[key] = value.lower() == "true"
            continue
        try:
            kwargs[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            kwargs[key] = value
    return kwargs


def build_policy(name: str, args: argparse.Namespace, num_layers: int | None = None) -> Policy:
    """The policy named on the command line, with its flags (validated: bad values raise).

    A `--budget` shared by several policies (`--policy full window`) applies to those that take
    one; given to a single policy that takes none (`full`, `kivi`) it is an error."""
    shared = isinstance(getattr(args, "policy", None), list)
    return make_policy(
        name,
        None if shared and name in BUDGETLESS else args.budget,
        num_layers=num_layers,
        **policy_kwargs(args),
    )


def say(message: str) -> None:
    """One progress line on stderr (shown whatever the output format)."""
    print(f"[kvjax] {message}", file=sys.stderr, flush=True)


def load(args: argparse.Namespace):
    from kvjax.weights import load_model

    say(f"loading {args.model or 'the embedded SmolLM2-135M-Instruct'}")
    return load_model(args.model, dtype=DTYPES[args.dtype])


def emit(
    rows: list[dict[str, Any]] | dict[str, Any],
    *,
    as_json: bool,
    title: str,
    out: str | None = None,
) -> None:
    """Print JSON (machine-readable) or a table; optionally also write JSON to a file."""
    if dataclasses.is_dataclass(rows):
        rows = dataclasses.asdict(rows)
    text = json.dumps(rows, indent=2)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    if as_json:
        print(text)
        return
    from rich.console import Console
    from rich.table import Table

    items = rows if isinstance(rows, list) else [rows]
    table = Table(title=title)
    keys = list(items[0])
    for k in keys:
        table.add_column(k)
    for r in items:
        table.add_row(*(_fmt(r[k]) for k in keys))
    # The terminal's width (80 columns when not a terminal): cells wrap instead of the table.
    Console(file=sys.stdout).print(table)


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.4g}" if abs(x) < 1e5 else f"{x:.4e}"
    return str(x)
