"""A training run's params exported as an inference checkpoint load back exactly."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

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
    assert out["step"] == step == 1 and out["hf"]["tensors"] > 0
    assert out["tokenizer"] == "configs/tiny-data/tokenizer.json"       # the run's data.tokenizer
    from minimax_jax.convert.errors import DestinationError
    for dst, hf_dst, msg in ((tmp_path / "ck3", tmp_path / "ckpt", "holds an orbax checkpoint, not a Hugging Face"),
                             (tmp_path / "hf", None, "holds a Hugging Face export, not an orbax checkpoint")):
        with pytest.raises(DestinationError, match=msg):                 # refused before anything is written
            export_run(str(run), str(dst), dtype="float32", hf_dst=hf_dst and str(hf_dst), overwrite=True)
    assert not (tmp_path / "ck3").exists() and (tmp_path / "hf" / "config.json").exists()
    from minimax_jax.train.export import main
    (run / "config.yaml").write_text("data:\n  kind: synthetic\n")      # a run without a tokenizer:
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


def test_refused_resume_keeps_run_files_and_export_checks_shapes(tmp_path, capsys):
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
    assert export_mod.main(["--run_dir", str(run), "--dst", str(dst)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{export_mod.PROG}: error: the params of checkpoint step 1 do not match")
    assert "the checkpoint was saved with hidden_size=32: put that value back in model_config.yaml" in err
    assert err.count("\n") == 1 and not dst.exists()


def _fake_run(root, vocab: int = 64, step: int = 3):
    """A run directory as train.py leaves it (checkpoint ``step`` of a tiny model's params as random
    float32 bits, which orbax stores verbatim, model_config.yaml, metrics.jsonl), in-process."""
    import yaml

    from minimax_jax.train.checkpointing import Checkpointer
    from tests import infer_helpers as H
    from tests.train_helpers import random_params

    cfg = H.tiny_config(vocab)
    rng = np.random.default_rng(step)
    params = jax.tree.map(lambda x: rng.integers(0, 2 ** 32, x.shape, dtype=np.uint32).view(np.float32),
                          random_params(cfg))
    run = root / "run"
    ck = Checkpointer(str(run / "checkpoints"), keep=2, async_save=False)
    ck.save(step, {"params": params}, {}, {"step": step})
    ck.close()
    (run / "model_config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    return run, params


def _export_cli(capsys, *argv):
    """``(exit code, stderr)`` of the export CLI."""
    import pytest

    from minimax_jax.train.export import main

    capsys.readouterr()
    code = main([*argv, "--dtype", "float32"])        # the random-bit params hold NaNs: no cast warnings
    return code, capsys.readouterr().err


def test_export_never_deletes_its_run_or_anything_beside_it(tmp_path, capsys):
    """--dst equal to the run directory, its parent, or a folder inside it: exit 2, one line naming
    both paths, every file of the run and an unrelated file beside it left as they were (also
    with --overwrite)."""
    from tests.checkpoint_helpers import snapshot

    work = tmp_path / "work"
    work.mkdir()
    run, _ = _fake_run(work)
    (work / "notes.txt").write_text("unrelated")
    before = snapshot(work)
    for dst in (run, work, run / "export", tmp_path / "work" / "." / "run"):
        for extra in ([], ["--overwrite"]):
            code, err = _export_cli(capsys, "--run_dir", str(run), "--dst", str(dst), *extra)
            assert code == 2, (dst, extra, err)
            assert err.count("\n") == 1 and str(run) in err and str(os.path.abspath(dst)) in err, err
            assert snapshot(work) == before
    code, err = _export_cli(capsys, "--run_dir", str(run), "--dst", str(tmp_path / "ck"), "--hf_dst", str(work))
    assert code == 2 and "nothing was written" in err and not (tmp_path / "ck").exists()
    assert snapshot(work) == before


def test_export_overwrites_only_an_earlier_export(tmp_path, capsys):
    from tests.checkpoint_helpers import snapshot

    run, params = _fake_run(tmp_path)
    dst = tmp_path / "ckpt"
    assert _export_cli(capsys, "--run_dir", str(run), "--dst", str(dst))[0] == 0
    code, err = _export_cli(capsys, "--run_dir", str(run), "--dst", str(dst))
    assert code == 2 and err == f"python -m minimax_jax.train.export: error: {dst} already exists; pass --overwrite to replace it (only a directory " \
                                "export wrote is ever replaced), or choose another destination\n"
    assert _export_cli(capsys, "--run_dir", str(run), "--dst", str(dst), "--overwrite")[0] == 0
    _, back = load_checkpoint(dst)
    np.testing.assert_array_equal(np.asarray(back["lm_head"]).view(np.uint32), params["lm_head"].view(np.uint32))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "data.bin").write_bytes(b"keep")
    before = snapshot(tmp_path)
    code, err = _export_cli(capsys, "--run_dir", str(run), "--dst", str(mine), "--overwrite")
    assert code == 2 and "was not written by minimax-jax" in err and snapshot(tmp_path) == before


def test_export_refuses_a_tokenizer_beyond_the_vocabulary(tmp_path, capsys):
    """A 300-id tokenizer for a 64-token model is refused naming both sizes (infer would fail on
    ids >= 64); the same tokenizer with a 384-token model is bundled."""
    from minimax_jax.data.tokenizer import save_tokenizer
    from tests import infer_helpers as H

    save_tokenizer(H.tiny_tokenizer(), str(tmp_path / "tok"))
    tok = str(tmp_path / "tok" / "tokenizer.json")
    run, _ = _fake_run(tmp_path / "small")
    code, err = _export_cli(capsys, "--run_dir", str(run), "--dst", str(tmp_path / "ck"), "--tokenizer", tok)
    assert code == 2 and err.count("\n") == 1, err
    assert "has 300 tokens (ids up to 299) but the model's vocab_size is 64" in err and tok in err
    assert not (tmp_path / "ck").exists()
    run, _ = _fake_run(tmp_path / "big", vocab=384)
    assert _export_cli(capsys, "--run_dir", str(run), "--dst", str(tmp_path / "ck"), "--tokenizer", tok)[0] == 0
    assert (tmp_path / "ck" / "tokenizer.json").read_bytes() == open(tok, "rb").read()


def test_export_of_a_corrupt_run_names_the_tensor(tmp_path, capsys):
    from tests.checkpoint_helpers import flip_byte_of

    run, params = _fake_run(tmp_path)
    flip_byte_of(str(run / "checkpoints" / "3" / "state"), params["lm_head"])
    code, err = _export_cli(capsys, "--run_dir", str(run), "--dst", str(tmp_path / "ck"))
    assert code == 1 and err == (f"python -m minimax_jax.train.export: error: checkpoint {run}/checkpoints/3: tensor 'params.lm_head' checksum mismatch "
                                 "(file flipped or truncated); restore it from a good copy\n")
    assert not (tmp_path / "ck").exists()
    assert _export_cli(capsys, "--run_dir", str(run), "--dst", str(tmp_path / "ck"), "--no_verify")[0] == 0
