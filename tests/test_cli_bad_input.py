"""Bad input to the CLIs fails early with one clear line and a non-zero status; asking for help exits 0
(found by a fresh-user trial, session 10)."""

import json
import os
import subprocess
import sys

import pytest

from minimax_jax.eval import cli as eval_cli
from minimax_jax.eval import recall
from minimax_jax.train import train
from minimax_jax.train.config import TrainConfigError, from_dict, load_train_config
from tests.train_helpers import REPO, micro_train_dict, subprocess_env


def _never(*a, **k):
    raise AssertionError("reached the model")


@pytest.mark.parametrize("flag,value,needle", [
    ("--num_samples", "0", "must be >= 1"), ("--batch_size", "-2", "must be >= 1"),
    ("--max_new_tokens", "0", "must be >= 1"), ("--prefill_chunk", "-1", "must be >= 1"),
    ("--ppl_seq_len", "0", "must be >= 2"), ("--ppl_max_tokens", "-1", "must be >= 2"),
    ("--ppl_batch_size", "0", "must be >= 1"), ("--max_seq_len", "-5", "must be >= 2"),
    ("--time_budget_s", "-5", "seconds >= 0"), ("--num_samples", "two", "expected an integer"),
    ("--attention", "sparse", "invalid choice")])
def test_eval_bad_values_are_argument_errors(flag, value, needle, capsys):
    with pytest.raises(SystemExit) as e:
        eval_cli.main(["--checkpoint", "ckpt", flag, value])
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_eval_unwritable_out_and_missing_ppl_files_fail_before_the_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(eval_cli, "load_model_fns", _never)
    monkeypatch.setattr(eval_cli, "generate_suite", _never)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    cases = [(["--out", str(tmp_path / "no" / "r.json")], "does not exist"),
             (["--out", str(tmp_path)], "is a directory"),
             (["--ppl_files", str(tmp_path / "missing.txt")], "is not a file"),
             (["--ppl_files", str(empty)], "is empty")]
    for extra, needle in cases:
        assert eval_cli.main(["--checkpoint", "ckpt", *extra]) == 2
        err = capsys.readouterr().err
        assert needle in err and err.startswith("python -m minimax_jax.eval: error:"), err


def test_eval_lengths_over_max_seq_len_are_refused(tmp_path, monkeypatch, capsys):
    """--max_seq_len caps the sequence: a length that does not fit it is refused up front (it was a no-op)."""
    monkeypatch.setattr(eval_cli, "load_model_fns", _never)
    assert eval_cli.main(["--checkpoint", os.path.join(REPO, "checkpoints", "demo"), "--lengths", "1024",
                          "--max_seq_len", "512", "--no_perplexity"]) == 2
    err = capsys.readouterr().err
    assert "exceeds --max_seq_len 512" in err and "--lengths of at most" in err


def test_recall_bad_input(tmp_path, capsys):
    ckpt = os.path.join(REPO, "checkpoints", "demo")
    text = tmp_path / "t.txt"
    text.write_text("to be or not to be " * 50)
    with pytest.raises(SystemExit) as e:
        recall.main(["--checkpoint", ckpt, "--text_file", str(text), "--length", "0"])
    assert e.value.code == 2 and "--length must be >= 2" in capsys.readouterr().err
    for argv, needle in [(["--checkpoint", ckpt, "--text_file", str(tmp_path)], "is a directory; expected a text file"),
                         (["--checkpoint", str(text), "--text_file", str(text)], "is a file; expected a checkpoint"),
                         (["--checkpoint", str(tmp_path / "x"), "--text_file", str(text)], "does not exist"),
                         (["--checkpoint", ckpt, "--text_file", str(text), "--out", str(tmp_path / "no" / "r.json")],
                          "cannot be written")]:
        with pytest.raises(SystemExit) as e:
            recall.main(argv)
        assert needle in str(e.value.code), (argv, e.value.code)


@pytest.mark.parametrize("script,flag", [("infer.py", "--help"), ("train.py", "--helpshort")])
def test_help_exits_zero(script, flag):
    r = subprocess.run([sys.executable, os.path.join(REPO, script), flag], capture_output=True, text=True,
                       timeout=300, env=subprocess_env(), cwd=REPO)
    assert r.returncode == 0 and "--" in r.stdout + r.stderr
    bad = subprocess.run([sys.executable, os.path.join(REPO, script), "--no_such_flag"], capture_output=True,
                         text=True, timeout=300, env=subprocess_env(), cwd=REPO)
    assert bad.returncode != 0


def test_infer_sharding_rules_without_mesh_is_an_error():
    r = subprocess.run([sys.executable, os.path.join(REPO, "infer.py"), "--sharding_rules", "nonexistent",
                        "--prompt", "x"], capture_output=True, text=True, timeout=300, env=subprocess_env(), cwd=REPO)
    assert r.returncode == 2 and "--sharding_rules applies only with --mesh" in r.stderr


def test_empty_train_config_says_so(tmp_path):
    p = tmp_path / "empty.yaml"
    p.write_text("")
    with pytest.raises(TrainConfigError, match="is empty"):
        load_train_config(str(p))


def test_resume_past_run_steps_warns(tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    base = micro_train_dict(run_dir, data={"kind": "synthetic", "seq_len": 16, "batch_size": 2},
                            run={"steps": 1}, checkpoint={"every": 1, "async_save": False})
    assert train(from_dict(base))["step"] == 1
    capsys.readouterr()
    out = train(from_dict(json.loads(json.dumps(base))))
    text = capsys.readouterr().out
    assert out["step"] == 1 and "already at step 1 >= run.steps 1: nothing to train" in text
