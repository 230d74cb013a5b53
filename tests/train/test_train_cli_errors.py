"""``train.py`` on a malformed YAML or an unwritable ``run.run_dir``: one line on stderr, exit status 2,
no traceback. The checks call train.py's ``main`` in this process (they end before any compile: a subprocess per
case would mostly time the interpreter's start-up); the script's exit status 2 from a subprocess is checked by
tests/train/test_train_check_only.py::test_missing_data_without_prepare_fails_clearly."""

from types import SimpleNamespace

import pytest

from tests.train_helpers import micro_train_dict, train_script_main, write_yaml


@pytest.fixture
def _run(capsys):
    """``train.py --config CFG --set O ...`` -> ``(returncode, stderr)`` (as ``subprocess.run``'s result)."""
    main = train_script_main()

    def run(cfg, *overrides):
        capsys.readouterr()
        code = main(["--config", cfg, *(a for o in overrides for a in ("--set", o))])
        return SimpleNamespace(returncode=code, stderr=capsys.readouterr().err)
    return run


@pytest.mark.parametrize("text,needle", [
    ("model:\n  name: tiny-m2\n run: [1, 2\n", "is not valid YAML: expected <block end>, but found "
                                               "'<block mapping start>' at line 3, column 2"),
    ("model: {name: tiny-m2\n", "is not valid YAML: "),
    (b"\xff\xfe\x00model", "is not valid YAML: 'utf-8' codec can't decode byte 0xff")])
def test_malformed_yaml_is_one_line(tmp_path, text, needle, _run):
    p = tmp_path / "bad.yaml"
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    out = _run(str(p))
    assert out.returncode == 2, out.stderr[-3000:]
    err = out.stderr.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert err[0].startswith("train.py: configuration error: training config"), err


def test_unwritable_run_dir_is_one_line(tmp_path, _run):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    cfg = write_yaml(micro_train_dict(str(blocker / "run")), str(tmp_path / "train.yaml"))
    out = _run(cfg)
    assert out.returncode == 2, out.stderr[-3000:]
    err = [x for x in out.stderr.strip().splitlines() if "compilation cache:" not in x]   # an info line
    assert len(err) == 1 and err[0] == (f"train.py: run.run_dir {str(blocker / 'run')!r} cannot be written (Not a "
                                        f"directory); choose a writable run.run_dir"), err
