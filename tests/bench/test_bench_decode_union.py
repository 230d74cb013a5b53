"""bench/decode_union.py on CPU: the page-union constructions (both XLA forms; the Triton kernel interpreted: its
pairwise algorithm at a width past its MAX_SLOTS bound, its bitmap algorithm where it serves) agree on every cell
and are timed."""

import os
import subprocess
import sys

from tests.paths import REPO_ROOT


def test_decode_union_smoke():
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "bench", "decode_union.py"), "--cells",
                        "2x4096,1x40960"], capture_output=True, text=True, timeout=600, env=env, cwd=REPO_ROOT)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    rows = [line.split() for line in r.stdout.splitlines() if line.strip().startswith(("2x4096", "1x40960"))]
    assert [x[0] for x in rows] == ["2x4096", "1x40960"] and [x[1] for x in rows] == ["40", "400"]
    assert all(x[-1] == "True" and float(x[2]) > 0 and float(x[3]) > 0 for x in rows), r.stdout


def test_decode_union_kernel_column():
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "bench", "decode_union.py"), "--cells", "2x1024",
                        "--q", "4", "--kernel-warps", "4", "--bitmap-warps", "auto,2", "--interpret", "--calls", "2"],
                       capture_output=True, text=True, timeout=600, env=env, cwd=REPO_ROOT)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert "kernel w4 ms" in r.stdout and "bitmap k w2 ms" in r.stdout
    row = [line.split() for line in r.stdout.splitlines() if line.strip().startswith("2x1024")][0]
    # cell, pages, pairwise, bitmap, kernel w4, bitmap kernel "ms (wN)" x 2, equal
    assert row[1] == "10" and row[-1] == "True" and all(float(x) > 0 for x in row[2:5] + row[5:9:2]), r.stdout
    assert row[6] == "(w4)" and row[8] == "(w2)", r.stdout      # auto: 4 warps for 64 slots x 16 pages
