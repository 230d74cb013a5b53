"""``bench/serve_load.py --tiny``: the load benchmark against an in-process server with the shipped demo
model finishes, counts 429s apart from errors, and its numbers agree with the requests it made (every
answered request generated its full ``max_tokens``, ``ignore_eos``; the ``/metrics`` prefix-cache hit
rate equals the one from the per-request usage counts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.paths import REPO_ROOT


def test_tiny_load_run(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, JAX_PLATFORMS="cpu")
    # rate 1000/s: all 6 requests at once into a queue of 2 -> some are refused with 429
    r = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "bench", "serve_load.py"), "--tiny",
                        f"--out={tmp_path}", "--rates=8,1000", "--requests=6", "--max_batch=2", "--max_queue=2",
                        "--shared=1", "--prefixes=1"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=REPO_ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(tmp_path / "serve_load_as_trained.json") as f:
        res = json.load(f)
    rows = res["rates"]
    assert [row["rate"] for row in rows] == [8, 1000]
    for row in rows:
        reqs = row["per_request"]
        ok = [q for q in reqs if q["status"] == "ok"]
        assert row["errors"] == 0 and row["ok"] == len(ok) and row["ok"] + row["rejected_429"] == len(reqs) == 6
        assert all(q["output_tokens"] == q["max_tokens"] for q in ok)
        assert all(0 < q["ttft_s"] <= q["e2e_s"] for q in ok)
        assert row["output_tokens"] == sum(q["max_tokens"] for q in ok)
        assert row["ttft_p50_s"] <= row["ttft_p99_s"] and row["e2e_p50_s"] <= row["e2e_p99_s"]
        want = sum(q["cached_tokens"] for q in ok) / sum(q["prompt_tokens"] for q in ok)
        assert abs(row["prefix_cache_hit_rate"] - want) < 1e-9
    assert rows[1]["rejected_429"] >= 1
    assert all(q["prompt_tokens"] >= 64 for row in rows for q in row["per_request"])
    last = r.stdout.strip().splitlines()
    assert last[0].split()[:3] == ["rate/s", "ok", "429"] and len(last) == 3      # the table, printed last
