#!/usr/bin/env bash
# Where kvpop's and full's layer-scan steps go (B=8, 32K, 32 layers): kernel tables from profiler traces.
export COLUMNS=200
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "GPU: $gpu"; date -u
export XLA_FLAGS=--xla_gpu_enable_triton_gemm=false
for pol in kvpop:6554 full:32785; do
  STACKED=1 OUT=$OUT/trace bash scripts/gpu_bench.sh trace-decode 32 $pol 8 > /tmp/t_${pol%%:*}.log 2>&1
  date -u; tail -45 /tmp/t_${pol%%:*}.log; cp /tmp/t_${pol%%:*}.log $OUT/
done
