"""bench/spec_decode.py on CPU (the shipped demo model, tiny run): both row settings and a speculative device loop
run in one invocation, the JSON and the table are written, and with padded rows the speculative greedy output (one
step at a time and in device loops) equals the plain one."""

import json
import os
import subprocess
import sys

from tests.paths import REPO_ROOT


def test_spec_decode_smoke(tmp_path):
    """One run of both row settings with ``--spec-loops 4``: the JSON and the table are written; with padded rows the
    speculative greedy output equals the plain one; the speculative device loop's row (padded rows), its output
    equal to plain greedy, is compared with the plain loop of the same length."""
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "bench", "spec_decode.py"), "--lengths", "24",
                        "--new", "8", "--spec-loops", "4", f"--out={tmp_path}"], capture_output=True, text=True,
                       timeout=600, env=env, cwd=REPO_ROOT)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    with open(tmp_path / "spec_decode.json") as f:
        rows = json.load(f)["rows"]
    assert [(x["rows"], x["prompt"], x["new"]) for x in rows] == [
        ("per-step", 24, 8), ("per-step spec loop 4", 24, 8), ("padded", 24, 8), ("padded spec loop 4", 24, 8)]
    by = {x["rows"]: x for x in rows}
    assert by["padded"]["first_difference"] is None and by["padded"]["drafted"] > 0
    assert r.stdout.rstrip().splitlines()[-1].startswith("padded")
    loop = by["padded spec loop 4"]
    assert loop["first_difference"] is None and loop["drafted"] > 0 and loop["loop_tok_s"] > 0


def test_bad_flags_are_one_line_errors_before_the_model_loads(tmp_path, capsys):
    import pytest
    sys.path.insert(0, os.path.join(REPO_ROOT, "bench"))
    try:
        import spec_decode
    finally:
        sys.path.pop(0)
    afile = tmp_path / "afile"
    afile.write_text("x")
    for flags, msg in ((["--out", str(afile)], "exists and is not a folder"),
                       (["--lengths", "abc"], "expected an integer, got 'abc'"),
                       (["--lengths", "0"], "must be >= 1, got 0"), (["--lengths", ""], "at least one prompt length"),
                       (["--spec-loops", "0"], "must be >= 1, got 0"), (["--new", "0"], "must be >= 1, got 0"),
                       (["--rows", "bogus"], "comma list of per-step, padded"),
                       (["--mtp-window", "9000"], "must be >= 1 and <= 8192, got 9000")):
        with pytest.raises(SystemExit) as e:
            spec_decode.main(["--out", str(tmp_path / "o")] + flags)
        err = capsys.readouterr().err
        assert e.value.code == 2 and msg in err and "Traceback" not in err, (flags, err)
    assert not (tmp_path / "o").exists()
