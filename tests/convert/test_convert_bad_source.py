"""Wrong kinds of source and destination are bad input (exit 2, one line, nothing written, decided
before the work); Ctrl-C during a conversion exits 130 with one line and leaves no hidden directory."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from minimax_jax.config import ConfigError, ModelConfig
from minimax_jax.convert import atomic_dir, export
from minimax_jax.convert.cli import main
from minimax_jax.convert.synthetic import wide_config, write_synthetic_checkpoint

PROG = "python -m minimax_jax.convert: error: "


@pytest.fixture(scope="module")
def hf_src(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("hf") / "src")
    write_synthetic_checkpoint(wide_config(hidden=128, layers=2, experts=4, inter=128, vocab=512), d)
    return d


@pytest.fixture(scope="module")
def ours(hf_src, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("ours") / "ck")
    assert main(["--src", hf_src, "--dst", d, "--no_progress"]) == 0
    return d


def _usage(capsys, argv, *needles):
    assert main([*argv, "--no_progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(PROG) and "--debug" not in err, err
    for n in needles:
        assert n in err, (n, err)
    return err


def _copy_with_config(src, d, text):
    os.makedirs(d)
    for f in os.listdir(src):
        if f != "config.json":
            os.symlink(os.path.join(src, f), os.path.join(d, f))
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write(text)
    return d


def test_destination_under_a_file(hf_src, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    _usage(capsys, ["--src", hf_src, "--dst", str(tmp_path / "afile" / "x")],
           f"parent {tmp_path / 'afile'} is not a directory")
    _usage(capsys, ["--src", hf_src, "--dst", str(tmp_path / "afile" / "x" / "y")], "is not a directory")
    assert sorted(os.listdir(tmp_path)) == ["afile"]


def test_wrong_kind_of_source(hf_src, ours, tmp_path, capsys):
    cfg = json.load(open(os.path.join(hf_src, "config.json")))
    dst = str(tmp_path / "out")
    _usage(capsys, ["--src", ours, "--dst", dst], "config.json not found", "add --export")
    (tmp_path / "empty").mkdir()
    _usage(capsys, ["--src", str(tmp_path / "empty"), "--dst", dst], "config.json not found")
    _usage(capsys, ["--src", hf_src, "--dst", dst, "--weights_dtype", "fp8"], "has no FP8")
    cases = [("{bad", ["config.json: not valid JSON (line 1, column 2)"]),
             ("", ["config.json: not valid JSON"]),
             ("[1, 2]", ["expected a JSON object"]),
             (json.dumps({**cfg, "num_attention_heads": "x"}), ["'num_attention_heads' must be an integer, got 'x'"]),
             (json.dumps({**cfg, "hidden_size": 128.7}), ["'hidden_size' must be an integer, got 128.7"]),
             (json.dumps({**cfg, "rms_norm_eps": "small"}), ["'rms_norm_eps' must be a number"])]
    for i, (text, needles) in enumerate(cases):
        src = _copy_with_config(hf_src, str(tmp_path / f"bad{i}"), text)
        _usage(capsys, ["--src", src, "--dst", dst], *needles)
    assert not os.path.exists(dst) and not [p for p in os.listdir(tmp_path) if "partial" in p]


def test_hf_config_integral_float_accepted_fractional_refused(hf_src):
    cfg = json.load(open(os.path.join(hf_src, "config.json")))
    assert ModelConfig.from_hf_config({**cfg, "hidden_size": 128.0}).hidden_size == 128
    assert isinstance(ModelConfig.from_hf_config({**cfg, "hidden_size": 128.0}).hidden_size, int)
    for field, value in (("hidden_size", 128.7), ("num_hidden_layers", True), ("vocab_size", "512")):
        with pytest.raises(ConfigError, match=f"'{field}' must be an integer"):
            ModelConfig.from_hf_config({**cfg, field: value})


def test_export_overwrite_of_an_earlier_export_with_other_shards(ours, tmp_path, capsys, monkeypatch):
    hf = tmp_path / "hf"
    assert main(["--export", "--src", ours, "--dst", str(hf), "--max_shard_mb", "0.5", "--no_progress"]) == 0
    many = sorted(f for f in os.listdir(hf) if f.endswith(".safetensors"))
    assert len(many) > 2
    assert main(["--export", "--src", ours, "--dst", str(hf), "--overwrite", "--no_progress"]) == 0
    assert sorted(f for f in os.listdir(hf) if f.endswith(".safetensors")) == ["model-00001-of-00001.safetensors"]
    assert not [p for p in os.listdir(tmp_path) if ".partial-" in p]
    # a user's file still blocks --overwrite, and that is decided before any tensor is read
    (hf / "notes.txt").write_text("mine")
    before = sorted(os.listdir(hf))

    def no_work(*a, **k):
        raise AssertionError("the export started before the destination was refused")

    monkeypatch.setattr(export, "_LeafStore", no_work)
    _usage(capsys, ["--export", "--src", ours, "--dst", str(hf), "--overwrite"],
           "holds entries this tool did not write (notes.txt)", "nothing was replaced")
    assert sorted(os.listdir(hf)) == before and (hf / "notes.txt").read_text() == "mine"


def test_overwrite_of_a_conversion_with_a_user_file_is_refused_up_front(hf_src, ours, tmp_path, capsys, monkeypatch):
    from minimax_jax.convert import hf_to_orbax

    dst = tmp_path / "ck"
    assert main(["--src", hf_src, "--dst", str(dst), "--no_progress"]) == 0
    (dst / "my_notes.txt").write_text("mine")
    monkeypatch.setattr(hf_to_orbax, "save_lazy_tree", lambda *a, **k: pytest.fail("work started"))
    _usage(capsys, ["--src", hf_src, "--dst", str(dst), "--overwrite"], "my_notes.txt", "nothing was replaced")
    assert (dst / "my_notes.txt").read_text() == "mine"


@pytest.mark.skipif(signal.getsignal(signal.SIGINT) is not signal.default_int_handler,
                    reason="needs Python's default SIGINT handler")
@pytest.mark.parametrize("phase", ["commit", "cleanup"])
def test_ctrl_c_during_commit_or_cleanup_is_held_until_done(tmp_path, monkeypatch, phase):
    """Ctrl-C while the old output is deleted (overwrite) or the temporary one removed (failure): the
    removal finishes, then KeyboardInterrupt; no ``.partial-*`` / ``.old`` directory is left."""
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "minimax_manifest.json").write_text(json.dumps({"format": "minimax-jax manifest v1", "tensors": {}}))
    (dst / "params").mkdir()
    for i in range(50):
        (dst / "params" / f"f{i}").write_text("old")
    real = atomic_dir.shutil.rmtree

    def interrupted_rmtree(path, *a, **k):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)            # the handler runs here, in the middle of the removal
        return real(path, *a, **k)

    monkeypatch.setattr(atomic_dir.shutil, "rmtree", interrupted_rmtree)
    with pytest.raises(KeyboardInterrupt):
        with atomic_dir.atomic_output_dir(dst, overwrite=True, kind="orbax") as tmp:
            os.mkdir(os.path.join(tmp, "params"))
            open(os.path.join(tmp, "minimax_manifest.json"), "w").write("{}")
            if phase == "cleanup":
                raise KeyboardInterrupt
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert sorted(os.listdir(tmp_path)) == ["out"]
    if phase == "commit":
        assert os.listdir(dst / "params") == []         # the new output is in place, the old one gone
    else:
        assert len(os.listdir(dst / "params")) == 50    # the old output untouched


def test_ctrl_c_during_conversion(tmp_path):
    """SIGINT while orbax is writing: exit 130, one ``interrupted`` line, no destination, no hidden
    partial directory (orbax's writer threads must not re-create it or print tracebacks)."""
    src = str(tmp_path / "hf")
    write_synthetic_checkpoint(wide_config(hidden=256, layers=6, experts=8, inter=256, vocab=2000), src)
    dst = tmp_path / "out"
    code = textwrap.dedent(f"""
        import sys, time
        from minimax_jax.convert import assemble
        real = assemble.PieceReader.__call__
        def slow(self, *a, **k):
            time.sleep(0.02)
            return real(self, *a, **k)
        assemble.PieceReader.__call__ = slow
        from minimax_jax.convert.cli import main
        sys.exit(main(["--src", {src!r}, "--dst", {str(dst)!r}, "--no_progress"]))
    """)
    env = dict(os.environ, PYTHONPATH=os.getcwd(), JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=os.getcwd(), stderr=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and proc.poll() is None:
            partial = [p for p in os.listdir(tmp_path) if p.startswith(".out.partial-")]
            if partial and os.path.isdir(tmp_path / partial[0]) and os.listdir(tmp_path / partial[0]):
                break                                   # orbax has started writing
            time.sleep(0.02)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".out.")], os.listdir(tmp_path)
    if proc.returncode != 0:        # interrupted (not finished before the signal came)
        assert proc.returncode == 130, err
        assert err == "python -m minimax_jax.convert: interrupted (Ctrl-C)\n", err
        assert not dst.exists()
    else:
        assert (dst / "minimax_manifest.json").is_file()
