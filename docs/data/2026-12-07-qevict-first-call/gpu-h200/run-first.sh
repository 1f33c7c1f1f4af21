#!/usr/bin/env bash
# qevict's decode step (B 8, 32K, layer scan) after its move loop went inside the routing event
set -u
OUT=$OUT/q ROW_TIMEOUT=150 ROWS=qevict bash scripts/gpu_bench.sh decode-scan 2>&1 | grep -E "ms/step|row |Error" | tail -3
