#!/usr/bin/env bash
export COLUMNS=200
nvidia-smi --query-gpu=name --format=csv,noheader | head -1; date -u
SKIP_TESTS=1 OUT=$OUT/k6592 BATCHES=8 CONTEXTS="6592" ROWS="copy cudnn-bf16 pallas-bf16 pallas-bf16-join mgpu-tm-bf16 mgpu-tm-bf16-join" SWEEP="stages=2,4,6 num_splits=4,6,8" SWEEP_ROWS="mgpu-tm-bf16" bash scripts/gpu_bench.sh kernel 2>&1 | grep -v "^+" | tail -20
date -u
