#!/usr/bin/env bash
# decode-scan A/B (B8 32K, 20% bytes): default vs full tier on the slots-on-M kernel vs 4 splits.
export COLUMNS=200
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "GPU: $gpu"; date -u
mkdir -p $OUT/ab
for cfg in "d:" "tm:mgpu_tiers=full-tm" "tp:target_programs=256"; do
  n=${cfg%%:*} t=${cfg#*:}
  OUT=$OUT/ab/$n KVJAX_TUNING=$t ROWS="full kvpop" ROW_TIMEOUT=85 bash scripts/gpu_bench.sh decode-scan > $OUT/ab/$n.log 2>&1
  date -u; echo "== $n ($t)"; grep -h "ms/step\|^row\|rror" $OUT/ab/$n.log | tail -6
done
cd $OUT && tar czf ab.tgz ab && rm -rf ab
