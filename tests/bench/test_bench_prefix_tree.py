"""bench/prefix_tree.py on CPU: ``--tiny`` (dense): the synthetic rollouts share their prompt (fewer merged
tokens), the merged and unmerged steps give the same loss (float32, 1e-5), the JSON and the table are
written; ``--lower-for cuda`` (MSA): the merged step's GPU kernels (tree attention, MSA kernels on the key
layout)."""

import json
import os
import subprocess
import sys

from tests.paths import REPO_ROOT

SCRIPT = os.path.join(REPO_ROOT, "bench", "prefix_tree.py")


def test_tiny_run_checks_equality_and_writes_results(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, SCRIPT, "--tiny", "--modes", "dense", "--steps", "1", "--warmup", "0",
                        f"--out={tmp_path}"], capture_output=True, text=True, timeout=600, env=env, cwd=REPO_ROOT)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert "equality check (loss merged vs unmerged, rel. tol 1e-5): PASS" in r.stdout
    assert r.stdout.rstrip().splitlines()[-1].startswith("dense ")
    with open(tmp_path / "prefix_tree.json") as f:
        res = json.load(f)
    (row,) = res["rows"]
    assert row["merged"]["tokens"] < row["unmerged"]["tokens"] and row["ideal_ratio"] > 1.2
    assert row["loss_rel_diff"] < 1e-5 and row["merged"]["step_s"] > 0
    assert row["merged"]["implementations"]["attention"] == "xla"            # CPU: the reference
    assert "pallas_tree" not in json.dumps(row)


def test_lower_for_cuda_picks_the_tree_and_msa_kernels(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, SCRIPT, "--tiny", "--modes", "msa", "--lower-for", "cuda", f"--out={tmp_path}"],
                       capture_output=True, text=True, timeout=600, env=env, cwd=REPO_ROOT)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    with open(tmp_path / "prefix_tree.json") as f:
        (row,) = json.load(f)["rows"]
    merged = row["merged"]["implementations"]
    assert merged["attention"] == "pallas_tree_gpu" and merged["indexer_kl"] == "pallas_gpu"
    assert merged["msa_attention"].startswith("pallas") and row["merged"]["triton_kernels"] >= 5
    assert "loss" not in row["merged"]          # nothing ran


def test_fitted_rows_and_split_calls_keep_the_lm_loss(tmp_path):
    """``--fit-rows`` cuts each layout after its fullest row; ``--rows-per-call 1`` accumulates row by row
    (the LM loss sums to the one-call value, so the equality check holds on it)."""
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, SCRIPT, "--tiny", "--modes", "dense", "--steps", "1", "--warmup", "0",
                        "--fit-rows", "64", "--rows-per-call", "1", f"--out={tmp_path}"],
                       capture_output=True, text=True, timeout=600, env=env, cwd=REPO_ROOT)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert "equality check (LM loss merged vs unmerged, rel. tol 1e-5): PASS" in r.stdout
    with open(tmp_path / "prefix_tree.json") as f:
        (row,) = json.load(f)["rows"]
    m, u = row["merged"], row["unmerged"]
    assert row["checked"] == "lm_loss" and u["rows"] > 1
    assert m["row_len"] % 64 == 0 and m["tokens"] <= m["row_len"] < 512      # cut from --seq-len 512
    assert m["row_len"] - 64 < m["tokens"]                                    # ... right after the tree


def test_tree_blocks_interpret_smoke(tmp_path):
    """bench/tree_blocks.py in interpret mode: two launch configurations agree and both are timed."""
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, JAX_PLATFORMS="cpu")
    script = os.path.join(REPO_ROOT, "bench", "tree_blocks.py")
    r = subprocess.run([sys.executable, script, "--interpret", "--configs", "128:32:4:3,64:64:8:2", "--iters", "1",
                        f"--out={tmp_path}"], capture_output=True, text=True, timeout=600, env=env, cwd=REPO_ROOT)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    with open(tmp_path / "tree_blocks.json") as f:
        res = json.load(f)
    assert res["merged_tokens"] < res["unmerged_tokens"]
    a, b = res["tree"]
    assert a["max_rel_err_vs_first"] == 0.0 and 0.0 <= b["max_rel_err_vs_first"] < 2e-2
    assert a["fwd_bwd_ms"] > 0 and b["fwd_bwd_ms"] > 0
