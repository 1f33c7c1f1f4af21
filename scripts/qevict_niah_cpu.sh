#!/usr/bin/env bash
# NIAH at 2K tokens for QEvict and the methods it is compared with, at byte budgets of 5%, 10%
# and 20% of the full 2048-token cache: 102, 205, 410 bf16 tokens per KV head and layer. Each
# policy gets the budget whose peak live bytes match (the same rule as `kvjax compare`):
# qevict and h2o 102/205/410, confkv (+INT8) 134/328/714 (exact budgets: a budget counts the
# attended current token; 135/329/715 before 2026-12-01); kivi has no budget. CPU, float32 model.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/data/niah_qevict_2k}
mkdir -p "$OUT"
# KV: another kvjax command (default the checkout's .venv)
niah() { ${KV:-.venv/bin/kvjax} niah --lengths 2048 --depths 0 50 100 --protocol both --out-dir "$OUT" \
  --json "$@"; }
for pb in "102 134" "205 328" "410 714"; do
  set -- $pb
  niah --policy qevict h2o --budget "$1" > "$OUT/summary_qevict_h2o_b$1.json"
  niah --policy confkv --budget "$2" > "$OUT/summary_confkv_b$2.json"
done
niah --policy kivi > "$OUT/summary_kivi.json"
