#!/usr/bin/env bash
# H200: kernel card (B8 16K/32K/64K, then B1 32K with a splits sweep). H100: ncu of INT2 words + pages kernel.
export COLUMNS=200
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "GPU: $gpu"; date -u
if [[ "$gpu" == *H200* ]]; then
  SKIP_TESTS=1 OUT=$OUT/b8 BATCHES=8 CONTEXTS="16384 32768 65536" ROWS="copy cudnn-bf16 pallas-bf16 mgpu-tm-bf16 pallas-int8 mgpu-tm-int8 mgpu-int4-words mgpu-int2-words" bash scripts/gpu_bench.sh kernel > /tmp/b8.log 2>&1
  date -u
  SKIP_TESTS=1 OUT=$OUT/b1 BATCHES=1 CONTEXTS="32768" ROWS="copy cudnn-bf16 pallas-bf16 pallas-bf16-fc mgpu-tm-bf16 pallas-int8 mgpu-tm-int8" SWEEP="num_splits=16,32,64,128" SWEEP_ROWS="pallas-bf16-fc mgpu-tm-bf16" bash scripts/gpu_bench.sh kernel > /tmp/b1.log 2>&1
  date -u
  cp /tmp/b8.log /tmp/b1.log $OUT/
  grep -v "^+\|^$" /tmp/b8.log | tail -40; tail -30 /tmp/b1.log
else
  OUT=$OUT/ncu bash scripts/gpu_bench.sh ncu-source mgpu-int2-words 8 32768 > /tmp/n1.log 2>&1
  PAGE=8 VALUE_GROUP=128 OUT=$OUT/ncu bash scripts/gpu_bench.sh ncu-source mgpu-pages-int2+logits 8 16384 > /tmp/n2.log 2>&1
  date -u
  cd $OUT/ncu && ls -la && tar czf ../ncu.tgz . && cd .. && rm -rf ncu
  tail -5 /tmp/n1.log /tmp/n2.log
fi
