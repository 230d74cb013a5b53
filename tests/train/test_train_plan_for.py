"""`train.py --plan_for GPU`: the run's train step compiled for GPUs this machine lacks, XLA's memory plan per
device, nothing trained. With jax's CUDA plugin (no GPU needed) the tiny M3 run is planned for compile-only H200s
(both phases: indexer warm-up and sparse) and a GPU too small for it is reported as "does not fit" (exit 1);
without the plugin (the CI machine) the flag fails in one line naming what to install. Usage errors either way."""

import re
import subprocess
import sys

import pytest

from tests.paths import REPO_ROOT
from tests.test_aot import HAS_CUDA_PLUGIN
from tests.train_helpers import train_script_main

TINY = ("--config", "configs/train/tiny-m3.yaml")


def _train(*args, timeout=600):
    return subprocess.run([sys.executable, "train.py", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO_ROOT, env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})


@pytest.mark.parametrize("args, message", [
    (("--plan_gpus", "2"), "train.py: error: --plan_gpus needs --plan_for"),
    (("--plan_for", "b300"), "train.py: error: --plan_for: GPU target 'b300' is neither a file nor one of ['h200']"),
    (("--plan_for", "h200", "--set", "mesh=data=-1"), "has a -1 axis: say how many GPUs with --plan_gpus"),
    (("--plan_for", ""), "train.py: error: --plan_for: GPU target is empty"),
    (("--plan_for", "h200", "--check_only"), "--plan_for and --check_only are two different checks"),
])
def test_usage_errors(tmp_path, capsys, args, message):
    """In this process (train.py's ``main``; no interpreter start-up per case): the usage errors come before
    anything is traced or written. train.py's own exit status: the subprocess tests here and
    tests/train/test_train_config.py."""
    code = train_script_main()([*TINY, "--set", f"run.run_dir={tmp_path}/run", *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err.strip().splitlines()[-1], err
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(HAS_CUDA_PLUGIN, reason="jax's CUDA plugin is installed here")
def test_without_cuda_plugin_says_what_to_install(tmp_path):
    r = _train(*TINY, "--set", f"run.run_dir={tmp_path}/run", "--set", "mesh=data=2", "--plan_for", "h200",
               timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert 'needs jax\'s CUDA plugin (pip install "jax[cuda13]")' in r.stderr.strip().splitlines()[-1], r.stderr


@pytest.mark.skipif(not HAS_CUDA_PLUGIN, reason="needs jax's CUDA plugin (jax[cuda13]); no GPU needed")
def test_plans_both_phases_and_refuses_a_gpu_too_small(tmp_path):
    r = _train(*TINY, "--set", f"run.run_dir={tmp_path}/run", "--set", "mesh=data=2,fsdp=2", "--plan_for", "h200")
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert "plan for 4 x NVIDIA H200 (h200), mesh data=2,fsdp=2, 4 x 256 tokens per step" in r.stdout, r.stdout
    phases = re.findall(r"^  (\w+) phase: ([\d.]+) GiB of 140.40 GiB .*: fits$", r.stdout, re.MULTILINE)
    assert [p for p, _ in phases] == ["indexer_warmup", "main"], r.stdout
    assert r.stdout.strip().splitlines()[-1] == "train.py: fits"
    assert "msa_attention=pallas_gpu" in r.stdout and "batch: random rows of the run's shape" in r.stdout
    assert not (tmp_path / "run").exists()                      # nothing trained, nothing written
    r = _train(*TINY, "--set", f"run.run_dir={tmp_path}/run", "--set", "mesh=data=2", "--set", "run.steps=3",
               "--plan_for", "h200", "--plan_gpus", "4")              # warm-up only: one phase; 2 of 4 GPUs used
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert "plan for 2 of 4 x NVIDIA H200" in r.stdout and "main phase" not in r.stdout, r.stdout
    small = tmp_path / "small.txtpb"                             # the H200 with 1 MiB of memory
    text = open(f"{REPO_ROOT}/configs/gpu_targets/h200.txtpb").read()
    small.write_text(re.sub(r"device_memory_size: \d+", "device_memory_size: 1048576", text))
    r = _train(*TINY, "--set", f"run.run_dir={tmp_path}/run", "--set", "mesh=data=2", "--plan_for", str(small))
    assert r.returncode == 1, (r.stdout[-3000:], r.stderr[-3000:])
    assert r.stdout.strip().splitlines()[-1].startswith("train.py: does not fit (try "), r.stdout
