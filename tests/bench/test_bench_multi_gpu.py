"""bench/multi_gpu.py on simulated CPU devices (``--tiny``): each sub-command's correctness check passes
(context-parallel MSA layer == one device; expert-parallel train step's first loss == expert=1; M2 greedy
decode on an expert + tensor mesh == one device) before its rows are timed, and its JSON holds the rows;
a check that fails makes the script exit 1 with no timed rows. ep_train: slow."""

import json
import os
import subprocess
import sys

import pytest

from tests.paths import REPO_ROOT

SCRIPT = os.path.join(REPO_ROOT, "bench", "multi_gpu.py")


def _env(devices):
    return dict(os.environ, PYTHONPATH=REPO_ROOT, JAX_PLATFORMS="cpu",
                XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}")


def _run(tmp_path, command, *flags, devices=8, code=None, rc=0):
    argv = [SCRIPT, command, "--tiny", "--out", str(tmp_path), *flags]
    cmd = [sys.executable, *argv] if code is None else [sys.executable, "-c", code, *argv]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env(devices), cwd=REPO_ROOT)
    assert r.returncode == rc, (r.stdout[-3000:], r.stderr[-3000:])
    with open(os.path.join(tmp_path, f"multi_gpu_{command}.json")) as f:
        return json.load(f), r.stdout


def test_cp(tmp_path):
    res, out = _run(tmp_path, "cp", "--impl", "xla", "--sequence", "1,4,3")
    check = res["check"]
    assert check["passed"] and set(check["relative_errors"]) == {"4"}, check       # 3 does not divide 8
    assert all(e <= 1e-4 for e in check["relative_errors"]["4"].values())
    assert set(check["relative_errors"]["4"]) == {"o", "dq", "dk", "dv", "dqi", "dki"}
    rows = res["rows"]
    assert [(r["sequence"], r["tokens"], r["status"]) for r in rows] == [(4, 512, "ok"), (1, 512, "ok")], rows
    assert rows[0]["mesh"] == "sequence=4,data=2" and rows[1]["mesh"] == "one device"
    assert rows[1]["efficiency"] == 1.0 and rows[0]["efficiency"] > 0 and res["efficiency_tokens"] == 512
    for r in rows:
        assert r["time_s"] > 0 and len(r["times_s"]) == 2 and r["memory_plan"]["temp_size_in_bytes"] > 0
    assert rows[0]["memory_plan"]["argument_size_in_bytes"] < rows[1]["memory_plan"]["argument_size_in_bytes"]
    assert res["implementations"]["context_parallel/msa"].startswith("sequence=4")
    assert "cp check: passed" in out and out.rstrip().splitlines()[-1].split()[:2] == ["512", "1"]


def test_cp_failed_check_times_nothing(tmp_path):
    """A check that fails (here: a tolerance no result meets) writes the JSON, times nothing, exits 1."""
    code = "import sys; sys.path.insert(0, 'bench'); import multi_gpu; multi_gpu.TOL = -1.0; " \
           "sys.argv = sys.argv[1:]; sys.exit(multi_gpu.main())"
    res, out = _run(tmp_path, "cp", "--impl", "xla", "--sequence", "1,2", code=code, rc=1)
    assert res["check"]["passed"] is False and res["rows"] == []
    assert "cp check: FAILED" in out


@pytest.mark.slow
def test_ep_train(tmp_path):
    """Slow (~50 s: four compiles of the tiny MSA train step): the expert-parallel train step's loss against
    expert=1 is checked by tests/sharding/test_sharding_equivalence.py (fsdp x expert x tensor) and
    tests/ops/moe/test_moe_expert_parallel.py, train_step.bench_one by tests/bench/test_bench_train_step.py,
    this script's harness by the other tests here."""
    res, out = _run(tmp_path, "ep_train", "--experts", "1,4", "--steps", "1", "--warmup", "0", devices=4)
    check = res["check"]
    assert check["passed"] and set(check["values"]) == {"1", "4"}, check
    assert check["relative_errors"]["4"]["loss"] <= 1e-5
    rows = res["rows"]
    assert [(r["expert"], r["data"], r["status"]) for r in rows] == [(1, 4, "ok"), (4, 1, "ok")], rows
    for r in rows:
        assert r["mode"] == "msa" and r["batch"] == 4 and r["seq_len"] == 256
        assert r["step_s_median"] > 0 and r["tokens_per_s"] > 0 and r["loss_last"] == r["loss_last"]
    assert rows[0]["implementations"]["moe"].startswith("expert_parallel[none")        # expert=1: no exchange
    assert rows[1]["implementations"]["moe"].startswith("expert_parallel[all_to_all")
    assert "ep_train check: passed" in out


def test_m2_decode(tmp_path):
    res, out = _run(tmp_path, "m2_decode", "--weights-dtype", "fp8", "--batches", "1,4", "--contexts", "64")
    check = res["check"]
    assert check["passed"] and check["one_device"] == check["mesh"] and len(check["mesh"][0]) == 5, check
    assert res["mesh"] == "expert=4,tensor=2" and res["config"] == os.path.join("configs", "tiny-m2.yaml")
    assert res["fp8_leaves"] > 0 and res["weights_dtype"] == "fp8"
    rows = res["rows"]
    assert [(r["kind"], r["batch"], r["context"], r["status"]) for r in rows] == [
        ("decode", 1, 64, "ok"), ("decode", 4, 64, "ok"), ("prefill", 1, 256, "ok")], rows
    assert all(r["tokens_per_s"] > 0 for r in rows) and rows[-1]["prefill_s"] > 0
    assert res["implementations"]["moe"].startswith("expert_parallel[all_to_all") and "tp=2" in res["implementations"]["moe"]
    assert "m2_decode check: passed" in out
