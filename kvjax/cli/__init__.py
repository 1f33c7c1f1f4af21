"""The `kvjax` command line."""

from __future__ import annotations

import argparse
import sys

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
    _train,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvjax", description="Bounded, compressed KV caches for jit-compiled decoding."
    )
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
        _ruler,
    ):
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `kvjax` command. Bad input exits with status 2 and one clear line."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


__all__ = ["build_parser", "main"]
