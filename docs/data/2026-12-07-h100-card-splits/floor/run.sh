#!/usr/bin/env bash
# The Triton split floor A/B (KVJAX_TUNING=split_min_blocks=32 against the defaults) at B = 1 (32K) and B = 8 (16K),
# interleaved; the slots-on-M INT8 kernel at its new floor; lean barriers A/B on the words kernels (32K).
export COLUMNS=200
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "GPU: $gpu"; date -u
K() { local name=$1; shift; env "$@" OUT=$OUT/$name bash scripts/gpu_bench.sh kernel > /tmp/$name.log 2>&1; date -u; grep "us " /tmp/$name.log | grep -v "│" | tail -${TAILN:-40}; sed -i '/WARNING: Target directory/d' /tmp/$name.log; cp /tmp/$name.log $OUT/; cp $OUT/$name/kernel.json $OUT/$name.json 2>/dev/null; rm -rf $OUT/$name; }
for f in 1 32; do
  K b1_f$f KVJAX_TUNING=split_min_blocks=$f SKIP_TESTS=1 BATCHES=1 CONTEXTS="32768" ROWS="cudnn-bf16 pallas-bf16-fc pallas-int8 mgpu-tm-int8+logits"
  K b8_f$f KVJAX_TUNING=split_min_blocks=$f SKIP_TESTS=1 BATCHES=8 CONTEXTS="16384" ROWS="cudnn-bf16 pallas-bf16 pallas-int8"
done
K lean SKIP_TESTS=1 BATCHES=8 CONTEXTS="32768" ROWS="mgpu-int4-words mgpu-int2-words" SWEEP="lean_barriers=1,0,1" SWEEP_ROWS="mgpu-int4-words mgpu-int2-words"
