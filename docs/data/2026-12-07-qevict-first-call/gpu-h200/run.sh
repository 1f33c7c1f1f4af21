#!/usr/bin/env bash
# qevict's decode step, before (8e5e6e8, staged from _base/) and after its move loop went
# inside the routing event (HEAD), interleaved
set -u
O=$OUT
for r in base head; do
  d=.; case $r in base*) d=_base ;; esac
  echo "# $r"
  (cd $d && OUT=$O/$r ROW_TIMEOUT=150 ROWS=qevict bash scripts/gpu_bench.sh decode-scan 2>&1 | grep -E "ms/step|row |Error" | tail -1)
done
