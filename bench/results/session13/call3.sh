#!/bin/bash
# Session 13, call 3 (one H200): after the searchsorted fix (no XLA while loops in the work lists) and with
# bench/moe.py's gmm harness matching the dense one: JAX's Mosaic GPU tgmm probe, synced / pipelined /
# profiled times (moe_timing.py), then bench/moe.py's same-run table at 8K.
PYTHONUNBUFFERED=1 timeout 300 python3 bench/moe_timing.py --mgpu --out $OUT/moe_timing 2>&1 | tee $OUT/call3_timing.log
rm -rf $OUT/moe_timing/profile_*
PYTHONUNBUFFERED=1 timeout 240 python3 bench/moe.py --tokens 8192 --models m2,m3 --no-sweep \
  --variants pallas_gpu_gmm,dense_matmul,pallas_gpu --budget-s 200 --out $OUT/moe 2>&1 | grep -v "^{" | tee $OUT/call3_moe.log
