#!/usr/bin/env bash
# One device call for issue 29: (1) the FP8 grouped matmul at M2's gate / up weight shape, whose 2**31+ one-byte
# elements now reach the kernel as uint16 byte pairs (bench/gmm_fp8_probe.py: one tiling per process, against the
# bf16 kernel on the same weights dequantised first); (2) bench/moe.py's timed rounds with the default (adopted)
# tiles, no tile sweep (sessions 31 / 32 swept; the sweep alone filled the budget), grouped matmuls and the MoE layer
# against the dense matmul at 8K / 32K / 64K tokens; (3) bench/moe_fp8.py (FP8 experts dequantised in the kernel vs
# bf16, decode and prefill sizes); (4) the 8K x 8 dense training step (remat dots_kernels where its ~84 GiB plan
# fits, i.e. on 141 GB H200s; remat full on 80 GB H100s, whose ~63 GiB plan needs a memory fraction above
# jax's default 0.75).
# Run from the repository root with OUT set (the device tool's output folder); per-part caps in seconds.
set -u
export PYTHONUNBUFFERED=1   # a timeout must not swallow the rows already printed
: "${OUT:?set OUT to the output folder}"
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for c in ${FP8_CONFIGS:-128x64x128w8s4h 16x128x128w4s4}; do
    timeout "${PROBE_S:-60}" python3 bench/gmm_fp8_probe.py --config "$c" > "$OUT/fp8_probe_$c.log" 2>&1
    echo "gmm_fp8_probe $c rc $?"; grep -E "^config|^non-finite|^finite|^xla|^RESULT" "$OUT/fp8_probe_$c.log" | cut -c1-300
done
timeout "${MOE_S:-240}" python3 bench/moe.py --models m2,m3 --tokens "${TOKENS:-8192,32768,65536}" --no-sweep \
    --variants pallas_gpu_gmm,dense_matmul,pallas_gpu --rounds 3 --reps 5 --budget-s "$(( ${MOE_S:-240} - 30 ))" \
    --out "$OUT/moe" > "$OUT/moe.log" 2>&1
echo "moe rc $?"; grep -vE "^W0000|^I0000" "$OUT/moe.log" | tail -25
timeout "${FP8_S:-120}" python3 bench/moe_fp8.py --tokens 1,32,128,8192 --reps 10 --out "$OUT/fp8" > "$OUT/fp8.log" 2>&1
echo "fp8 rc $?"; grep -vE "^W0000|^I0000" "$OUT/fp8.log" | tail -14
mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
remat=full; [ "${mem_mib:-0}" -gt 100000 ] && remat=dots_kernels
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout "${TRAIN_S:-150}" python3 bench/train_step.py --modes dense --batch 8 \
    --steps 3 --warmup 1 --remat "$remat" --profile 1 --out "$OUT/train" > "$OUT/train.log" 2>&1
echo "train (remat $remat) rc $?"; grep -iE "mfu|grouped_matmul|step" "$OUT/train.log" | tail -6
