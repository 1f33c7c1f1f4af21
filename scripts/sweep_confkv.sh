#!/usr/bin/env bash
# Small sweep of CONF-KV's unpublished parameters (tau, recency weight) on a tuning essay that is
# not used for the reported results. Writes one JSON per setting under $OUT (default
# docs/data/sweep_confkv); docs/results.md summarises it.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/data/sweep_confkv}
TEXT=${TEXT:-addiction.txt}
TOKENS=${TOKENS:-1024}
BUDGET=${BUDGET:-256}
mkdir -p "$OUT"
for tau in 0.3 0.5 0.7; do
  for lam in 0 0.01 0.1 1.0; do
    .venv/bin/kvjax ppl --policy confkv --budget "$BUDGET" --tokens "$TOKENS" --text "$TEXT" \
      --cache-dtype bfloat16 --set tau=$tau --set recency_weight=$lam --json \
      --out "$OUT/tau${tau}_lam${lam}.json" > /dev/null
    echo "tau=$tau lambda=$lam: $(python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(round(d['ppl'],3), int(d['live_bytes_mean']))" "$OUT/tau${tau}_lam${lam}.json")"
  done
done
