#!/usr/bin/env bash
# compiled INT8 slots-on-M tests, then kernel rows with logits (B8 16K/32K), packed in one tar
set -u
export COLUMNS=200
O=$OUT
OUT=$O/t KTESTS="test_mgpu_tm.py test_attend_pallas.py" KSELECT="(int8 or slots_on_m) and not Interpret" \
  BATCHES=8 CONTEXTS="16384 32768" ROWS="pallas-int8+logits mgpu-tm-int8+logits pallas-int8 mgpu-tm-int8" \
  bash scripts/gpu_bench.sh kernel > $O/t.log 2>&1
grep -E "passed|failed" $O/t/kernel_tests.txt | tail -3
grep -E "pallas-int8|mgpu-tm-int8" $O/t/kernel.txt | cut -c1-200
tar czf $O/t.tgz -C $O t && rm -rf $O/t
