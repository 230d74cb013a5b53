"""bench/msa_decode.py sweep helpers and bench/decode_ncu.py plumbing (CPU, kernels in interpret mode)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import msa_decode  # noqa: E402


def test_score_candidate_families():
    wide, narrow = msa_decode.score_candidates("bf16"), msa_decode.score_candidates("bf16", "narrow")
    assert {c["num_warps"] for c in wide} == {4} and {c["num_warps"] for c in narrow} == {1, 2}
    fp8 = msa_decode.score_candidates("fp8", "narrow")
    assert len(fp8) == len(narrow) and all(c["f16"] for c in fp8)
    assert len(msa_decode.score_candidates("fp8")) == 2 * len(wide)     # with and without the f16 product
    with pytest.raises(ValueError, match="unknown score family"):
        msa_decode.score_candidates("bf16", "fast")


def test_geomean_best_needs_every_case_and_a_match():
    rows = [dict(batch=1, context=8, s=1, ms=2.0), dict(batch=32, context=8, s=1, ms=4.0),
            dict(batch=1, context=8, s=2, ms=1.0), dict(batch=32, context=8, s=2, ms=4.0),   # geomean 0.71
            dict(batch=1, context=8, s=4, ms=0.5, match=False), dict(batch=32, context=8, s=4, ms=1.0),
            dict(batch=1, context=8, s=8, ms=0.1)]                                          # one case only
    ratios, best = msa_decode._geomean_best(rows, "s", 1)
    assert best == 2 and set(ratios) == {"1", "2"}
    assert ratios["2"] == pytest.approx(2 ** -0.5)


def test_case_sizes_rotate_past_the_l2():
    npg, reps, steps, p = msa_decode.case_sizes(2, 4096, 3, l2_bytes=10 * 2 * 4096 * msa_decode.DI * 2)
    assert (npg, reps, steps, p) == (32, 10, 10, 10 * 2 * 32 + 1)
    assert msa_decode.case_sizes(32, 1 << 20, 4, l2_bytes=200 << 20)[1:3] == (1, 4)


def test_decode_ncu_script_runs_every_kernel():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "decode_ncu.py"), "--batch", "1", "--context",
                        "512", "--interpret"], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    for name in ("scores_bf16", "scores_fp8", "sparse_attention", "dense_attention"):
        assert f"{name}: shape" in r.stdout and f"{name}: shape" in r.stdout.split("ok")[0]
    assert r.stdout.rstrip().endswith("ok")
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "decode_ncu.py"), "--context", "100"],
                         capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert bad.returncode == 2 and "multiple of 128" in bad.stderr
