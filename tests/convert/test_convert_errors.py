"""Bad input: each problem gives an error naming the tensor (or file) with expected vs actual, a
non-zero CLI exit, and no destination left behind (nor a partial directory)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from minimax_jax.convert import errors
from minimax_jax.convert.cli import main
from minimax_jax.convert.hf_to_orbax import convert_hf_to_orbax
from tests import hf_fixtures as hf
from tests.convert import test_convert_fixtures as fx

L1 = "model.layers.1."


def _fixture(tmp_path, fp8=False):
    """A valid 2-layer M2 hub checkpoint (3 shards); returns (dir, tensors dict of torch tensors)."""
    model = fx.wide_m2(41) if fp8 else hf.m2_model(41)
    d = str(tmp_path / "src")
    _, tensors = fx.hub_checkpoint(model, d, fp8=fp8)
    return d, tensors


def _rewrite(d, tensors):
    for f in os.listdir(d):
        if f.endswith(".safetensors") or f.endswith(".index.json"):
            os.remove(os.path.join(d, f))
    fx.write_shards(tensors, d, 3)


def _edit_config(d, **kw):
    p = os.path.join(d, "config.json")
    with open(p) as f:
        c = json.load(f)
    c.update(kw)
    with open(p, "w") as f:
        json.dump(c, f)


def _expect_failure(tmp_path, src, exc, *needles, capsys=None):
    dst = tmp_path / "out"
    with pytest.raises(exc) as ei:
        convert_hf_to_orbax(src, dst, "float32", progress=False)
    msg = str(ei.value)
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    rc = main(["--src", src, "--dst", str(dst), "--no_progress"])
    assert rc == 1
    if capsys is not None:
        err = capsys.readouterr().err
        for n in needles:
            assert n in err
    assert not dst.exists()
    assert not [p for p in os.listdir(tmp_path) if "partial" in p]
    return msg


def test_missing_tensor(tmp_path, capsys):
    hf.require_hf()
    src, t = _fixture(tmp_path)
    del t[L1 + "block_sparse_moe.experts.2.w3.weight"]
    _rewrite(src, t)
    _expect_failure(tmp_path, src, errors.MissingTensorError, L1 + "block_sparse_moe.experts.2.w3.weight",
                    "expected shape [16, 32]", capsys=capsys)


def test_unknown_tensor(tmp_path, capsys):
    hf.require_hf()
    import torch

    src, t = _fixture(tmp_path)
    t[L1 + "self_attn.rope_bias"] = torch.zeros(3)
    _rewrite(src, t)
    _expect_failure(tmp_path, src, errors.UnknownTensorError, L1 + "self_attn.rope_bias", capsys=capsys)


def test_wrong_shape(tmp_path, capsys):
    hf.require_hf()
    import torch

    src, t = _fixture(tmp_path)
    t[L1 + "self_attn.q_proj.weight"] = torch.zeros(48, 31)
    _rewrite(src, t)
    _expect_failure(tmp_path, src, errors.TensorShapeError, L1 + "self_attn.q_proj.weight",
                    "expected shape [48, 32]", "got [48, 31]", capsys=capsys)


def test_wrong_dtype(tmp_path, capsys):
    hf.require_hf()
    import torch

    src, t = _fixture(tmp_path)
    t["model.norm.weight"] = torch.ones(32, dtype=torch.int32)
    _rewrite(src, t)
    _expect_failure(tmp_path, src, errors.TensorDtypeError, "model.norm.weight", "dtype I32",
                    "expected one of ('F32', 'BF16', 'F16')", capsys=capsys)


def test_truncated_shard(tmp_path, capsys):
    hf.require_hf()
    src, _ = _fixture(tmp_path)
    shard = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))[1]
    p = os.path.join(src, shard)
    size = os.path.getsize(p)
    with open(p, "r+b") as f:
        f.truncate(size - 100)
    msg = _expect_failure(tmp_path, src, errors.CorruptFileError, shard, "truncated", capsys=capsys)
    assert f"the file has {size - 100} bytes" in msg


def test_missing_shard_file(tmp_path):
    hf.require_hf()
    src, _ = _fixture(tmp_path)
    shard = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))[0]
    os.remove(os.path.join(src, shard))
    _expect_failure(tmp_path, src, errors.CorruptFileError, shard, "does not exist")


@pytest.mark.parametrize("change, exc, needles", [
    (dict(hidden_size=48, head_dim=8), errors.TensorShapeError,
     ("model.layers.0.input_layernorm.weight", "expected shape [48]", "got [32]", "config/weights mismatch")),
    (dict(num_local_experts=4), errors.UnknownTensorError, ("block_sparse_moe.experts.4.w1.weight",)),
    (dict(num_hidden_layers=3), errors.MissingTensorError, ("model.layers.2.",)),
    (dict(vocab_size=96), errors.TensorShapeError, ("expected shape [96, 32]", "got [97, 32]")),
])
def test_config_weights_mismatch(tmp_path, change, exc, needles):
    hf.require_hf()
    src, _ = _fixture(tmp_path)
    _edit_config(src, **change)
    _expect_failure(tmp_path, src, exc, *needles)


def test_fp8_without_scale_and_with_bad_scale(tmp_path):
    hf.require_hf()
    import torch

    src, t = _fixture(tmp_path, fp8=True)
    name = L1 + "block_sparse_moe.experts.0.w2.weight"  # [200, 136]: scale [2, 2]
    scale = t.pop(name + "_scale_inv")
    _rewrite(src, t)
    _expect_failure(tmp_path, src, errors.TensorDtypeError, name, "F8_E4M3", "_scale_inv' is missing")
    t[name + "_scale_inv"] = torch.ones(2, 1)
    _rewrite(src, t)
    _expect_failure(tmp_path, src, errors.TensorShapeError, name + "_scale_inv", "expected shape [2, 2]",
                    "got [2, 1]")
    assert scale.shape == (2, 2)


def test_existing_destination_is_refused_and_kept(tmp_path, capsys):
    hf.require_hf()
    src, _ = _fixture(tmp_path)
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("x")
    # not written by the converter: said at once (no advice to pass --overwrite, which would not replace it)
    assert main(["--src", src, "--dst", str(dst), "--no_progress"]) == 2        # a usage error
    err = capsys.readouterr().err
    assert "was not written by minimax-jax" in err and "--overwrite" not in err, err
    assert os.listdir(dst) == ["keep.txt"]
    # --overwrite replaces only a directory the converter wrote: this one is not
    assert main(["--src", src, "--dst", str(dst), "--no_progress", "--overwrite"]) == 2
    assert "was not written by minimax-jax" in capsys.readouterr().err
    assert os.listdir(dst) == ["keep.txt"]


def test_failure_while_writing_leaves_nothing(tmp_path, monkeypatch):
    """An error in the middle of the data pass (after orbax started writing) removes the partial dir."""
    hf.require_hf()
    from minimax_jax.convert import hf_to_orbax

    src, _ = _fixture(tmp_path)
    calls = {"n": 0}
    real = hf_to_orbax.fill_unit

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 7:
            raise OSError("disk on fire")
        return real(*a, **k)

    monkeypatch.setattr(hf_to_orbax, "fill_unit", flaky)
    with pytest.raises(Exception, match="disk on fire"):
        convert_hf_to_orbax(src, tmp_path / "out", progress=False)
    assert calls["n"] >= 7
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_killed_conversion_leaves_no_destination(tmp_path):
    """SIGKILL mid-conversion: the destination never appears; only a hidden ``.out.partial-*`` is left."""
    hf.require_hf()
    src, _ = _fixture(tmp_path)
    dst = tmp_path / "out"
    code = textwrap.dedent(f"""
        import time
        from minimax_jax.convert import assemble
        real = assemble.PieceReader.__call__
        def slow(self, *a, **k):
            time.sleep(0.2)
            return real(self, *a, **k)
        assemble.PieceReader.__call__ = slow
        from minimax_jax.convert.hf_to_orbax import convert_hf_to_orbax
        convert_hf_to_orbax({src!r}, {str(dst)!r}, progress=False)
    """)
    env = dict(os.environ, PYTHONPATH=os.getcwd(), JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=os.getcwd())
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            partial = [p for p in os.listdir(tmp_path) if p.startswith(".out.partial-")]
            if partial and os.listdir(tmp_path / partial[0]):  # orbax has started writing
                break
            assert proc.poll() is None, "conversion finished before it could be interrupted"
            time.sleep(0.05)
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not dst.exists()
    left = os.listdir(tmp_path)
    assert [p for p in left if p.startswith(".out.partial-")], left
    assert not (tmp_path / [p for p in left if p.startswith(".out.partial-")][0] / "config.yaml").exists()


def test_load_checkpoint_with_mismatched_config(tmp_path):
    hf.require_hf()
    from minimax_jax.convert.load import load_checkpoint

    src, _ = _fixture(tmp_path)
    cfg, _ = convert_hf_to_orbax(src, tmp_path / "out", "float32", progress=False)
    with pytest.raises(errors.CheckpointError, match=r"params\['embed'\]\['embedding'\]: config expects shape "
                                                     r"\[97, 48\], checkpoint has \[97, 32\]"):
        load_checkpoint(tmp_path / "out", cfg.replace(hidden_size=48, head_dim=8))
    _, params = load_checkpoint(tmp_path / "out", dtype="bfloat16")
    assert str(params["embed"]["embedding"].dtype) == "bfloat16"
    assert params["segments"][0]["mlp"]["router"].dtype == np.float32


def test_cli_names_its_flags_and_export_files_get_the_usual_mode(tmp_path, capsys):
    """A missing --src says the directory does not exist; an existing --dst names --overwrite (the
    library names its argument); the exported .safetensors get the mode every other written file
    gets (0o644 under umask 022), not safetensors' 0o600."""
    from minimax_jax.convert.export import export_orbax_to_hf
    from tests.train_helpers import random_params
    from tests import infer_helpers as H

    nope = str(tmp_path / "nope")
    for extra in ([], ["--export"]):
        assert main([*extra, "--src", nope, "--dst", str(tmp_path / "out"), "--no_progress"]) == 2
        assert capsys.readouterr().err == f"python -m minimax_jax.convert: error: --src {nope}: directory does not exist\n"
    assert not (tmp_path / "out").exists()

    cfg = H.tiny_config(64)
    ckpt = H.save_checkpoint(str(tmp_path / "ours"), cfg, random_params(cfg))
    (tmp_path / "taken").mkdir()
    assert main(["--export", "--src", ckpt, "--dst", str(tmp_path / "taken"), "--no_progress"]) == 2
    err = capsys.readouterr().err
    assert err == f"python -m minimax_jax.convert: error: --dst {tmp_path / 'taken'} already exists; pass --overwrite to replace it, or choose " \
                  "another --dst\n"
    with pytest.raises(FileExistsError) as e:
        export_orbax_to_hf(ckpt, tmp_path / "taken", progress=False)
    assert "overwrite=True" in str(e.value) and "--overwrite" not in str(e.value)

    old = os.umask(0o022)
    try:
        assert main(["--export", "--src", ckpt, "--dst", str(tmp_path / "hf"), "--no_progress",
                     "--max_shard_mb", "0.000001"]) == 0
    finally:
        os.umask(old)
    files = sorted(os.listdir(tmp_path / "hf"))
    assert sum(f.endswith(".safetensors") for f in files) >= 2
    assert {f: oct(os.stat(tmp_path / "hf" / f).st_mode & 0o777) for f in files} == {f: "0o644" for f in files}
