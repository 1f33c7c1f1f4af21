"""The `kvjax` command line."""

from __future__ import annotations

import argparse
import sys

from kvjax._compile_cache import (
    ENV_VAR,
    default_cache_dir,
    enable_compilation_cache,
    prefer_cublas_for_scan,
)
from kvjax.cli import (
    _bench,
    _compare,
    _confkl,
    _demo,
    _diagnostics,
    _generate,
    _niah,
    _ppl,
    _ruler,
    _stream,
    _train,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvjax", description="Bounded, compressed KV caches for jit-compiled decoding."
    )
    _add_cache_arg(parser, default=None)
    sub = parser.add_subparsers(dest="command", required=True)
    for mod in (
        _demo,
        _generate,
        _ppl,
        _compare,
        _bench,
        _niah,
        _confkl,
        _diagnostics,
        _train,
        _stream,
        _ruler,
    ):
        mod.register(sub)
    for leaf in _leaf_parsers(sub):  # also accepted after the command
        _add_cache_arg(leaf, default=argparse.SUPPRESS)
    return parser


def _add_cache_arg(p: argparse.ArgumentParser, *, default) -> None:
    p.add_argument(
        "--compilation-cache",
        default=default,
        metavar="DIR|off",
        help=f"JAX's persistent compilation cache directory, or 'off' (default: "
        f"${ENV_VAR}, else {default_cache_dir()})",
    )


def _leaf_parsers(sub: argparse._SubParsersAction) -> list[argparse.ArgumentParser]:
    """Every command's parser, nested subcommands (bench decode) included."""
    leaves = []
    for p in sub.choices.values():
        nested = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        leaves += [x for n in nested for x in _leaf_parsers(n)] if nested else [p]
    return leaves


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `kvjax` command. Bad input exits with status 2 and one clear line."""
    args = build_parser().parse_args(argv)
    if getattr(args, "scan_layers", False):
        prefer_cublas_for_scan()  # before anything starts the GPU backend
    try:
        enable_compilation_cache(args.compilation_cache)
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


__all__ = ["build_parser", "main"]
