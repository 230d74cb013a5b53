"""bench/moe.py's interleaved rounds (``--rounds``) and bench/moe_timing.py on CPU (tiny shapes, the Pallas
kernels interpreted): the rows exist with positive times, the per-round ratios are dense ms / gmm ms and
their median is reported; bad flags are argparse errors naming the flag. (Timings on a CPU mean nothing;
these keep the scripts' plumbing working between GPU sessions.)"""

from tests.paths import REPO_ROOT
import json
import os
import statistics
import subprocess
import sys

import pytest

ROOT = REPO_ROOT


def _run(script, *args, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


def _refused(script, argv, needle):
    """``script``'s ``main(argv)`` in this process exits 2 naming ``needle`` (argparse refuses before any JAX work: no
    interpreter start-up)."""
    import importlib
    from contextlib import redirect_stderr
    from io import StringIO

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        mod = importlib.import_module(script[:-len(".py")])
    finally:
        sys.path.pop(0)
    err = StringIO()
    with redirect_stderr(err), pytest.raises(SystemExit) as e:
        mod.main(argv)
    assert e.value.code == 2 and needle in err.getvalue() and "Traceback" not in err.getvalue(), err.getvalue()
    return True


def test_moe_rounds_rows(tmp_path):
    r = _run("moe.py", f"--out={tmp_path}", "--tiny", "--no-sweep", "--models=m2", "--tokens=64", "--reps=1",
             "--rounds=2", "--variants=pallas_gpu_gmm,dense_matmul")
    assert r.returncode == 0, r.stderr[-3000:]
    with open(os.path.join(tmp_path, "moe.json")) as f:
        res = json.load(f)
    assert res["skipped"] == [] and all(c["ok"] for c in res["checks"]), res["checks"]
    rows = res["interleaved"]
    assert [(x["model"], x["tokens"], x["mode"]) for x in rows] == [("m2", 64, "fwd"), ("m2", 64, "fwd+bwd")]
    for x in rows:
        assert "error" not in x, x
        assert len(x["gmm_ms"]) == len(x["dense_ms"]) == len(x["ratios"]) == 2
        assert all(t > 0 for t in x["gmm_ms"] + x["dense_ms"])
        assert x["ratios"] == [d / g for g, d in zip(x["gmm_ms"], x["dense_ms"])]
        assert x["ratio_median"] == statistics.median(x["ratios"])
    assert "Interleaved rounds" in r.stdout


def test_moe_timing_rows(tmp_path):
    r = _run("moe_timing.py", f"--out={tmp_path}", "--tiny", "--models=m2", "--reps=1", "--mgpu")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--mgpu skipped" in r.stdout           # said, not silently dropped, on a CPU
    with open(os.path.join(tmp_path, "moe_timing.json")) as f:
        res = json.load(f)
    got = {(x["variant"], x["mode"]): x for x in res["rows"]}
    assert set(got) == {(v, m) for v in ("pallas_gpu_gmm", "dense_matmul") for m in ("fwd", "fwd+bwd")}
    for x in got.values():
        assert x["synced_ms"] > 0 and x["pipelined_ms"] > 0 and x["tokens"] == 64
        assert x["error"] == "no device events (CPU run)"
    assert res["mgpu"] == []


@pytest.mark.parametrize("script,args,flag", [
    ("moe.py", ["--tokens=abc"], "--tokens"),
    ("moe.py", ["--tokens=0"], "--tokens"),
    ("moe.py", ["--models=m9"], "--models"),
    ("moe.py", ["--reps=0"], "--reps"),
    ("moe_timing.py", ["--variants=bogus"], "--variants"),
    ("moe_timing.py", ["--tokens=0"], "--tokens"),
])
def test_bad_flags_are_usage_errors(script, args, flag, monkeypatch, capsys):
    """The script's ``main`` in this process (argparse refuses before any JAX work; no interpreter start-up per
    case, as tests/bench/test_bench_moe_ep.py imports bench/moe.py)."""
    import importlib

    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    mod = importlib.import_module(script[:-len(".py")])
    monkeypatch.setattr(sys, "argv", [os.path.join(ROOT, "bench", script), "--tiny", *args])
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        mod.main()
    err = capsys.readouterr().err
    assert e.value.code == 2 and flag in err and "Traceback" not in err, err[-2000:]


def test_tgmm_ws_probe_flags_and_cpu_run(tmp_path):
    """bench/tgmm_ws_probe.py: bad flags are argparse errors; with the Mosaic GPU interpreter (jax >= 0.11) a
    --cpu run checks the candidate against the Triton tgmm at both projections of both models (error 0 or
    small) and runs the gmm-level comparison with it; without one, --cpu is refused naming the jax version."""
    from pallas_kernels.common import mosaic_interpreter_available as interpreter_available

    assert _refused("tgmm_ws_probe.py", ["--rounds=0"], "--rounds")
    cpu_run = ["--cpu", "--rounds=1", "--reps=1", f"--out={tmp_path}"]
    if not interpreter_available():
        assert _refused("tgmm_ws_probe.py", cpu_run, "jax >= 0.11")
        return
    r = _run("tgmm_ws_probe.py", *cpu_run, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(os.path.join(tmp_path, "tgmm_ws_probe.json")) as f:
        rows = json.load(f)
    kern = [x for x in rows if "kernel" in x]
    assert len(kern) == 8 and all("error" not in x and x["rel_vs_triton"] < 1e-2 for x in kern), kern
    assert [x["model"] for x in rows if "mode" in x] == ["m2", "m3"]


def test_moe_fp8_tiny(tmp_path):
    """bench/moe_fp8.py --tiny: the check compares the in-kernel FP8 path with the bf16 kernels on the
    dequantised weights and names the path that ran; every chosen variant has a row per cell; the table prints."""
    r = _run("moe_fp8.py", f"--out={tmp_path}", "--tiny", "--models=m2", "--tokens=4,64", "--variants=bf16_auto,fp8_kernel")
    assert r.returncode == 0, r.stderr[-3000:]
    with open(os.path.join(tmp_path, "moe_fp8.json")) as f:
        res = json.load(f)
    assert [(c["model"], c["tokens"]) for c in res["checks"]] == [("m2", 4), ("m2", 64)]
    for c in res["checks"]:
        assert c["ok"] and c["rel_err"] < 1e-2, c
        assert c["fp8_ran"]["grouped_matmul.fp8"].startswith("dequantised per tile in the kernel"), c
    assert sorted((x["tokens"], x["variant"]) for x in res["rows"]) == sorted(
        (t, v) for t in (4, 64) for v in ("bf16_auto", "fp8_kernel"))
    assert all(x["ms"] > 0 for x in res["rows"])
    fp8 = {x["tokens"]: x["weight_bytes"] for x in res["rows"] if x["variant"] == "fp8_kernel"}
    bf16 = {x["tokens"]: x["weight_bytes"] for x in res["rows"] if x["variant"] == "bf16_auto"}
    assert all(fp8[t] < 0.6 * bf16[t] for t in fp8)          # e4m3 + f32 block scales vs bf16
    assert "| fp8_kernel vs bf16_auto |" in r.stdout or "fp8_kernel vs bf16_auto" in r.stdout
    assert _refused("moe_fp8.py", [f"--out={tmp_path}", "--tiny", "--variants=fp16"], "unknown variants")
