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


def _eval_json(path, tasks):
    json.dump({"tasks": tasks, "examples": [{}] * 3, "skipped": []}, open(path, "w"))


def test_summarize_lists_msa_dense_only_when_evaluated(tmp_path):
    """summarize.py: the three core variants always have rows (blank where absent); msa_dense (eval_all.sh's
    MSA checkpoint with --attention dense) appears exactly when its eval file exists."""
    sys.path.insert(0, "experiments/three_way")
    import summarize

    _eval_json(tmp_path / "eval_msa.json", {"niah_single": {"2048": 1.0, "4096": 0.75}})
    _eval_json(tmp_path / "eval_full.json", {"niah_single": {"2048": 1.0, "4096": 1.0}})
    table = summarize.accuracy_table(str(tmp_path))
    assert "| niah_single | msa | 1.00 | 0.75 |" in table and "| niah_single | sliding |  |  |" in table
    assert "msa_dense" not in table
    _eval_json(tmp_path / "eval_msa_dense.json", {"niah_single": {"2048": 0.5, "4096": 0.25}})
    table = summarize.accuracy_table(str(tmp_path))
    assert "| niah_single | msa_dense | 0.50 | 0.25 |" in table and "msa_dense 3 / 0" in table
    for n in (32, 16):     # msa_top<N> (the MSA checkpoint selecting top-N blocks) after them, by N
        _eval_json(tmp_path / f"eval_msa_top{n}.json", {"niah_single": {"2048": 1.0, "4096": n / 32}})
    table = summarize.accuracy_table(str(tmp_path))
    assert "| niah_single | msa_top16 | 1.00 | 0.50 |" in table and "| niah_single | msa_top32 | 1.00 | 1.00 |" in table
    assert table.index("msa_dense |") < table.index("msa_top16 |") < table.index("msa_top32 |")
    # newer eval files carry 95 % intervals per cell: shown beside the mean
    json.dump({"tasks": {"niah_single": {"2048": 1.0}}, "intervals": {"niah_single": {"2048": [0.806, 1.0]}},
               "examples": [{}] * 16, "skipped": []}, open(tmp_path / "eval_full.json", "w"))
    assert "| niah_single | full | 1.00 [0.81, 1.00] |  |" in summarize.accuracy_table(str(tmp_path))


@pytest.mark.parametrize("script", ["train_all.sh", "eval_all.sh", "device.sh", "long_stage.sh", "indexer_stage.sh"])
def test_experiment_scripts_are_valid_bash(script):
    r = subprocess.run(["bash", "-n", f"experiments/three_way/{script}"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr



def test_timing_summary_reads_both_infer_stats_lines(tmp_path):
    """summarize.py's timing table parses infer.py's current stats line (compile time apart) and the older one."""
    import importlib.util
    import os

    from tests.paths import REPO_ROOT
    spec = importlib.util.spec_from_file_location(
        "summarize", os.path.join(REPO_ROOT, "experiments", "three_way", "summarize.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    (tmp_path / "infer_msa.txt").write_text(
        "prompt 5 tok, prefill 2.35s (compiled in 2.18s) | TTFT 2.60s | generated 64 tok in 3.02s: decode 66.1 "
        "tok/s steady state (excl. 2.08s compile in 1 of 63 steps)\nimplementations: attention=xla\n")
    (tmp_path / "infer_full.txt").write_text(
        "prompt 7 tok, prefill 1.50s | TTFT 1.70s | generated 64 tok in 3.00s (21.3 tok/s)\n")
    out = mod.timing_summary(str(tmp_path))
    assert "| msa | 5 | 2.60 | 2.35 | 66.1 | attention=xla |" in out, out
    assert "| full | 7 | 1.70 | 1.50 | 21.3 |" in out, out


def test_timing_summary_reports_recall_and_the_covered_mass(tmp_path):
    """The recall line: block recall per layer, and (recall files since session 42) the covered dense mass."""
    sys.path.insert(0, "experiments/three_way")
    import summarize

    rec = {"layers": {"3": 0.75, "2": 0.5}, "mean": 0.625, "pairs": 8}
    json.dump(rec, open(tmp_path / "recall_msa.json", "w"))
    line = summarize.timing_summary(str(tmp_path)).splitlines()[-1]
    assert "mean 0.625 over 8 (query, group) pairs; per layer 2: 0.500, 3: 0.750" in line and "mass" not in line
    rec.update(mass={"layers": {}, "mean": 0.91}, oracle_mass={"layers": {}, "mean": 0.95})
    json.dump(rec, open(tmp_path / "recall_msa.json", "w"))
    line = summarize.timing_summary(str(tmp_path)).splitlines()[-1]
    assert line.endswith("dense attention mass inside the selection 0.910 of the 0.950 the top blocks hold")
