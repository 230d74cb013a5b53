#!/bin/bash
# Session 12, device call 4 (one H200): attention "auto" (now cudnn_packed on Hopper for packed rows)
# with remat=dots_kernels (matmul and fused-kernel outputs saved), 8K dense step at 8 rows; MSA 64K.
set -u
cd "$(dirname "$0")/../../.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-/tmp/s12}; mkdir -p $O
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_attention_cudnn_packed.py tests/test_remat_policies.py 2>&1 | tail -3 | tee $O/pytest.txt
run() {  # name, then train_step flags
  local n=$1; shift
  timeout 170 python3 bench/train_step.py --steps 3 --warmup 1 --attention-impl auto --out $O/$n "$@" > $O/$n.log 2>&1
  echo "== $n rc=$?"; grep -E "FAILED|Error" $O/$n.log | head -3
}
run ts_auto_dk --modes dense --batch 8 --remat dots_kernels
run ts_auto_dk_m2nan --modes dense --batch 8 --remat dots_kernels --cudnn-packed-segments 2 --cudnn-packed-overflow nan
run ts_auto_dk_d1024 --modes dense --batch 8 --remat dots_kernels --doc-len 1024
run ts_auto_full --modes dense --batch 8 --remat full
run ts_auto_msa64k --modes msa --steps 2 --remat full
python3 - <<'PY'
import glob, json, os
O = os.environ.get("OUT", "/tmp/s12")
print(f"{'run':18s} {'mode':5s} {'remat':12s} {'attention':13s} {'cudnn_packed':44s} {'step s':>7s} {'tok/s':>7s} {'TFLOP/s':>7s} {'MFU':>6s} {'GB':>5s}")
for f in sorted(glob.glob(f"{O}/ts_*.log")):
    rows = [json.loads(l) for l in open(f) if l.startswith("{")]
    for r in rows[-1:]:
        print(f"{os.path.basename(f)[:-4]:18s} {r['mode']:5s} {r['remat']:12s} {r['implementations'].get('attention','?'):13s} "
              f"{str(r.get('cudnn_packed')):44s} {r['step_s_median']:7.3f} {r['tokens_per_s']:7.0f} "
              f"{r['model_tflops_per_s']:7.1f} {100*r['mfu']:5.1f}% {r['peak_bytes_in_use']/1e9:5.1f}")
PY
