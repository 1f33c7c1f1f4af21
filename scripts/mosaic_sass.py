"""Main-loop SASS instruction counts of the Mosaic GPU kernels a run dumped (a kernel-development
aid: where a page's instructions go).

Usage: MOSAIC_GPU_DUMP_TO=DIR <any run that compiles Mosaic GPU kernels>; then
       python scripts/mosaic_sass.py DIR [--per N] [--top K]
For every dumped file holding SASS: the kernel's name, the instructions of its main loop (the
longest backward branch, `kvjax.eval._kernel_ir.sass_loop_stats`) per iteration (--per: the
loop's tokens, e.g. 64 for one 64-token page, to print per token instead), and its K most
frequent opcodes. JSON lines on stdout.
"""

import argparse
import json
import pathlib
import re
import sys

from kvjax.eval._kernel_ir import sass_loop_stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=pathlib.Path)
    ap.add_argument("--per", type=int, default=1, help="tokens a loop iteration covers")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    if not args.dir.is_dir():
        raise SystemExit(f"mosaic_sass: {args.dir} is not a directory")
    found = 0
    for path in sorted(args.dir.rglob("*")):
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        if not re.search(r"/\*[0-9a-f]{4,}\*/\s+[A-Z]", text):
            continue
        found += 1
        try:
            stats = sass_loop_stats(text, args.per)
        except ValueError as e:
            print(json.dumps(dict(file=path.name, error=str(e))))
            continue
        ops = dict(list(stats["ops"].items())[: args.top])
        print(json.dumps(dict(file=path.name, loop=stats["instructions"], ops=ops)))
    if not found:
        raise SystemExit(f"mosaic_sass: no SASS in {args.dir}")


if __name__ == "__main__":
    sys.exit(main())
