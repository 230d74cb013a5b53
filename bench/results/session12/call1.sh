#!/bin/bash
# Session 12, device call 1 (one H200): cuDNN packed attention (attention(implementation="cudnn_packed"))
# checked on the device, timed against the Pallas flash kernel, then the 8K dense training step with it.
set -u
cd "$(dirname "$0")/../../.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-/tmp/s12}; mkdir -p $O
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee $O/gpu.txt
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_attention_cudnn_packed.py 2>&1 | tail -15 | tee $O/pytest.txt
timeout 200 python3 bench/flash_blocks.py --candidates current --max-segments 16,64 --out $O 2>&1 | tail -12 | tee $O/flash_blocks.log
for spec in "pallas_flash 8 0" "cudnn_packed 8 0" "cudnn_packed 8 1024" "cudnn_packed 1 0"; do
  set -- $spec
  timeout 170 python3 bench/train_step.py --modes dense --batch $2 --doc-len $3 --steps 3 --warmup 1 \
    --attention-impl $1 --out $O/ts_$1_b$2_d$3 > $O/ts_$1_b$2_d$3.log 2>&1
  echo "== $spec rc=$?"; grep -E "MFU|mfu|error|Error" $O/ts_$1_b$2_d$3.log | tail -4
done
python3 - <<'PY'
import glob, json, os
O = os.environ.get("OUT", "/tmp/s12")
print(f"{'run':32s} {'impl':18s} {'step s':>8s} {'tok/s':>8s} {'TFLOP/s':>8s} {'MFU':>6s}")
for f in sorted(glob.glob(f"{O}/ts_*/*.json")):
    for r in json.load(open(f)).get("results", []):
        print(f"{os.path.basename(os.path.dirname(f)):32s} {r['implementations'].get('attention','?'):18s} "
              f"{r['step_s_median']:8.3f} {r['tokens_per_s']:8.0f} {r['model_tflops_per_s']:8.1f} {100*r['mfu']:5.1f}%")
PY
