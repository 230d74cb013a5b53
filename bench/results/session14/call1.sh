#!/bin/bash
# Session 14, call 1 (one H200): first run of the warp-specialized Mosaic GPU tgmm (gpu_tgmm_ws.py):
# correctness vs the Triton tgmm and an fp32 oracle, kernel timings at M2/M3 8K weight-gradient shapes,
# and the grouped-matmul fwd+bwd with each tgmm vs the dense matmul (3 interleaved rounds).
PYTHONUNBUFFERED=1 timeout 540 python3 bench/tgmm_ws_probe.py 2>&1 | tee $OUT/call1.log | grep -v "^{\|^  " 
