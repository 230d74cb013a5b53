"""Bad input to the CLIs fails early with one clear line and exit status 2 (minimax_jax.exit_codes), a
traceback only with --debug; asking for help exits 0; renamed flags still work with one warning line;
the compilation cache is on."""

import json
import os
import subprocess
import sys

import pytest

from minimax_jax import cli_main
from minimax_jax.convert import cli as convert_cli
from minimax_jax.infer import cli as infer_cli
from minimax_jax.train import export as export_cli

from minimax_jax.eval import cli as eval_cli
from minimax_jax.eval import recall
from minimax_jax.train import train
from minimax_jax.train.config import TrainConfigError, from_dict, load_train_config
from tests.train_helpers import REPO, micro_train_dict, subprocess_env, train_script_main


def _never(*a, **k):
    raise AssertionError("reached the model")


@pytest.mark.parametrize("flag,value,needle", [
    ("--num_samples", "0", "must be >= 1"), ("--batch_size", "-2", "must be >= 1"),
    ("--max_new_tokens", "0", "must be >= 1"), ("--prefill_chunk", "-1", "must be >= 1"),
    ("--ppl_seq_len", "0", "must be >= 2"), ("--ppl_max_tokens", "-1", "must be >= 2"),
    ("--ppl_batch_size", "0", "must be >= 1"), ("--max_seq_len", "-5", "must be >= 2"),
    ("--time_budget_s", "-5", "seconds >= 0"), ("--num_samples", "two", "expected an integer"),
    ("--attention", "sparse", "invalid choice"), ("--tasks", "niah_single,niah_single", "niah_single given twice"),
    ("--lengths", "128,128", "128 given twice"), ("--lengths", "128,,256", "expected comma-separated integers")])
def test_eval_bad_values_are_argument_errors(flag, value, needle, capsys):
    with pytest.raises(SystemExit) as e:
        eval_cli.main(["--checkpoint", "ckpt", flag, value])
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_eval_unwritable_out_and_missing_ppl_files_fail_before_the_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(eval_cli, "load_model_fns", _never)
    monkeypatch.setattr(eval_cli, "generate_suite", _never)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.yaml").write_text("keep")
    prose = tmp_path / "prose.txt"
    prose.write_text("keep")
    old = tmp_path / "old.json"
    old.write_text("keep")
    cases = [(["--out", str(tmp_path / "no" / "r.json")], "does not exist"),
             (["--out", str(tmp_path)], "is a directory"),
             (["--out", str(ckpt / "config.yaml")], "is inside the checkpoint"),
             (["--out", str(ckpt / "r.json")], "is inside the checkpoint"),
             (["--ppl_files", str(prose), "--out", str(prose), "--overwrite"], "is the input file"),
             (["--out", str(old)], "exists; pass --overwrite"),
             (["--out", "/proc/r.json"], "cannot write in '/proc'"),
             (["--ppl_files", str(tmp_path / "missing.txt")], "is not a file"),
             (["--ppl_files", str(empty)], "is empty")]
    for extra, needle in cases:
        assert eval_cli.main(["--checkpoint", str(ckpt), *extra]) == 2, extra
        err = capsys.readouterr().err
        assert needle in err and err.startswith("python -m minimax_jax.eval: error:"), err
    assert [p.read_text() for p in (ckpt / "config.yaml", prose, old)] == ["keep"] * 3
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "empty.txt", "old.json", "prose.txt"]   # no probe left


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
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    for argv, needle in [(["--checkpoint", ckpt, "--text_file", str(tmp_path)], "is a directory; expected a text file"),
                         (["--checkpoint", str(text), "--text_file", str(text)], "is a file; expected a checkpoint"),
                         (["--checkpoint", str(tmp_path / "x"), "--text_file", str(text)], "does not exist"),
                         (["--checkpoint", ckpt, "--text_file", str(text), "--out", str(tmp_path / "no" / "r.json")],
                          "its directory"),
                         (["--checkpoint", str(hf), "--text_file", str(text)],
                          "is a Hugging Face folder; recall reads a minimax-jax checkpoint: convert it first")]:
        assert recall.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1 and err.startswith(recall.PROG + ": error: "), (argv, err)



def _cases(tmp):
    """(name, main, argv of a missing input file, argv of a bad value) per CLI."""
    nope = str(tmp / "nope")
    return [
        ("train", train_script_main(), ["--config", nope + ".yaml"], ["--prepare_max_mb", "0"]),
        ("infer", infer_cli.main, ["--prompt_file", nope], ["--prompt=x", "--top_k", "-1"]),
        ("convert", convert_cli.main, ["--src", nope, "--dst", str(tmp / "out")],
         ["--src", nope, "--dst", str(tmp / "out"), "--max_shard_mb", "lots"]),
        ("export", export_cli.main, ["--run_dir", nope, "--dst", str(tmp / "out")],
         ["--run_dir", nope, "--dst", str(tmp / "out"), "--max_shard_mb", "-1"]),
        ("eval", eval_cli.main, ["--checkpoint", nope, "--ppl_files", nope], ["--checkpoint", nope, "--lengths", "0"]),
        ("recall", recall.main, ["--checkpoint", nope, "--text_file", nope], ["--checkpoint", nope, "--text_file"]),
    ]


def _status(main, argv):
    try:
        return main(argv)
    except SystemExit as e:         # argparse's usage errors
        return e.code


def test_every_cli_bad_input_exits_2_with_one_line(tmp_path, capsys):
    for name, main, missing, bad in _cases(tmp_path):
        for argv, what in ((["--no_such_flag"], "unknown flag"), (missing, "missing file"), (bad, "bad value")):
            assert _status(main, argv) == 2, (name, what)
            err = [line for line in capsys.readouterr().err.splitlines() if "compilation cache:" not in line]
            assert len(err) == 1 and "error: " in err[0] and "Traceback" not in err[0], (name, what, err)
        assert not (tmp_path / "out").exists()


def test_debug_shows_the_traceback(tmp_path, capsys):
    missing = ["--prompt_file", str(tmp_path / "nope")]
    assert infer_cli.main(missing) == 2
    assert "Traceback" not in capsys.readouterr().err
    assert infer_cli.main([*missing, "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.rstrip().splitlines()[-1].startswith("infer.py: error:")
    argv = ["--checkpoint", str(tmp_path), "--text_file", str(tmp_path / "nope"), "--debug"]
    assert recall.main(argv) == 2 and "FileNotFoundError" in capsys.readouterr().err


def test_run_maps_errors_to_the_exit_code_table(capsys):
    def boom(exc):
        def main(argv):
            raise exc
        return main
    assert cli_main.run(boom(ValueError("bad")), [], prog="p", usage=(ValueError,)) == 2
    assert cli_main.run(boom(KeyError("k")), [], prog="p", usage=(ValueError,), failure=(KeyError,)) == 1
    assert cli_main.run(boom(RuntimeError("x\ny")), [], prog="p") == 1
    assert capsys.readouterr().err.splitlines()[-1] == "p: error: x; y (RuntimeError; --debug shows the traceback)"
    assert cli_main.run(boom(KeyboardInterrupt()), [], prog="p") == 130
    assert cli_main.run(lambda a: None, [], prog="p") == 0


def test_deprecated_aliases_work_with_one_warning(capsys):
    p = convert_cli.build_parser()
    a = cli_main.parse_args(p, ["--src", "s", "--dst", "d", "--max-shard-gb", "0.5", "--no-progress", "--in-flight=3",
                                "--no-verify"])
    assert (a.max_shard_mb, a.progress, a.in_flight, a.verify) == (512.0, False, 3, False)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 4 and "--max-shard-gb is deprecated; use --max_shard_mb (the value converted)" in err[0]
    a = infer_cli.parse(["--noshow_stats", "--noshow_stats", "--no_echo_prompt", "--stream"])
    assert (a.show_stats, a.echo_prompt, a.stream) == (False, False, True)
    assert capsys.readouterr().err == "infer.py: warning: --noshow_stats is deprecated; use --no_show_stats\n"


def test_compilation_cache_gets_files(tmp_path):
    """The CLIs' helper points JAX's persistent cache at $MINIMAX_JAX_CACHE: a tiny jitted run fills it."""
    child = ("import jax, jax.numpy as jnp\nfrom minimax_jax import cli_main\n"
             "d = cli_main.enable_compilation_cache(None, prog='t', min_compile_s=0)\n"
             "cli_main.enable_compilation_cache(None, prog='t', min_compile_s=0)\n"
             "print(d, jax.config.jax_compilation_cache_dir)\n"
             "jax.jit(lambda x: x * 2 + 1)(jnp.arange(3.0)).block_until_ready()\n")
    env = {k: v for k, v in subprocess_env().items() if not k.startswith("JAX_COMPILATION_CACHE")}
    cache = tmp_path / "cache"
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300, cwd=REPO,
                       env=dict(env, MINIMAX_JAX_CACHE=str(cache)))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == [str(cache), str(cache)]
    assert r.stderr.count("compilation cache:") == 1 and f"t: compilation cache: {cache}" in r.stderr
    assert any(os.scandir(cache)), "the cache folder got no entry"
    assert cli_main.enable_compilation_cache("none") is None


@pytest.mark.parametrize("script,flag", [("infer.py", "--help"), ("train.py", "-h")])
def test_help_exits_zero(script, flag, capsys):
    """The scripts' ``main`` in this process (no interpreter start-up per call; the scripts' ``__main__`` runs in
    a subprocess in tests/test_cli_startup_interrupt.py and tests/test_readme_tiny_path.py)."""
    main = infer_cli.main if script == "infer.py" else train_script_main()
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([flag])
    out, err = capsys.readouterr()
    assert e.value.code == 0 and "--" in out + err
    with pytest.raises(SystemExit) as e:
        main(["--no_such_flag"])
    assert e.value.code != 0 and f"{script}: error: unrecognized arguments: --no_such_flag" in capsys.readouterr().err


def test_infer_sharding_rules_without_mesh_is_an_error(capsys):
    assert infer_cli.main(["--sharding_rules", "nonexistent", "--prompt", "x"]) == 2
    assert "infer.py: error: --sharding_rules applies only with --mesh" in capsys.readouterr().err


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


def test_resume_with_fewer_steps_than_trained_rewrites_nothing(tmp_path, capsys):
    """run.steps below the checkpoint's step: nothing is trained, so the run's config keeps the steps it trained and no
    log record is dropped as "trained again"."""
    run_dir = str(tmp_path / "run")
    base = micro_train_dict(run_dir, data={"kind": "synthetic", "seq_len": 16, "batch_size": 2},
                            run={"steps": 2}, checkpoint={"every": 1, "async_save": False})
    assert train(from_dict(base))["step"] == 2
    files = {f: open(os.path.join(run_dir, f)).read() for f in ("config.yaml", "model_config.yaml", "metrics.jsonl")}
    capsys.readouterr()
    lower = json.loads(json.dumps(base))
    lower["run"]["steps"] = 1
    assert train(from_dict(lower))["step"] == 2
    text = capsys.readouterr().out
    assert "already at step 2 >= run.steps 1: nothing to train" in text and "dropped the log records" not in text
    assert {f: open(os.path.join(run_dir, f)).read() for f in files} == files


def test_bad_trajectory_data_exits_2_before_the_run_dir_is_made(tmp_path, monkeypatch, capsys):
    """Bad trajectory records are bad input (exit 2, no "--debug" hint), found before the run dir is created."""
    monkeypatch.chdir(REPO)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"tokens": [1, 2, 3]}\n{"tokens": [1, 2, 99999]}\n')
    run = tmp_path / "run"
    rc = train_script_main()(["--config", "configs/train/agent-tree.yaml", "--set", f"run.run_dir={run}",
                        "--set", f"data.sources=[{bad}]", "--set", "data.seq_len=64", "--set", "run.steps=1"])
    err = capsys.readouterr().err
    assert rc == 2 and f"{bad} line 2: token id 99999 is not below the model's vocab_size" in err, err
    assert "--debug" not in err and not run.exists()
