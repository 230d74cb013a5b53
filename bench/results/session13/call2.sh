#!/bin/bash
# Session 13, call 2 (one H200): synced vs pipelined vs profiled device time of the M2/M3 8K grouped
# matmuls and the dense baseline, idle gaps in the profiled call, JAX's Mosaic GPU transposed ragged dot
# vs our tgmm. Traces copied flat to $OUT/traces.
PYTHONUNBUFFERED=1 timeout 420 python3 bench/moe_timing.py --mgpu --out $OUT/moe_timing 2>&1 | tee $OUT/call2.log
mkdir -p $OUT/traces
for d in $OUT/moe_timing/profile_*; do
  f=$(find $d -name 'perfetto_trace.json.gz' | head -1); [ -n "$f" ] && cp $f $OUT/traces/$(basename $d).json.gz
done
rm -rf $OUT/moe_timing/profile_*
ls -la $OUT/traces
