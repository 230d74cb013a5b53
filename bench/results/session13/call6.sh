#!/bin/bash
# Session 13, call 6 (one H200): the final same-run table after this session's changes (no XLA while loops
# in the work lists, no row mask after the Pallas kernels in the MoE layer): grouped matmuls, the whole
# MoE layer and the dense matmul at 8K / 32K / 64K tokens, with 3 interleaved gmm / dense rounds each.
PYTHONUNBUFFERED=1 timeout 330 python3 bench/moe.py --tokens 8192,32768,65536 --models m2,m3 --no-sweep \
  --variants pallas_gpu_gmm,dense_matmul,pallas_gpu --rounds 3 --budget-s 280 --out $OUT/moe 2>&1 \
  | grep -v "^{" | tee $OUT/call6_moe.log
