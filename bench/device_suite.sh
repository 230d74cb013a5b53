#!/usr/bin/env bash
# One device call on a 2-GPU H200 machine (kind nvidia-h200-x2) running every GPU benchmark:
#
#   GPU0 lane: bench/msa_prefill.py (M3 + M2, 8K..1M, priority order)  -> bench/msa_decode.py
#   GPU1 lane: install the tokamax wheels -> bench/moe.py (M2 + M3, 8K/32K/64K) -> bench/train_step.py
#   then, on whichever lane finishes first: bench/long_context_infer.py (128K and 1M, MSA and dense)
#   after both lanes (CUDA_VISIBLE_DEVICES=0,1): step ep, bench/moe.py --ep-timing (expert parallelism
#   over the two GPUs: EP MoE layer, the all-to-all alone per transport, the same layer on one GPU);
#   SUITE_EP_S (default 120 s, 0 = no ep step) is kept free of the lanes' time for it.
#
# Run from the repository root with OUT set (the device tool's output folder):
#     OUT=/path/to/out bash bench/device_suite.sh
# The device call must carry the wheel folder  build/moe_whl  (tokamax 0.0.17 and the dependencies
# the image lacks: xprof, fire, termcolor, einshape, qwix, pydantic, pydantic_core, annotated_types,
# typing_inspection, immutabledict, tensorboardx; 36.2 MiB). tokamax imports xprof at import time
# (tokamax/_src/ops/op.py -> tokamax/_src/benchmarking.py -> xprof.cli.tools), so xprof cannot be
# left out; without the folder the suite still runs and moe.json says tokamax is unavailable.
#
# Everything finishes within SUITE_TOTAL_S (default 540 s) by per-part `timeout`s. Results come back
# as at most 5 files in $OUT: suite_summary.log (parts, exit codes, durations), results.tar.gz (every
# part's result folder and stdout/stderr log); while a lane is still running, lane0.tar.gz /
# lane1.tar.gz snapshots (rewritten after each of its parts; deleted once results.tar.gz is written),
# and lane_ep.tar.gz after the ep step (deleted likewise).
#
# CPU plumbing check (tiny shapes, interpret mode, short budgets; PYTHON picks the interpreter):
#     SUITE_SMOKE=1 SUITE_TOTAL_S=480 OUT=/tmp/suite bash bench/device_suite.sh
# Other knobs: SUITE_TOTAL_S, SUITE_{PREFILL,DECODE,MOE,TRAIN}_S (per-part caps), SUITE_WHEELS (wheel
# folder), SUITE_LC_ARGS (extra long_context_infer.py flags), SUITE_WORK (scratch folder),
# SUITE_LANE0 / SUITE_LANE1 (the steps of each lane, in order, from: wheels prefill decode moe
# train_step impl_check flash_test long_context; defaults as above), SUITE_TRAIN_ARGS (extra
# bench/train_step.py flags, e.g. "--attention-impl pallas_flash_gpu"), SUITE_PREFILL_CASES,
# SUITE_PREFILL_DENSE_MAX (longest context with a measured cuDNN dense baseline, default 131072; longer
# ones extrapolate from it by (T/T0)^2), SUITE_MOE_TOKENS, SUITE_LC_CONTEXTS (long-context windows, default 131072,1048576), SUITE_LC_S (its cap),
# SUITE_EP_S (cap of the ep step after the lanes, default 120; 0 skips it), SUITE_EP_TOKENS (its tokens per
# GPU, default 8192,32768; priority order under its budget).
set -u
: "${OUT:?set OUT to the output folder}"
cd "$(dirname "$0")/.."
ROOT=$(pwd)
SMOKE=${SUITE_SMOKE:-0}
START=$(date +%s)
TOTAL=${SUITE_TOTAL_S:-540}
END=$((START + TOTAL - 15))          # 15 s kept for the final tar and summary
WORK=${SUITE_WORK:-/tmp/device_suite}
WHEELS=${SUITE_WHEELS:-build/moe_whl}
SITE=/tmp/device_suite_site
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
PY=${PYTHON:-python3}
if [ "$SMOKE" = 1 ]; then
  export JAX_PLATFORMS=cpu
  : "${SUITE_PREFILL_S:=150}" "${SUITE_DECODE_S:=90}" "${SUITE_MOE_S:=60}" "${SUITE_TRAIN_S:=150}"
fi
PREFILL_S=${SUITE_PREFILL_S:-300}; DECODE_S=${SUITE_DECODE_S:-150}
MOE_S=${SUITE_MOE_S:-200}; TRAIN_S=${SUITE_TRAIN_S:-200}
EP_S=${SUITE_EP_S:-120}
# the lanes stop EP_S before END: the ep step (both GPUs, after the lanes) gets its own time
PART_END=$((END - (EP_S > 0 ? EP_S : 0)))
rm -rf "$WORK" "$SITE"; mkdir -p "$WORK/logs" "$OUT"
SUMMARY="$OUT/suite_summary.log"
: > "$SUMMARY"

say() { echo "[$(($(date +%s) - START))s] $*" | tee -a "$SUMMARY"; }

# snapshot LANE: tar every result folder and log so far into $OUT/LANE.tar.gz (atomic rename).
snapshot() {
  tar czf "$OUT/.$1.tmp" -C "$WORK" . 2>/dev/null
  mv -f "$OUT/.$1.tmp" "$OUT/$1.tar.gz"
}

# part NAME NOMINAL_S CMD...: run CMD under `timeout min(NOMINAL_S, time left)`, log to logs/NAME.log.
part() {
  local name=$1 nominal=$2; shift 2
  local left=$((PART_END - $(date +%s)))
  local lim=$(( nominal < left ? nominal : left ))
  if [ "$lim" -lt 10 ]; then
    say "SKIP $name: ${left}s left"; echo "$name skipped" >> "$WORK/parts.txt"; return 0
  fi
  say "START $name (timeout ${lim}s)"
  local t0=$(date +%s)
  timeout -k 10 "$lim" "$@" > "$WORK/logs/$name.log" 2>&1
  local rc=$?
  local note=""; [ "$rc" = 124 ] || [ "$rc" = 137 ] && note=" (timed out)"
  say "END $name rc=$rc$note in $(($(date +%s) - t0))s"
  echo "$name rc=$rc$note $(($(date +%s) - t0))s" >> "$WORK/parts.txt"
  return 0
}

# The long-context run, on the first lane that gets here (mkdir is the lock).
long_context() {
  mkdir "$WORK/.lc_lock" 2>/dev/null || return 0
  local left=$((PART_END - $(date +%s) - 10))
  [ "$left" -gt "${SUITE_LC_S:-$left}" ] && left=$SUITE_LC_S   # SUITE_LC_S caps this step
  [ -f "$SITE/.ok" ] && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  if [ "$SMOKE" = 1 ]; then
    part long_context $((left + 10)) "$PY" bench/long_context_infer.py --out "$WORK/long_context" \
      --contexts 1024 --prefill-chunk 128 --max-new-tokens 8 --budget-s "$left"
  else
    # SUITE_LC_ARGS: extra flags, e.g. "--max_position_embeddings 1048576" for a checkpoint saved with less.
    part long_context $((left + 10)) "$PY" bench/long_context_infer.py --out "$WORK/long_context" \
      --contexts "${SUITE_LC_CONTEXTS:-131072,1048576}" --budget-s "$left" ${SUITE_LC_ARGS:-}
  fi
}

# Steps a lane can run (SUITE_LANE0 / SUITE_LANE1 list them in order; defaults = the full suite).
step_wheels() {
  if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl > /dev/null 2>&1; then
    part install_wheels 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$WHEELS"/*.whl
    if grep -q "^install_wheels rc=0 " "$WORK/parts.txt"; then
      touch "$SITE/.ok"; export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
      part tokamax_import 60 "$PY" -c "import tokamax; print('tokamax', tokamax.__version__, tokamax.ragged_dot)"
    fi
  else
    say "NOTE no wheels in $WHEELS: moe/train_step run without tokamax"
  fi
}
step_prefill() {
  if [ "$SMOKE" = 1 ]; then
    part prefill "$PREFILL_S" "$PY" bench/msa_prefill.py --out "$WORK/prefill" --interpret --tiny \
      --cases m3:256,m2:256 --deadline-s $((PREFILL_S - 40))
  else
    part prefill "$PREFILL_S" "$PY" bench/msa_prefill.py --out "$WORK/prefill" --small-check \
      --cases "${SUITE_PREFILL_CASES:-m3:131072,m3:1048576,m3:8192,m3:32768,m2:131072,m3:524288,m2:8192,m2:32768,m2:524288,m2:1048576}" \
      --dense-max "${SUITE_PREFILL_DENSE_MAX:-131072}" --deadline-s $((PREFILL_S - 80))
  fi
}
step_decode() {
  if [ "$SMOKE" = 1 ]; then
    part decode "$DECODE_S" "$PY" bench/msa_decode.py --out "$WORK/decode" --smoke --contexts 2048 --batches 1,2 --steps 1
  else
    part decode "$DECODE_S" "$PY" bench/msa_decode.py --out "$WORK/decode" --contexts 32768,131072,1048576 \
      --batches 1,32
  fi
}
step_moe() {
  if [ "$SMOKE" = 1 ]; then
    part moe "$MOE_S" "$PY" bench/moe.py --out "$WORK/moe" --tiny --budget-s $((MOE_S - 20))
  else
    part moe "$MOE_S" "$PY" bench/moe.py --out "$WORK/moe" --tokens "${SUITE_MOE_TOKENS:-8192,32768,65536}" \
      --budget-s $((MOE_S - 40))
  fi
}
step_train_step() {
  if [ "$SMOKE" = 1 ]; then
    part train_step "$TRAIN_S" "$PY" bench/train_step.py --out "$WORK/train_step" --tiny
  else
    # shellcheck disable=SC2086
    part train_step "$TRAIN_S" "$PY" bench/train_step.py --out "$WORK/train_step" ${SUITE_TRAIN_ARGS:-}
  fi
}
# The GPU-only tests of the flash attention path (compiled kernels vs the XLA reference).
step_flash_test() {
  part flash_test 240 "$PY" -m pytest -q -p no:cacheprovider tests/ops/attention/test_attention_flash.py -k device -rs
}
# Pallas MSA path vs the XLA reference inside the demo model's training loss and gradients.
step_impl_check() {
  part impl_check 90 "$PY" experiments/three_way/impl_check.py $([ "$SMOKE" = 1 ] && echo --seq 256 --batch 1)
}
step_long_context() { long_context; }
# Expert parallelism over two devices (run after both lanes, not as a lane step): GPUs 0,1; in the CPU
# smoke two host-platform devices. bench/moe.py says in moe.json which transports ran.
step_ep() {
  if [ "$SMOKE" = 1 ]; then
    part ep "$EP_S" env XLA_FLAGS="--xla_force_host_platform_device_count=2 ${XLA_FLAGS:-}" \
      "$PY" bench/moe.py --out "$WORK/ep" --tiny --ep-timing --variants none --tokens 64 --reps 3 \
      --budget-s $((EP_S - 30))
  else
    part ep "$EP_S" env CUDA_VISIBLE_DEVICES=0,1 "$PY" bench/moe.py --out "$WORK/ep" --ep-timing --variants none \
      --tokens "${SUITE_EP_TOKENS:-8192,32768}" --budget-s $((EP_S - 40))
  fi
}

run_lane() {  # LANE_NAME DEVICE STEPS...
  local lane=$1 dev=$2; shift 2
  export CUDA_VISIBLE_DEVICES=$dev
  for st in "$@"; do
    # wheels installed by either lane serve the steps that follow on both
    [ -f "$SITE/.ok" ] && case ":${PYTHONPATH:-}:" in *":$SITE:"*) ;; *) export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" ;; esac
    "step_$st"
    snapshot "$lane"
  done
}

{
  echo "date_utc: $(date -u '+%Y-%m-%d %H:%M:%S')  smoke=$SMOKE  total_s=$TOTAL"
  echo "git: $(git rev-parse --short HEAD 2>/dev/null), $(git status --porcelain 2>/dev/null | wc -l) changed files"
  nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader 2>/dev/null
  "$PY" -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tail -1
} >> "$SUMMARY"
touch "$WORK/parts.txt"
# shellcheck disable=SC2086
run_lane lane0 0 ${SUITE_LANE0:-prefill decode long_context} & P0=$!
# shellcheck disable=SC2086
run_lane lane1 1 ${SUITE_LANE1:-wheels moe train_step long_context} & P1=$!
wait "$P0" "$P1"
PART_END=$END
if [ "$EP_S" -gt 0 ]; then
  step_ep
  snapshot lane_ep
fi
cp "$SUMMARY" "$WORK/suite_summary.log"
if tar czf "$OUT/.results.tmp" -C "$WORK" . 2>/dev/null && mv -f "$OUT/.results.tmp" "$OUT/results.tar.gz"; then
  rm -f "$OUT/lane0.tar.gz" "$OUT/lane1.tar.gz" "$OUT/lane_ep.tar.gz"
fi
{
  echo "---- parts (name, exit code, seconds) ----"
  cat "$WORK/parts.txt"
  echo "---- files ----"
  (cd "$WORK" && find . -type f | sort)
  echo "total ${TOTAL}s budget, took $(($(date +%s) - START))s; results: $(ls "$OUT" | tr '\n' ' ')"
} | tee -a "$SUMMARY"
