#!/bin/bash
# Session 13, call 1 (one H200): chunked tgmm sweep at M2 8K, the adopted config in the M2/M3 8K table
# next to the dense matmul, and a kernel-level profile of the fwd+bwd.
set -x
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv
PYTHONUNBUFFERED=1 timeout 400 python3 bench/moe.py --tokens 8192 --models m2,m3 \
  --variants pallas_gpu_gmm,dense_matmul --sweep-kernels tgmm --budget-s 230 --profile 3 --out $OUT/moe \
  2>&1 | grep -v "^{" | tee $OUT/call1.log
