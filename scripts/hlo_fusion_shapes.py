"""The shapes behind kernel names of a profiler trace: for each NAME, the line of the optimized
HLO (an XLA dump, `--xla_dump_to=DIR --xla_dump_hlo_as_text`) that defines that fusion, its
operand and result shapes and op metadata, and the first lines of the computation it calls.
A debugging aid beside `gpu_bench.sh trace-decode`.

Usage: python scripts/hlo_fusion_shapes.py DUMP_FILE NAME... [--lines N]
"""

import re
import sys


def main() -> None:
    args = sys.argv[1:]
    lines = 12
    if "--lines" in args:
        i = args.index("--lines")
        lines = int(args[i + 1])
        del args[i : i + 2]
    path, names = args[0], args[1:]
    with open(path) as f:
        text = f.read()
    for name in names:
        # A trace names fusion.N as fusion_N: try both spellings.
        spellings = [name, re.sub(r"_(\d+)$", r".\1", name)]
        m = None
        for sp in spellings:
            m = m or re.search(r"^\s*(ROOT )?%" + re.escape(sp) + r" = .*$", text, re.M)
        if not m:
            print(f"{name}: not found")
            continue
        line = m.group(0).strip()
        print(f"== {name}\n{line[:700]}")
        called = re.search(r"calls=%([\w.\-]+)", line)
        if called:
            body = re.search(r"^%" + re.escape(called.group(1)) + r" .*?^}", text, re.M | re.S)
            if body:
                for row in body.group(0).splitlines()[1 : lines + 1]:
                    print("   ", re.sub(r", metadata=\{.*?\}", "", row.strip())[:300])


if __name__ == "__main__":
    main()
