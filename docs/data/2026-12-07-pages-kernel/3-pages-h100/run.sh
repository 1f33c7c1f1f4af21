#!/usr/bin/env bash
# compiled tests of the 8-token-page kernel (+ INT8 slots-on-M odd G), QEvict's read shape
# (B 8, page 8, one value group), then qevict's decode step without / with "pages"
set -u
export COLUMNS=200
O=$OUT
OUT=$O/t KTESTS="test_mgpu_pages.py test_mgpu_tm.py" KSELECT="not Interpret and not dispatch and (Pages or int8)" \
  BATCHES=8 CONTEXTS="16384 32768" KERNEL_ARGS="--page 8 --value-group 128" \
  ROWS="cudnn-bf16 pallas-int2+logits mgpu-pages-int2+logits pallas-int2 mgpu-pages-int2 pallas-int4+logits mgpu-pages-int4+logits" \
  SWEEP="stages=2,3 num_splits=8,16" SWEEP_ROWS="mgpu-pages-int2+logits" \
  bash scripts/gpu_bench.sh kernel > $O/t.log 2>&1
grep -E "passed|failed" $O/t/kernel_tests.txt | tail -3
grep -E "^FAILED|Error" $O/t/kernel_tests.txt | head -8 | cut -c1-300
grep -E "^B=" $O/t/kernel.txt | cut -c1-120
for r in a b; do
  case $r in a) T= ;; b) T=mgpu_tiers=pages ;; esac
  echo "# $r KVJAX_TUNING=$T"
  OUT=$O/t/$r KVJAX_TUNING=$T ROW_TIMEOUT=120 ROWS=qevict bash scripts/gpu_bench.sh decode-scan 2>&1 | grep -E "ms/step|row |Error" | tail -2
done
tar czf $O/t.tgz -C $O t && rm -rf $O/t
