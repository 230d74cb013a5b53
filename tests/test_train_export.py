"""A training run's params exported as an inference checkpoint load back exactly."""

import subprocess
import sys

import jax
import numpy as np

from minimax_jax.convert import load_checkpoint
from minimax_jax.train.export import export_run, latest_params


def test_export_run_roundtrip(tmp_path):
    run = tmp_path / "run"
    subprocess.run([sys.executable, "train.py", "--config", "configs/train/tiny-m3.yaml", "--set",
                    f"run.run_dir={run}", "--set", "run.steps=1", "--set", "run.progress=false",
                    "--set", "model.msa_impl=xla"],
                   check=True, capture_output=True, timeout=600)
    step, trained = latest_params(str(run))
    out = export_run(str(run), str(tmp_path / "ckpt"), dtype="float32", hf_dst=str(tmp_path / "hf"))
    assert out["step"] == step == 1 and out["hf"]["tensors"] > 0
    cfg, params = load_checkpoint(tmp_path / "ckpt")
    assert (cfg.msa_impl, cfg.attention_impl, cfg.moe_impl) == ("auto",) * 3   # the run forced xla
    a = jax.tree_util.tree_flatten_with_path(trained)[0]
    b = dict((jax.tree_util.keystr(k), v) for k, v in jax.tree_util.tree_flatten_with_path(params)[0])
    assert len(a) == len(b)
    for k, v in a:
        np.testing.assert_array_equal(np.asarray(v, np.float32), np.asarray(b[jax.tree_util.keystr(k)], np.float32))
    assert (tmp_path / "hf" / "config.json").exists()


def test_run_tokenizer_found_or_named(tmp_path, monkeypatch):
    """A run names its tokenizer by a path relative to where train.py ran: the export finds it from
    there or from the run directory's parent, and otherwise fails naming it (never exports silently
    without it)."""
    import pytest

    from minimax_jax.train.export import _run_tokenizer

    (tmp_path / "work" / "tok").mkdir(parents=True)
    (tmp_path / "work" / "tok" / "tokenizer.json").write_text("{}")
    run = tmp_path / "work" / "run"
    run.mkdir()
    (run / "config.yaml").write_text("data:\n  tokenizer: tok/tokenizer.json\n")
    monkeypatch.chdir(tmp_path / "work")
    assert _run_tokenizer(str(run)) == "tok/tokenizer.json"
    monkeypatch.chdir(tmp_path)
    assert _run_tokenizer(str(run)) == str(tmp_path / "work" / "tok" / "tokenizer.json")
    (run / "config.yaml").write_text("data:\n  tokenizer: elsewhere/tokenizer.json\n")
    with pytest.raises(FileNotFoundError, match="elsewhere/tokenizer.json.*--tokenizer"):
        _run_tokenizer(str(run))
    (run / "config.yaml").write_text("data:\n  seq_len: 8\n")
    assert _run_tokenizer(str(run)) is None
