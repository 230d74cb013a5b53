"""bench/train_step.py on CPU (tiny model): the progress lines (building, lowering, compile start /
done, memory plan, every step), ``--compile-only``'s memory plan, the JSON rows and
``train_step.json``; ``--lower-for cuda`` (the GPU step's Pallas kernels, the indexer KL among them,
lowered on this CPU); and the report on SIGTERM during a compile."""

from tests.paths import REPO_ROOT
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

ROOT = REPO_ROOT
SCRIPT = os.path.join(ROOT, "bench", "train_step.py")
LINE = re.compile(r"^\[train_step +\d+\.\ds\] ")


def _env(compile_cache=True):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    if not compile_cache:      # the suite's shared cache (tests/conftest.py) would skip the compile
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env


def _run(out, *args, timeout=300):
    r = subprocess.run([sys.executable, SCRIPT, f"--out={out}", *args], capture_output=True, text=True,
                       timeout=timeout, env=_env(), cwd=ROOT)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    lines = r.stdout.splitlines()
    rows = [json.loads(ln) for ln in lines if ln.startswith("{")]
    progress = [LINE.sub("", ln) for ln in lines if LINE.match(ln)]
    with open(os.path.join(out, "train_step.json")) as f:
        saved = json.load(f)
    return progress, rows, saved


def _index(progress, text):
    hits = [i for i, ln in enumerate(progress) if text in ln]
    assert hits, (text, progress)
    return hits[0]


def test_compile_only(tmp_path):
    progress, rows, saved = _run(tmp_path, "--tiny", "--modes", "msa", "--compile-only")
    order = [_index(progress, s) for s in ("msa@256: building", "msa@256: tracing + lowering", "msa@256: lowered in",
                                           "msa@256: compile start", "msa@256: compile done in",
                                           "msa@256: memory plan: temp")]
    assert order == sorted(order) and progress[-1] == "done", progress
    assert not any("step" in ln and "took" in ln for ln in progress)           # nothing ran
    assert not any("initialising" in ln for ln in progress)                   # nothing allocated
    (row,) = rows
    assert row["mode"] == "msa" and row["compile_only"] and row["compile_s"] > 0
    mem = row["memory_plan"]
    assert mem["temp_size_in_bytes"] > 0 and mem["argument_size_in_bytes"] > 0
    assert mem["total_est_bytes"] >= mem["temp_size_in_bytes"]
    assert row["implementations"]["indexer_kl"] == "xla"                        # CPU: auto = xla
    assert saved["results"] == rows and saved["errors"] == []


def test_timed_run(tmp_path):
    progress, rows, saved = _run(tmp_path, "--tiny", "--modes", "msa", "--vocab", "640", "--logits-chunk", "64",
                                 "--profile", "1")
    for s in ("initialising parameters", "compile start", "compile done in", "memory plan", "first step took",
              "warmup step 1/1 took", "timed step 1/2 took", "timed step 2/2 took", "profiled step 1/1 took",
              "profile of 1 step(s), host (no device lines)"):
        _index(progress, s)
    assert (_index(progress, "compile done in") < _index(progress, "first step took")
            < _index(progress, "timed step 2/2")), progress
    (row,) = rows
    assert row["mode"] == "msa" and row["seq_len"] == 256 and row["compile_s"] > 0 and row["first_step_s"] > 0
    assert row["vocab_size"] == 640 and row["logits_chunk"] == 64
    assert row["step_s_median"] > 0 and row["tokens_per_s"] > 0 and row["flops_per_step"] > 0
    assert row["loss_last"] == row["loss_last"]                                # not NaN
    assert set(row["implementations"]) >= {"msa_select_blocks", "msa_attention", "indexer_kl", "moe"}
    assert len(saved["results"][0]["step_s_all"]) == 2 and saved["errors"] == []
    prof = saved["results"][0]["profile"]                      # bench/trace_summary.py's lines
    assert os.path.isdir(prof["dir"]) and prof["lines"] and prof["lines"][0]["busy_ms"] > 0
    assert "profile" not in row                                 # the printed row stays short


def test_lower_for_cuda_lists_the_gpu_kernels(tmp_path):
    progress, rows, _ = _run(tmp_path, "--tiny", "--modes", "msa", "--lower-for", "cuda", timeout=120)
    (row,) = rows
    impl = row["implementations"]
    assert impl["attention"] == "pallas_flash_gpu" and impl["msa_attention"] == "pallas_gpu"
    assert impl["indexer_kl"] == "pallas_gpu"              # the KL follows msa_impl ("auto": the kernel)
    k = row["pallas_kernels"]
    # The KL's first pass computes only the student's LSE: the attention forward's LSE is the teacher's.
    for name in ("msa_indexer_gpu", "msa_fwd_gpu", "msa_bwd_gpu", "msa_bwd_merge_gpu", "msa_kl_student_lse_gpu",
                 "msa_kl_gpu", "mha_forward", "mha_backward"):
        assert k.get(name, 0) >= 1, (name, k)
    assert k.get("msa_kl_lse_gpu", 0) == 0, k
    assert row["largest_arrays"] and row["largest_arrays"][0]["bytes"] >= row["largest_arrays"][-1]["bytes"]
    assert "compile_s" not in row and not any("compile start" in ln for ln in progress)


def test_sigterm_reports_where_it_was(tmp_path):
    p = subprocess.Popen([sys.executable, SCRIPT, f"--out={tmp_path}", "--tiny", "--modes", "msa"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(compile_cache=False), cwd=ROOT)
    seen = []
    try:
        for ln in p.stdout:
            seen.append(ln)
            if "compile start" in ln:
                time.sleep(1.0)                 # inside XLA's compiler (several seconds for this model)
                p.send_signal(signal.SIGTERM)
                break
        rest = p.communicate(timeout=60)[0]
    finally:
        if p.poll() is None:
            p.kill()
    out = "".join(seen) + rest
    assert p.returncode == 128 + signal.SIGTERM, out[-3000:]
    m = re.search(r"SIGTERM: stopped during '([^']+)' \(in it for [\d.]+ s\)", out)
    assert m, out[-3000:]
    assert m.group(1) == "msa@256: compile start", out[-3000:]
    assert "Thread" in out or "thread" in out                                 # the stacks follow
    with open(os.path.join(tmp_path, "train_step.json")) as f:
        saved = json.load(f)
    assert saved["results"] == []
    assert saved["errors"][0]["interrupted"] == "SIGTERM" and saved["errors"][0]["where"] == "msa@256: compile start"


def test_gpu_target_usage_errors(tmp_path, monkeypatch, capsys):
    """``--gpu-target``: an unknown target, or with ``--lower-for``, is a one-line usage error (exit 2). The
    script's ``main(argv)`` in this process: argparse refuses before any JAX work (no interpreter start-up)."""
    import importlib

    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    train_step = importlib.import_module("train_step")
    for extra, msg in ((["--gpu-target", "b300"], "'b300' is neither a file nor one of ['h200']"),
                       (["--gpu-target", "h200", "--lower-for", "cuda"], "leave out --lower-for")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            train_step.main([f"--out={tmp_path / 'out'}", "--tiny", *extra])
        out, err = capsys.readouterr()
        assert e.value.code == 2 and msg in err.splitlines()[-1], (out[-2000:], err[-2000:])
    assert not (tmp_path / "out").exists()


def test_gpu_target_compiles_the_step_for_an_h200(tmp_path):
    """With jax's CUDA plugin (no GPU needed): the tiny MSA step compiles for a compile-only H200 with the
    GPU kernels and its plan is compared with the H200's memory. Without the plugin: skipped."""
    from tests.test_aot import HAS_CUDA_PLUGIN
    import pytest
    if not HAS_CUDA_PLUGIN:
        pytest.skip("needs jax's CUDA plugin (jax[cuda13]); no GPU needed")
    _, rows, _ = _run(tmp_path, "--tiny", "--modes", "msa", "--gpu-target", "h200", timeout=600)
    (row,) = rows
    assert row["device"] == "NVIDIA H200" and row["gpu_target"] == "h200" and row["compile_only"]
    assert row["pallas_kernels"].get("msa_indexer_gpu", 0) > 0 and row["implementations"]["indexer_kl"] == "pallas_gpu"
    assert row["fits"]["device_bytes"] == 143_771 * 2 ** 20
    assert 0 < row["fits"]["plan_bytes"] == row["memory_plan"]["total_est_bytes"]
    assert row["fits"]["verdict"].endswith(": fits"), row["fits"]
