#!/bin/bash
# Session 12, device call 2 (one H200): cudnn_packed with runs-per-row buckets: device tests, the
# bound's cost (bench/flash_blocks.py), the 8K dense step (one document per row and ~8 per row), a
# profile of the step, and remat=dots.
set -u
cd "$(dirname "$0")/../../.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-/tmp/s12}; mkdir -p $O
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_attention_cudnn_packed.py 2>&1 | tail -4 | tee $O/pytest.txt
timeout 150 python3 bench/flash_blocks.py --candidates current --max-segments 2,4,8,16,32,default --out $O 2>&1 | tail -9 | tee $O/flash_blocks.log
run() {  # name, then train_step flags
  local n=$1; shift
  timeout 170 python3 bench/train_step.py --modes dense --steps 3 --warmup 1 --attention-impl cudnn_packed \
    --out $O/$n "$@" > $O/$n.log 2>&1
  echo "== $n rc=$?"; grep -E "^\{" $O/$n.log | tail -1 | cut -c1-200; rm -rf $O/$n/profile_*
}
run ts_b8_d0_prof --batch 8 --profile 2
grep -A40 "profile of" $O/ts_b8_d0_prof.log | head -45
run ts_b8_d1024 --batch 8 --doc-len 1024
run ts_b8_d0_dots --batch 8 --remat dots
python3 - <<'PY'
import glob, json, os, re
O = os.environ.get("OUT", "/tmp/s12")
print(f"{'run':22s} {'impl':14s} {'step s':>8s} {'tok/s':>8s} {'TFLOP/s':>8s} {'MFU':>6s} {'peak GB':>8s}")
for f in sorted(glob.glob(f"{O}/ts_*.log")):
    rows = [json.loads(l) for l in open(f) if l.startswith("{")]
    for r in rows[-1:]:
        print(f"{os.path.basename(f)[:-4]:22s} {r['implementations'].get('attention','?'):14s} {r['step_s_median']:8.3f} "
              f"{r['tokens_per_s']:8.0f} {r['model_tflops_per_s']:8.1f} {100*r['mfu']:5.1f}% {r['peak_bytes_in_use']/1e9:8.1f}")
PY
