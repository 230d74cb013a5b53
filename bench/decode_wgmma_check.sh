#!/usr/bin/env bash
# One device call: the Hopper decode kernel's GPU tests, then the serving cells of bench/msa_decode.py with the
# default tiling (wgmma tiles on Hopper), wgmma without ping-pong and the Triton tiling side by side (Q = 8), then the
# Q = 1 baseline (Triton tiles); with CORR_S > 0 also the wgmma Q = 8 cells with correlated draft rows
# (--serving-row-corr 0.97) for that many seconds. The serving check takes a few minutes before the first cell.
# Run from the repository root with OUT set (the device tool's output folder).
set -u
export PYTHONUNBUFFERED=1   # a timeout must not swallow the rows already printed
: "${OUT:?set OUT to the output folder}"
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name --format=csv,noheader
timeout "${TEST_S:-150}" python3 -m pytest -q -x tests/kernels/decode/test_decode_wgmma.py -k hopper > "$OUT/tests.log" 2>&1
echo "tests rc $?"; tail -3 "$OUT/tests.log"
timeout "${Q8_S:-280}" python3 bench/msa_decode.py --contexts "" --serving --serving-first "${CELLS:-64x4096,128x5120}" \
    --serving-batches "" --serving-contexts "" --serving-q 8 --serving-tilings "${TILINGS:-default,wgmma_nopp,triton}" \
    --out "$OUT/q8" > "$OUT/q8.log" 2>&1
echo "q8 rc $?"
timeout "${Q1_S:-100}" python3 bench/msa_decode.py --contexts "" --serving --serving-first "${CELLS:-64x4096,128x5120}" \
    --serving-batches "" --serving-contexts "" --serving-q 1 --serving-tilings default --out "$OUT/q1" > "$OUT/q1.log" 2>&1
echo "q1 rc $?"
if [ "${CORR_S:-0}" -gt 0 ]; then   # optional: MTP-like correlated draft rows (the demo's rows behave like c ~ 0.97)
    timeout "$CORR_S" python3 bench/msa_decode.py --contexts "" --serving --serving-first "${CELLS:-64x4096,128x5120}" \
        --serving-batches "" --serving-contexts "" --serving-q 8 --serving-tilings wgmma --serving-row-corr 0.97 \
        --out "$OUT/corr" > "$OUT/corr.log" 2>&1
    echo "corr rc $?"
fi
for f in "$OUT/q8.log" "$OUT/q1.log" "$OUT/corr.log"; do
    [ -f "$f" ] && grep -h "^serving {" "$f" | sed "s|^serving |$(basename "$f" .log) |"
done | python3 -c '
import json, sys
print("run | batch x ctx | Q | tiling | index | dense ms | msa ms | x")
for line in sys.stdin:
    run, rest = line.split(" ", 1)
    d = json.loads(rest)
    print("%s | %sx%s | %s | %s | %s | %.4f | %.4f | %.3f" % (run, d["batch"], d["context"], d["q_rows"], d["tiling"],
                                                          d["index_dtype"], d["dense_ms"], d["msa_ms"], d["speedup"]))'
