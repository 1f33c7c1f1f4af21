"""Counts what one iteration of a compiled decode loop launches, from HLO text files (e.g. those
`DUMP_HLO=DIR scripts/find_cache_copies.py` writes).

Usage: python scripts/hlo_launches.py FILE...
"""

import sys

from kvjax.eval._bench import hlo_loop_launches

for path in sys.argv[1:]:
    with open(path) as f:
        counts = hlo_loop_launches(f.read())
    print(f"{path}: {sum(counts.values())} per iteration {dict(sorted(counts.items()))}")
