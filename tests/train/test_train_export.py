"""A training run's params exported as an inference checkpoint load back exactly."""

import subprocess
import sys

import jax
import numpy as np

from minimax_jax.convert import load_checkpoint
from minimax_jax.train.export import export_run, latest_params


def test_export_run_roundtrip(tmp_path, capsys):
    run = tmp_path / "run"
    subprocess.run([sys.executable, "train.py", "--config", "configs/train/tiny-m3.yaml", "--set",
                    f"run.run_dir={run}", "--set", "run.steps=1", "--set", "run.progress=false",
                    "--set", "model.msa_impl=xla"],
                   check=True, capture_output=True, timeout=600)
    step, trained = latest_params(str(run))
    out = export_run(str(run), str(tmp_path / "ckpt"), dtype="float32", hf_dst=str(tmp_path / "hf"))
    assert out["step"] == step == 1 and out["hf"]["tensors"] > 0 and out["tokenizer"] is None
    from minimax_jax.train.export import main
    main(["--run_dir", str(run), "--dst", str(tmp_path / "ckpt2")])     # the CLI says the tokenizer is missing
    assert "the run has no tokenizer (synthetic data?)" in capsys.readouterr().err
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


def test_refused_resume_keeps_run_files_and_export_checks_shapes(tmp_path):
    """A resume refused for another model config rewrites neither config.yaml nor model_config.yaml;
    an export whose model_config.yaml does not fit the params fails naming them and writes nothing."""
    import pytest
    import yaml

    from minimax_jax.train import export as export_mod
    from tests.train_helpers import micro_train_dict, run_train_cli, subprocess_env, write_yaml

    run = tmp_path / "run"
    cfg = write_yaml(micro_train_dict(str(run), run={"steps": 1}, checkpoint={"every": 1, "keep": 1}),
                     str(tmp_path / "train.yaml"))
    env = subprocess_env()
    out = run_train_cli(cfg, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    before = {n: (run / n).read_text() for n in ("config.yaml", "model_config.yaml")}
    out = run_train_cli(cfg, "model.hidden_size=64", env=env)
    assert out.returncode == 2
    assert "different model config (fields ['hidden_size'])" in out.stderr
    assert {n: (run / n).read_text() for n in before} == before

    # model_config.yaml rewritten for another model (what an older train.py did on a refused resume)
    mc = yaml.safe_load(before["model_config.yaml"])
    (run / "model_config.yaml").write_text(yaml.safe_dump({**mc, "hidden_size": 64}, sort_keys=False))
    dst = tmp_path / "ckpt"
    with pytest.raises(export_mod.ExportMismatch, match=r"do not match .*model_config\.yaml \(\d+ parameters: "
                       r"params\[.*config \[.*64.*\], checkpoint \[.*32.*\]"):
        export_run(str(run), str(dst), dtype="float32")
    assert not dst.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["run", "train.yaml"]
    with pytest.raises(SystemExit) as e:
        export_mod.main(["--run_dir", str(run), "--dst", str(dst)])
    assert str(e.value.code).startswith("export: the params of checkpoint step 1 do not match")
    assert "the checkpoint was saved with hidden_size=32: put that value back in model_config.yaml" in e.value.code
    assert "\n" not in str(e.value.code) and not dst.exists()
