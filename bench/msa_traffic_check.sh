#!/usr/bin/env bash
# One device call for issue 26's memory-traffic options at M3 128K: the wgmma forward with smaller query passes
# (each kv group's q rows of a pass may then stay in L2; the default pass is sized by the 4 GiB partials budget)
# and the KV-outer backward with bf16 dq partials (half their write + read traffic) or smaller query passes.
# Each probe checks before it times. Run from the repository root with OUT set; per-part caps in seconds.
set -u
: "${OUT:?set OUT to the output folder}"
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name --format=csv,noheader
timeout "${FWD_S:-200}" python3 bench/msa_wgmma_probe.py --quick --query-chunks "${FWD_QC:-8192,4096}" \
    --out "$OUT/fwd" > "$OUT/fwd.log" 2>&1
echo "fwd rc $?"; tail -12 "$OUT/fwd.log"
timeout "${BWD_S:-330}" python3 bench/msa_bwd_probe.py --cases m3:131072 --out "$OUT/bwd" --variants \
    "${BWD_VARIANTS:-rows=32,num_warps=8;rows=32,num_warps=8,dq_partial_bits=16;rows=32,num_warps=8,query_chunk=2048}" \
    > "$OUT/bwd.log" 2>&1
echo "bwd rc $?"; tail -12 "$OUT/bwd.log"
