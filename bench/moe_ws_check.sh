#!/usr/bin/env bash
# One device call for issue 29's kernels: bench/moe.py's tile sweep with the warp-specialized Mosaic GPU weight
# gradient beside the Triton configs (each checked against the first config), then the 8K
# grouped matmuls with the adopted configs in interleaved rounds with the dense matmul; bench/moe_fp8.py (FP8
# experts dequantised in the kernel vs bf16, decode and prefill sizes); the 8K dense training step (its MoE now
# runs the warp-specialized weight gradient by default on Hopper).
# Run from the repository root with OUT set (the device tool's output folder); per-part caps in seconds.
set -u
export PYTHONUNBUFFERED=1   # a timeout must not swallow the rows already printed
: "${OUT:?set OUT to the output folder}"
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name --format=csv,noheader
start=$SECONDS
timeout "${MOE_S:-300}" python3 bench/moe.py --models m2,m3 --tokens 8192 --variants pallas_gpu_gmm,dense_matmul \
    --rounds 3 --reps 5 --out "$OUT/moe" > "$OUT/moe.log" 2>&1
rc=$?; echo "moe rc $rc"; grep -E "sweep adopted|Pallas configs|ratio" "$OUT/moe.log" | tail -12
left=$(( ${MOE_S:-300} - (SECONDS - start) ))
if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && [ "$left" -gt 60 ]; then
    # a device fault in a warp-specialized kernel ends the process: the Triton-only sweep with the time left
    tail -5 "$OUT/moe.log"
    timeout "$left" python3 bench/moe.py --models m2,m3 --tokens 8192 --variants pallas_gpu_gmm,dense_matmul \
        --rounds 3 --reps 5 --no-ws --out "$OUT/moe_triton" > "$OUT/moe_triton.log" 2>&1
    echo "moe (Triton only) rc $?"; grep -E "sweep adopted|Pallas configs|ratio" "$OUT/moe_triton.log" | tail -12
fi
timeout "${FP8_S:-110}" python3 bench/moe_fp8.py --tokens 1,32,128,8192 --reps 10 --out "$OUT/fp8" > "$OUT/fp8.log" 2>&1
echo "fp8 rc $?"; tail -12 "$OUT/fp8.log"
timeout "${TRAIN_S:-140}" python3 bench/train_step.py --modes dense --batch 8 --steps 3 --warmup 1 --remat dots_kernels \
    --out "$OUT/train" > "$OUT/train.log" 2>&1
echo "train rc $?"; grep -iE "mfu|grouped_matmul|step" "$OUT/train.log" | tail -6
