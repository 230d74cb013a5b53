"""The three-way experiment's pre-flight check (experiments/three_way/impl_check.py) runs on CPU:
the GPU kernels in interpret mode against the reference at the demo model's shapes."""

import json
import subprocess
import sys

import pytest


@pytest.mark.slow   # ~70 CPU-seconds (two model gradients + interpreted kernels)
def test_impl_check_interpret():
    r = subprocess.run([sys.executable, "experiments/three_way/impl_check.py", "--seq", "192", "--batch", "1",
                        "--interpret"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    ops = out["ops"]
    assert out["ok"] and ops["ok"] and ops["impl"] == "pallas_gpu_interpret" and ops["rows"] == 2 * 192
    assert ops["bad_rows"] == 0 and ops["lse_max_err"] <= 1e-3 and out["worst_grad_cosine"] >= 0.98
