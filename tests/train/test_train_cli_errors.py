"""``train.py`` on a malformed YAML or an unwritable ``run.run_dir``: one line on stderr, exit status 2,
no traceback."""

import subprocess

import pytest

from tests.train_helpers import REPO, micro_train_dict, subprocess_env, write_yaml
from tests.train_run_helpers import train_cmd


def _run(cfg, *overrides):
    return subprocess.run(train_cmd(cfg, *overrides), env=subprocess_env(), cwd=REPO, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("text,needle", [
    ("model:\n  name: tiny-m2\n run: [1, 2\n", "is not valid YAML: expected <block end>, but found "
                                               "'<block mapping start>' at line 3, column 2"),
    ("model: {name: tiny-m2\n", "is not valid YAML: "),
    (b"\xff\xfe\x00model", "is not valid YAML: 'utf-8' codec can't decode byte 0xff")])
def test_malformed_yaml_is_one_line(tmp_path, text, needle):
    p = tmp_path / "bad.yaml"
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    out = _run(str(p))
    assert out.returncode == 2, out.stderr[-3000:]
    err = out.stderr.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert err[0].startswith("train.py: configuration error: training config"), err


def test_unwritable_run_dir_is_one_line(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    cfg = write_yaml(micro_train_dict(str(blocker / "run")), str(tmp_path / "train.yaml"))
    out = _run(cfg)
    assert out.returncode == 2, out.stderr[-3000:]
    err = [x for x in out.stderr.strip().splitlines() if "compilation cache:" not in x]   # an info line
    assert len(err) == 1 and err[0] == (f"train.py: run.run_dir {str(blocker / 'run')!r} cannot be written (Not a "
                                        f"directory); choose a writable run.run_dir"), err
