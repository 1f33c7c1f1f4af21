#!/usr/bin/env bash
# compiled INT8 slots-on-M tests, kernel rows with logits, then confkv a/b/a/b interleaved
set -u
O=$OUT
OUT=$O/t KTESTS="test_mgpu_tm.py test_attend_pallas.py" KSELECT="(int8 or slots_on_m) and not Interpret" \
  SKIP_TESTS= BATCHES=8 CONTEXTS="16384 32768" ROWS="pallas-int8+logits mgpu-tm-int8+logits pallas-int8 mgpu-tm-int8" \
  bash scripts/gpu_bench.sh kernel 2>&1 | grep -vE "^\s*$" | tail -30
for r in a b c d; do
  case $r in a|c) T= ;; b|d) T=mgpu_tiers=int8-tm ;; esac
  echo "# $r KVJAX_TUNING=$T"
  OUT=$O/$r KVJAX_TUNING=$T ROW_TIMEOUT=100 ROWS=confkv bash scripts/gpu_bench.sh decode-scan 2>&1 | grep -E "ms/step|row |Error" | tail -4
done
