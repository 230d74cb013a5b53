"""The MSA GPU probes' CPU smoke runs (interpret-mode kernels, tiny shapes): each finishes, its
same-run checks pass, and it writes its JSON (bench/msa_chunked_prefill.py also times both paths)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.paths import REPO_ROOT


def _run(script, out, *args):
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "bench", script), f"--out={out}", *args],
                       capture_output=True, text=True, timeout=600, env=env, cwd=REPO_ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def test_chunked_prefill_serving_case(tmp_path):
    _run("msa_chunked_prefill.py", tmp_path, "--tiny")
    with open(tmp_path / "msa_chunked_prefill.json") as f:
        res = json.load(f)
    assert len(res["checks"]) == 4 and all(c["ok"] for c in res["checks"])
    assert len(res["rows"]) == 4 and all(r["ms"] > 0 for r in res["rows"])


@pytest.mark.parametrize("script,out,keys", [("msa_bwd_probe.py", "msa_bwd_probe.json", ("bwd_ok", "bwd_chunked_ok", "bwd_dq16_ok")),
                                             ("msa_kl_probe.py", "msa_kl_probe.json", ("kl_ok",))])
def test_probe_checks_pass(tmp_path, script, out, keys):
    _run(script, tmp_path, "--interpret", "--tiny")
    with open(tmp_path / out) as f:
        checks = json.load(f)["checks"]
    assert checks and all(c.get(k) for c in checks for k in keys), checks
