#!/usr/bin/env bash
# The kernel card (B=8 16K/32K/64K; B=1 32K with a splits sweep), then knob sweeps of the words kernels.
export COLUMNS=200
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "GPU: $gpu"; date -u
K() { local name=$1; shift; env "$@" OUT=$OUT/$name bash scripts/gpu_bench.sh kernel > /tmp/$name.log 2>&1; date -u; grep -v "^+\|^$" /tmp/$name.log | tail -${TAILN:-30}; cp /tmp/$name.log $OUT/; }
K b8 SKIP_TESTS=1 BATCHES=8 CONTEXTS="16384 32768 65536" ROWS="copy cudnn-bf16 pallas-bf16 mgpu-tm-bf16 pallas-int8 mgpu-tm-int8 mgpu-int4-words mgpu-int2-words"
K b1 SKIP_TESTS=1 BATCHES=1 CONTEXTS="32768" ROWS="copy cudnn-bf16 pallas-bf16 pallas-bf16-fc mgpu-tm-bf16 pallas-int8 mgpu-tm-int8 mgpu-tm-int8+logits" SWEEP="num_splits=16,32,64" SWEEP_ROWS="pallas-bf16-fc mgpu-tm-bf16 mgpu-tm-int8+logits"
K wsweep SKIP_TESTS=1 BATCHES=8 CONTEXTS="32768" ROWS="copy cudnn-bf16 mgpu-int4-words mgpu-int2-words" SWEEP="pages_per_step=1,2 lean_barriers=0,1" SWEEP_ROWS="mgpu-int4-words mgpu-int2-words"
K wsweep2 SKIP_TESTS=1 BATCHES=8 CONTEXTS="32768" ROWS="mgpu-int4-words mgpu-int2-words" SWEEP="overlap=1 stages=2,3,4" SWEEP_ROWS="mgpu-int4-words mgpu-int2-words"
