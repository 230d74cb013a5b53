"""``python -m minimax_jax.serve`` flags: defaults (the shipped demo, loopback) and usage errors (exit 2)."""

import pytest

from minimax_jax.serve.cli import build_parser, main


def test_defaults_serve_the_demo_on_loopback():
    f = build_parser().parse_args([])
    assert f.checkpoint is None and f.host == "127.0.0.1" and f.port == 8000 and f.max_batch == 8
    assert f.prefix_cache and build_parser().parse_args(["--no_prefix_cache"]).prefix_cache is False
    assert f.attention == "as_trained" and build_parser().parse_args(["--attention", "dense"]).attention == "dense"
    assert f.speculative == "none" and f.num_draft is None and f.mtp_window is None     # 64 with --speculative
    g = build_parser().parse_args(["--speculative", "mtp", "--num_draft", "1", "--mtp_window", "32"])
    assert (g.speculative, g.num_draft, g.mtp_window) == ("mtp", 1, 32)


@pytest.mark.parametrize("argv", [["--port", "-1"], ["--port", "70000"], ["--max_batch", "0"], ["--bogus"],
                                  ["--attention", "sparse"], ["--speculative", "eagle"], ["--num_draft", "1"],
                                  ["--speculative", "mtp", "--num_draft", "0"], ["--sharding_rules", "default"],
                                  ["--mtp_window", "32"], ["--speculative", "mtp", "--mtp_window", "8193"]])
def test_bad_flags_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


def test_too_many_drafts_is_refused_before_loading(capsys, monkeypatch):
    """The shipped demo has one MTP module: ``--num_draft 2`` exits 2 from its config, before any weights load."""
    import minimax_jax.infer.loading as loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    rc = main(["--port", "0", "--speculative", "mtp", "--num_draft", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and "--num_draft 2: this model has 1 MTP modules" in err


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for text in ("default 127.0.0.1", "default 8000", "default 8)", "default 4096)", "default 64)", "default 256)"):
        assert text in out, text


def test_the_window_bound_is_the_drafters():
    from minimax_jax.infer.drafter import MAX_MTP_WINDOW
    assert build_parser().parse_args(["--speculative", "mtp", "--mtp_window", str(MAX_MTP_WINDOW)]).mtp_window == 8192
    assert MAX_MTP_WINDOW == 8192


def test_infer_py_serve_is_the_server_cli(monkeypatch, capsys):
    """``python infer.py serve ...`` runs ``minimax_jax.serve.cli`` with the arguments after ``serve`` (infer.py run
    as ``__main__`` in this process: its imports are loaded already, no interpreter start-up)."""
    import os
    import runpy
    import sys

    from tests.paths import REPO_ROOT

    def infer_py(*args):
        monkeypatch.setattr(sys, "argv", [os.path.join(REPO_ROOT, "infer.py"), *args])
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            runpy.run_path(os.path.join(REPO_ROOT, "infer.py"), run_name="__main__")
        out, err = capsys.readouterr()
        return e.value.code, out, err

    code, out, _ = infer_py("serve", "--help")
    assert code == 0 and "--max_batch" in out and out.startswith("usage: infer.py serve")
    code, _, err = infer_py("serve", "--bogus")
    assert code == 2 and "infer.py serve: error: unrecognized arguments: --bogus" in err


def _serve(tmp_path, *flags, devices=1, **cfg_kw):
    """``python -m minimax_jax.serve`` on a chain checkpoint in a subprocess; yields (port, process)."""
    import os
    import subprocess
    import sys

    from minimax_jax.serve.server import free_port
    from tests import infer_helpers as H
    from tests.paths import REPO_ROOT

    ckpt = H.chain_checkpoint(str(tmp_path / "ckpt"), H.GOOD_PIECES, **cfg_kw)
    port = free_port()
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, JAX_PLATFORMS="cpu",
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}")
    proc = subprocess.Popen([sys.executable, "-m", "minimax_jax.serve", "--checkpoint", ckpt, "--port", str(port),
                             "--max_batch", "2", "--max_len", "1024", "--compilation_cache", "none", *flags],
                            env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return port, proc


@pytest.mark.parametrize("mesh", [None, "tensor=2"])
def test_the_cli_serves_a_chat_completion(tmp_path, mesh):
    """The server CLI starts (uvicorn in the foreground), answers a greedy chat completion with the chain
    model's reply, alone and on a 2-device mesh (KV cache sharded by kv head), and stops on SIGINT."""
    import json
    import signal
    import time
    import urllib.error
    import urllib.request

    from tests import infer_helpers as H

    flags = ["--mesh", mesh] if mesh else []
    port, proc = _serve(tmp_path, *flags, devices=2, num_heads=4, num_kv_heads=2)
    try:
        base = f"http://127.0.0.1:{port}/v1"
        end = time.monotonic() + 240
        while True:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            try:
                with urllib.request.urlopen(base + "/models", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            assert time.monotonic() < end, "the server did not come up"
            time.sleep(0.5)
        body = json.dumps({"model": "ckpt", "messages": H.CHAT["messages"], "tools": H.CHAT["tools"],
                           "temperature": 0, "max_tokens": 64}).encode()
        req = urllib.request.Request(base + "/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                msg = json.loads(r.read())["choices"][0]["message"]
        except urllib.error.HTTPError as e:
            raise AssertionError(f"{e}: {e.read()[:2000]!r}") from None
        call = msg["tool_calls"][0]["function"]                     # the chain model's scripted tool call
        assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}, msg
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=60)
        except Exception:
            proc.kill()
            raise
    assert proc.returncode in (0, 130), err[-3000:]
    assert ("mesh tensor=2" in err) == (mesh is not None), err[-3000:]


def test_prefill_chunk_must_split_over_the_sequence_axis(tmp_path):
    """Checked before the model loads: one line, exit 2."""
    port, proc = _serve(tmp_path, "--mesh", "sequence=2", "--prefill_chunk", "3", devices=2)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err[-2000:]
    assert err.strip().splitlines()[-1].startswith(
        "python -m minimax_jax.serve: error: --prefill_chunk 3 does not split over the mesh's sequence axis (2 "
        "devices): pass a multiple of 2 (4 for balanced causal work)"), err[-2000:]


def test_an_address_in_use_is_refused_before_the_model_loads(capsys, monkeypatch):
    import socket

    import minimax_jax.infer.loading as loading

    def never(*a, **k):
        raise AssertionError("loaded the model")
    monkeypatch.setattr(loading, "load_model", never)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m minimax_jax.serve: error: cannot listen on 127.0.0.1:") and "in use" in err, err
    assert main(["--host", "no-such-host.invalid"]) == 2
    assert "--host 'no-such-host.invalid'" in capsys.readouterr().err
