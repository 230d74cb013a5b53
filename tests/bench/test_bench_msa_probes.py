"""The MSA GPU probes' CPU smoke runs (interpret-mode kernels, tiny shapes): each finishes, its
same-run checks pass, and it writes its JSON (bench/msa_chunked_prefill.py also times both paths)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.paths import REPO_ROOT


def _run(script, out, *args):
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "bench", script), f"--out={out}", *args],
                       capture_output=True, text=True, timeout=600, env=env, cwd=REPO_ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def test_chunked_prefill_serving_case(tmp_path):
    _run("msa_chunked_prefill.py", tmp_path, "--tiny")
    with open(tmp_path / "msa_chunked_prefill.json") as f:
        res = json.load(f)
    assert len(res["checks"]) == 4 and all(c["ok"] for c in res["checks"])
    assert len(res["rows"]) == 4 and all(r["ms"] > 0 for r in res["rows"])


TINY_CASES = ["m3like", "m2like_packed", "suffix"]        # bench/msa_fwd_probe.py's probe_shapes(tiny=True)
BWD = ("msa_bwd_probe.py", "msa_bwd_probe.json", ("bwd_ok", "bwd_chunked_ok", "bwd_dq16_ok"))
KL = ("msa_kl_probe.py", "msa_kl_probe.json", ("kl_ok",))


@pytest.mark.parametrize("script,out,keys,cases", [
    (*BWD, ["m2like_packed"]), (*KL, ["m2like_packed"]),
    pytest.param(*BWD, None, marks=pytest.mark.slow, id="msa_bwd_probe.py-all_cases"),
    pytest.param(*KL, None, marks=pytest.mark.slow, id="msa_kl_probe.py-all_cases")],
    ids=lambda v: "+".join(v) if isinstance(v, list) else None)
def test_probe_checks_pass(tmp_path, script, out, keys, cases):
    """The default run checks the packed two-row case alone (``--check-cases``: ~10 s of interpreted kernels a
    case); every tiny case (also the one-row and the suffix query case) in the slow run."""
    _run(script, tmp_path, "--interpret", "--tiny", *([f"--check-cases={','.join(cases)}"] if cases else []))
    with open(tmp_path / out) as f:
        checks = json.load(f)["checks"]
    assert [c["case"] for c in checks] == TINY_CASES, checks
    ran = [c for c in checks if not c.get("skipped")]
    assert [c["case"] for c in ran] == (cases or TINY_CASES), checks
    assert ran and all(c.get(k) for c in ran for k in keys), checks


@pytest.mark.parametrize("args,message", [
    (("--variants", "wgmma=1,oops"), "variant item 'oops' is not name=integer"),
    (("--variants", "chunk=abc"), "variant item 'chunk=abc' is not name=integer"),
    (("--cases", "m9:4096"), "case 'm9:4096' is not model:T"),
    (("--tiny", "--cases", "m3:4096"), "--cases is not timed with --tiny")])
def test_probe_flags_refused_before_any_work(tmp_path, args, message, monkeypatch, capsys):
    """A bad --variants / --cases ends the probe with argparse's exit 2 before the checks run (and write
    nothing); --help lists --no-checks / --no-bench. The probe's ``main`` in this process (argparse refuses before
    any JAX work; no interpreter start-up per case)."""
    probe = _bwd_probe(monkeypatch)
    code, out, err = _probe_main(probe, monkeypatch, capsys, f"--out={tmp_path}", *args)
    assert code == 2 and message in err and "CHECK" not in out, (out[-2000:], err[-2000:])
    assert not os.listdir(tmp_path)
    code, out, _ = _probe_main(probe, monkeypatch, capsys, "--help")
    assert code == 0 and "--no-checks" in out and "--no-bench" in out


def _bwd_probe(monkeypatch):
    """bench/msa_bwd_probe.py imported here (it puts the repository root on sys.path itself)."""
    import importlib

    monkeypatch.syspath_prepend(os.path.join(REPO_ROOT, "bench"))
    return importlib.import_module("msa_bwd_probe")


def _probe_main(probe, monkeypatch, capsys, *argv) -> tuple[int, str, str]:
    """``(exit status, stdout, stderr)`` of the probe's ``main`` given ``argv`` (it ends in SystemExit here)."""
    monkeypatch.setattr(sys, "argv", [os.path.join(REPO_ROOT, "bench", "msa_bwd_probe.py"), *argv])
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        probe.main()
    out, err = capsys.readouterr()
    return e.value.code, out, err
