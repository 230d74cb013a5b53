"""bench/trace_summary.py (per-line sums of a trace-event JSON: synthetic events and a real CPU trace) and
bench/flash_blocks.py --tiny."""

from tests.paths import REPO_ROOT
import gzip
import json
import os
import subprocess
import sys

import pytest

ROOT = REPO_ROOT
sys.path.insert(0, os.path.join(ROOT, "bench"))

import trace_summary as ts  # noqa: E402


def _events():
    return [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #14(Compute)"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 1, "tid": 7, "name": "gemm", "dur": 3000.0},
        {"ph": "X", "pid": 1, "tid": 7, "name": "gemm", "dur": 1000.0},
        {"ph": "X", "pid": 1, "tid": 7, "name": "flash_bwd", "dur": 6000.0},
        {"ph": "X", "pid": 1, "tid": 8, "name": "memcpy", "dur": 500.0},       # unnamed line: its tid
        {"ph": "X", "pid": 2, "tid": 9, "name": "python", "dur": 99000.0},     # host: left out by default
        {"ph": "i", "pid": 1, "tid": 7, "name": "marker"},                      # not a complete event
    ]


def test_sums_per_line_divided_by_steps():
    rows = ts.summarize(_events(), top=5, steps=2)
    assert [(r["process"], r["line"]) for r in rows] == [("/device:GPU:0", "Stream #14(Compute)"),
                                                         ("/device:GPU:0", "8")]
    top = rows[0]["top"]
    assert [t["name"] for t in top] == ["flash_bwd", "gemm"]
    assert top[0]["ms"] == pytest.approx(3.0) and top[1]["ms"] == pytest.approx(2.0)
    assert top[1]["count"] == pytest.approx(1.0) and rows[0]["busy_ms"] == pytest.approx(5.0)
    assert top[0]["share"] == pytest.approx(0.6)
    every = ts.summarize(_events(), device_only=False)
    assert every[0]["process"] == "/host:CPU"
    assert "flash_bwd" in ts.format_summary(rows)


def test_reads_the_newest_gzipped_trace_and_names_a_missing_one(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="create_perfetto_trace"):
        ts.newest_trace(str(tmp_path))
    assert ts.main([str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ts.main([str(tmp_path), "--steps", "0"])
    d = tmp_path / "plugins" / "profile" / "run1"
    d.mkdir(parents=True)
    with gzip.open(d / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": _events()}, f)
    assert ts.main([str(tmp_path), "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "Stream #14(Compute): busy 5.00 ms" in out
    assert ts.main([str(d / "perfetto_trace.json.gz")]) == 0            # the file itself
    assert "flash_bwd" in capsys.readouterr().out


def test_cli_on_a_real_cpu_trace(tmp_path):
    code = ("import jax, jax.numpy as jnp\n"
            "f = jax.jit(lambda a: (a @ a).sum()); x = jnp.ones((256, 256)); f(x).block_until_ready()\n"
            f"with jax.profiler.trace({str(tmp_path)!r}, create_perfetto_trace=True):\n"
            "    f(x).block_until_ready()\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "trace_summary.py"), str(tmp_path),
                        "--all-processes"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "/host:CPU" in r.stdout, r.stdout + r.stderr


def test_flash_blocks_bench_tiny(tmp_path):
    """bench/flash_blocks.py --tiny: the GPU kernel's tilings in interpret mode, checked and timed."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "flash_blocks.py"), "--tiny", f"--out={tmp_path}"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    info = json.load(open(tmp_path / "flash_blocks.json"))
    assert info["default_vs_xla_max_rel_err"] < 2e-2
    assert len(info["rows"]) == 2 and all(row["ok"] and row["fwdbwd_ms"] > 0 for row in info["rows"])
    assert all(0 < row["max_rel_err_vs_xla"] < 2e-2 for row in info["rows"])
