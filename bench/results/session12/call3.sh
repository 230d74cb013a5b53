#!/bin/bash
# Session 12, device call 3 (one H200): cudnn_packed without an XLA conditional (one runs-per-row
# bound, overflow="nan") vs with (buckets + flash fallback), remat full / dots, 8K dense step, 8 rows.
set -u
cd "$(dirname "$0")/../../.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-/tmp/s12}; mkdir -p $O
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_attention_cudnn_packed.py 2>&1 | tail -3 | tee $O/pytest.txt
run() {  # name, then train_step flags
  local n=$1; shift
  timeout 150 python3 bench/train_step.py --modes dense --steps 3 --warmup 1 --attention-impl cudnn_packed \
    --batch 8 --out $O/$n "$@" > $O/$n.log 2>&1
  echo "== $n rc=$?"; rm -rf $O/$n/profile_*
}
run ts_dots_m2nan_prof --remat dots --cudnn-packed-segments 2 --cudnn-packed-overflow nan --profile 2
grep -A34 "profile of" $O/ts_dots_m2nan_prof.log | head -36
run ts_dots_buckets --remat dots
run ts_full_m2nan --remat full --cudnn-packed-segments 2 --cudnn-packed-overflow nan
run ts_dots_m32nan_d1024 --remat dots --cudnn-packed-segments 32 --cudnn-packed-overflow nan --doc-len 1024
python3 - <<'PY'
import glob, json, os
O = os.environ.get("OUT", "/tmp/s12")
print(f"{'run':22s} {'remat':6s} {'cudnn_packed':28s} {'step s':>8s} {'tok/s':>8s} {'TFLOP/s':>8s} {'MFU':>6s} {'peak GB':>8s}")
for f in sorted(glob.glob(f"{O}/ts_*.log")):
    rows = [json.loads(l) for l in open(f) if l.startswith("{")]
    for r in rows[-1:]:
        print(f"{os.path.basename(f)[:-4]:22s} {r['remat']:6s} {str(r.get('cudnn_packed')):28s} {r['step_s_median']:8.3f} "
              f"{r['tokens_per_s']:8.0f} {r['model_tflops_per_s']:8.1f} {100*r['mfu']:5.1f}% {r['peak_bytes_in_use']/1e9:8.1f}")
PY
