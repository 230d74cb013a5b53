"""bench/cp_memory.py on 8 simulated CPU devices, small shapes: the per-device buffer plan of one MSA layer's
forward + backward shrinks with the sequence axis (inputs split n ways; temporaries smaller)."""

import os
import re
import subprocess
import sys

from tests.paths import REPO_ROOT


def test_cp_memory_plan_shrinks_with_the_sequence_axis():
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, JAX_PLATFORMS="cpu",
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")
    r = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "bench", "cp_memory.py"), "--tokens", "4096",
                        "--sequence", "1,4", "--impl", "xla"], capture_output=True, text=True, timeout=600, env=env,
                       cwd=REPO_ROOT)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    rows = re.findall(r"sequence=(\d+) impl=xla: temp ([\d.]+) GiB, arguments ([\d.]+) GiB", r.stdout)
    assert [int(n) for n, _, _ in rows] == [1, 4], r.stdout
    (_, temp1, arg1), (_, temp4, arg4) = [(n, float(a), float(b)) for n, a, b in rows]
    assert abs(arg4 - arg1 / 4) <= 0.011 and temp4 < temp1, r.stdout


def test_local_program_plan_matches_the_mesh_plan():
    """``--local-program`` (what one of n devices runs, compiled on one device: the GPU fallback when no
    n-device mesh can be compiled) plans about the mesh plan's temporaries (the collectives aside)."""
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, JAX_PLATFORMS="cpu",
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")
    script = os.path.join(REPO_ROOT, "bench", "cp_memory.py")
    pat = r"sequence=4(?: \(one device's program\))? impl=xla: temp ([\d.]+) GiB"
    temps = []
    for extra in ([], ["--local-program"]):
        r = subprocess.run([sys.executable, script, "--tokens", "8192", "--sequence", "4", "--impl", "xla", *extra],
                           capture_output=True, text=True, timeout=600, env=env, cwd=REPO_ROOT)
        assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
        temps.append(float(re.search(pat, r.stdout).group(1)))
    assert "one device's program" in r.stdout
    assert abs(temps[1] - temps[0]) <= 0.05 * temps[0] + 0.02, temps


def test_gpu_target_plan_for_compile_only_h200s(monkeypatch, capsys):
    """``--gpu-target h200``: the GPU compiler's plan for 8 compile-only H200s (needs jax's CUDA plugin, no GPU;
    skipped without it); an unknown target is a one-line usage error either way (the script's ``main(argv)`` in
    this process: refused before anything compiles)."""
    import importlib

    import pytest
    from tests.test_aot import HAS_CUDA_PLUGIN
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, JAX_PLATFORMS="cpu")
    script = os.path.join(REPO_ROOT, "bench", "cp_memory.py")
    monkeypatch.syspath_prepend(os.path.join(REPO_ROOT, "bench"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        importlib.import_module("cp_memory").main(["--gpu-target", "b300"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "neither a file nor one of ['h200']" in err.splitlines()[-1], err[-2000:]
    if not HAS_CUDA_PLUGIN:
        pytest.skip("needs jax's CUDA plugin (jax[cuda13]); no GPU needed")
    r = subprocess.run([sys.executable, script, "--tokens", "8192", "--sequence", "1,8", "--impl", "pallas_gpu",
                        "--gpu-target", "h200", "--gpus", "8"], capture_output=True, text=True, timeout=600, env=env,
                       cwd=REPO_ROOT)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    rows = re.findall(r"\[NVIDIA H200\] tokens=8192 sequence=(\d) impl=pallas_gpu: temp ([\d.]+) GiB, arguments "
                      r"([\d.]+) GiB", r.stdout)
    assert [n for n, _, _ in rows] == ["1", "8"], r.stdout
    (_, t1, a1), (_, t8, a8) = [(n, float(t), float(a)) for n, t, a in rows]
    assert t8 < t1 and abs(a8 - a1 / 8) <= 0.011, r.stdout
