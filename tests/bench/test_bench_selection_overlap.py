"""bench/selection_overlap.py on the shipped demo checkpoint (CPU): one row's union is its top-k, unions grow
with Q but never beyond Q x k or the visible blocks, and the JSON holds the measured, independent-row and
benchmark-model counts."""

import json
import os
import subprocess
import sys

from tests.paths import REPO_ROOT


def test_selection_overlap_on_the_demo(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "bench", "selection_overlap.py"), "--tokens", "1024",
                        "--rows", "1,2,4", "--stride", "61", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, cwd=REPO_ROOT,
                       env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO_ROOT))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "selection_overlap.json").read_text())
    k, blocks = res["topk"], res["blocks"]
    assert res["tokens"] == 1024 and len(res["measured_per_layer"]) >= 1
    for lay in res["measured_per_layer"]:
        assert lay["1"] == k                                   # from T/2 on every row has >= k visible blocks
        assert k <= lay["2"] <= lay["4"] <= min(4 * k, blocks)
    assert res["independent_rows"]["1"] == k and res["independent_rows"]["4"] > res["independent_rows"]["2"]
    model = res["benchmark_model_union_4_rows"]
    assert set(model) == {"0.0", "0.9", "0.95", "0.97", "0.98", "0.99"} and all(k <= u <= 4 * k for u in model.values())
    assert r.stdout.splitlines()[-1].startswith("benchmark query model, 4 rows: c=0.0:")
