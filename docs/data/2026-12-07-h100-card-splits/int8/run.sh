#!/usr/bin/env bash
# The Triton INT8 kernel at 8 and 64 splits against its default (17 at B = 8, 132 at B = 1), two calls.
export COLUMNS=200
SKIP_TESTS=1 OUT=$OUT/i8 BATCHES="8 1" CONTEXTS="32768 65536" ROWS="cudnn-bf16 pallas-int8" SWEEP="num_splits=8,64" SWEEP_ROWS="pallas-int8" bash scripts/gpu_bench.sh kernel   # kernel_32k_64k.json
SKIP_TESTS=1 OUT=$OUT/i8 BATCHES="8 1" CONTEXTS="16384" ROWS="cudnn-bf16 pallas-int8" SWEEP="num_splits=8,64" SWEEP_ROWS="pallas-int8" bash scripts/gpu_bench.sh kernel         # kernel_16k.json
