#!/bin/bash
# Session 13, call 4 (one H200): where the ~1.2 ms between the synced time and the device span of the M2 8K
# grouped-matmul fwd+bwd goes: the same timing with XLA's command buffers (CUDA graphs) on (default) and off,
# and the host trace of one profiled call kept.
cd $(dirname $0)/../../..
PYTHONUNBUFFERED=1 timeout 150 python3 bench/moe_timing.py --models m2 --variants pallas_gpu_gmm,dense_matmul,pallas_gpu \
  --out $OUT/default 2>&1 | grep -v '^{' | tee $OUT/call4_default.log
mkdir -p $OUT/traces; for d in $OUT/default/profile_*; do f=$(find $d -name 'perfetto_trace.json.gz' | head -1); \
  [ -n "$f" ] && cp $f $OUT/traces/$(basename $d).json.gz; done; rm -rf $OUT/default/profile_*
XLA_FLAGS=--xla_gpu_enable_command_buffer= PYTHONUNBUFFERED=1 timeout 150 python3 bench/moe_timing.py --models m2 \
  --variants pallas_gpu_gmm,dense_matmul,pallas_gpu --out $OUT/nocmdbuf 2>&1 | grep -v '^{' | tee $OUT/call4_nocmdbuf.log
rm -rf $OUT/nocmdbuf/profile_*
