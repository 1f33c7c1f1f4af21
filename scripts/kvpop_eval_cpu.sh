#!/usr/bin/env bash
# KVpop's evaluation grid (issue 6) on the CPU, float32 model, bf16 cache: perplexity and NIAH
# at 75% (budget 512) and 88% (budget 256) compression of a 2048-token context, for kvpop,
# kvpop-mlp, streaming, tova, h2o, confkv (+INT8, at matched peak bytes) and qevict, plus the
# immediate-read ablation. The perplexity grid on avg.txt is `kvjax compare` (below, first
# line); this script runs the rest. Results land in $OUT (docs/data/kvpop_eval by default).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/data/kvpop_eval}
mkdir -p "$OUT"
kv() { ${KV:-.venv/bin/kvjax} "$@"; }  # KV: another kvjax command
IMM=docs/data/kvpop/kvpop_mlstm_immediate_smollm2_135m.msgpack
ROWS="full streaming tova h2o confkv+int8 qevict kvpop kvpop-mlp"
[ -n "${SKIP_AVG:-}" ] || kv compare --windows 256 512 --tokens 2048 --rows $ROWS \
  --out-dir "$OUT/compare_avg" --json > /dev/null
for b in 256 512; do  # the ablation: the mLSTM scorer trained with the immediate read
  kv ppl --policy kvpop --budget $b --set scorer=$IMM --tokens 2048 --cache-dtype bfloat16 \
    --json --out "$OUT/ppl_kvpop-immediate_b$b.json" > /dev/null
done
# NIAH, query-aware protocol, 2048 tokens, needle at depths 0/50/100. confkv gets the budget
# whose peak live bytes match (424 / 906: `kvjax compare`'s matching, see compare_avg; 425 / 907
# before exact budgets, 2026-12-01).
niah() { kv niah --lengths 2048 --depths 0 50 100 --protocol query-aware --json "$@"; }
for pb in "256 424" "512 906"; do
  set -- $pb
  niah --policy kvpop kvpop-mlp streaming tova h2o qevict --budget "$1" --out-dir "$OUT/niah" \
    > "$OUT/niah_b$1.json"
  niah --policy confkv --budget "$2" --out-dir "$OUT/niah" > "$OUT/niah_confkv_b$2.json"
  niah --policy kvpop --budget "$1" --set scorer=$IMM --out-dir "$OUT/niah_immediate" \
    > "$OUT/niah_kvpop-immediate_b$1.json"
done
niah --policy full --out-dir "$OUT/niah" > "$OUT/niah_full.json"
# A second held-out essay (never trained on or tuned on), the same perplexity grid.
kv compare --windows 256 512 --tokens 2048 --rows $ROWS --text boss.txt \
  --out-dir "$OUT/compare_boss" --json > /dev/null
