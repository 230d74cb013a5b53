"""``python -m minimax_jax.serve`` flags: defaults (the shipped demo, loopback) and usage errors (exit 2)."""

import pytest

from minimax_jax.serve.cli import build_parser, main


def test_defaults_serve_the_demo_on_loopback():
    f = build_parser().parse_args([])
    assert f.checkpoint is None and f.host == "127.0.0.1" and f.port == 8000 and f.max_batch == 8
    assert f.prefix_cache and build_parser().parse_args(["--no_prefix_cache"]).prefix_cache is False
    assert f.attention == "as_trained" and build_parser().parse_args(["--attention", "dense"]).attention == "dense"
    assert f.speculative == "none" and f.num_draft is None and f.mtp_window == 64
    g = build_parser().parse_args(["--speculative", "mtp", "--num_draft", "1", "--mtp_window", "32"])
    assert (g.speculative, g.num_draft, g.mtp_window) == ("mtp", 1, 32)


@pytest.mark.parametrize("argv", [["--port", "-1"], ["--max_batch", "0"], ["--bogus"],
                                  ["--attention", "sparse"], ["--speculative", "eagle"], ["--num_draft", "1"],
                                  ["--speculative", "mtp", "--num_draft", "0"]])
def test_bad_flags_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


def test_infer_py_serve_is_the_server_cli():
    """``python infer.py serve ...`` runs ``minimax_jax.serve.cli`` with the arguments after ``serve``."""
    import os
    import subprocess
    import sys

    from tests.paths import REPO_ROOT
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, JAX_PLATFORMS="cpu")
    ok = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "infer.py"), "serve", "--help"],
                        capture_output=True, text=True, timeout=120, env=env)
    assert ok.returncode == 0 and "--max_batch" in ok.stdout, ok.stderr[-2000:]
    bad = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "infer.py"), "serve", "--bogus"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "minimax_jax.serve: error: unrecognized arguments: --bogus" in bad.stderr
