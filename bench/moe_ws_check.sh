#!/usr/bin/env bash
# One device call for issue 29: (1) the tile sweep of the first projection at M3's expert shapes (h 6144, i 3072, 128
# experts, top-4), and at M2's with SWEEP_M2_S > 0 (visit_group 4 won at M3 and lost at M2 in session 35, hence
# gpu_gmm.shape_configs); (2) bench/moe.py's timed rows and interleaved rounds with the default tiles: grouped
# matmuls (also with the gated epilogue), the MoE layer with the fused first matmul and with the separate path,
# against the dense matmul (TOKENS, default 8K); (3) optionally
# bench/moe_fp8.py (FP8_S > 0; its first full GPU run was session 33); (4) the 8K x 8 dense training step with its
# per-kernel profile (remat dots_kernels where its ~84 GiB plan fits, i.e. on 141 GB H200s; remat full on 80 GB
# H100s, whose ~63 GiB plan needs a memory fraction above jax's default 0.75).
# Run from the repository root with OUT set (the device tool's output folder); per-part caps in seconds (SWEEP_S,
# SWEEP_M2_S, MOE_S, FP8_S, TRAIN_S; 0 skips that part).
set -u
export PYTHONUNBUFFERED=1   # a timeout must not swallow the rows already printed
: "${OUT:?set OUT to the output folder}"
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# (1) the sweeps: M3 first, then M2 (SWEEP_M2_S > 0); the kernels SWEEP_KERNELS (default the forward and the
# input gradient, whose candidates include visit_group; "fwd,dlhs,tgmm" adds the weight gradient's 11)
for M in m3 m2; do
    S=${SWEEP_S:-150}; [ "$M" = m2 ] && S=${SWEEP_M2_S:-0}
    [ "$S" -gt 0 ] || continue
    timeout "$S" python3 bench/moe.py --models "$M" --tokens 8192 --sweep-model "$M" \
        --sweep-kernels "${SWEEP_KERNELS:-fwd,dlhs}" --variants pallas_gpu_gmm,dense_matmul \
        --budget-s "$(( S - 20 ))" --out "$OUT/sweep_$M" > "$OUT/sweep_$M.log" 2>&1
    echo "$M sweep rc $?"; grep -vE "^W0000|^I0000|^\{" "$OUT/sweep_$M.log" | tail -25
done
if [ "${MOE_S:-200}" -gt 0 ]; then      # 0 skips a part (timeout 0 would mean no limit)
    timeout "${MOE_S:-200}" python3 bench/moe.py --models m2,m3 --tokens "${TOKENS:-8192}" --no-sweep \
        --variants pallas_gpu_gmm,pallas_gpu_gmm_gated,dense_matmul,pallas_gpu,pallas_gpu_separate --rounds 3 --reps 5 \
        --budget-s "$(( ${MOE_S:-200} - 30 ))" \
        --out "$OUT/moe" > "$OUT/moe.log" 2>&1
    echo "moe rc $?"; grep -vE "^W0000|^I0000|^\{" "$OUT/moe.log" | tail -25
fi
if [ "${FP8_S:-0}" -gt 0 ]; then
    timeout "$FP8_S" python3 bench/moe_fp8.py --tokens 1,32,128,8192 --reps 10 --out "$OUT/fp8" > "$OUT/fp8.log" 2>&1
    echo "fp8 rc $?"; grep -vE "^W0000|^I0000" "$OUT/fp8.log" | tail -14
fi
if [ "${TRAIN_S:-150}" -gt 0 ]; then
    mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    remat=full; [ "${mem_mib:-0}" -gt 100000 ] && remat=dots_kernels
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout "${TRAIN_S:-150}" python3 bench/train_step.py --modes dense --batch 8 \
        --steps 3 --warmup 1 --remat "$remat" --profile 1 --out "$OUT/train" > "$OUT/train.log" 2>&1
    echo "train (remat $remat) rc $?"; grep -iE "mfu|grouped_matmul|step" "$OUT/train.log" | tail -6
fi
