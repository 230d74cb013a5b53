"""``run.run_dir`` is new, empty or a run directory of train.py: a folder holding other files is refused (one
line, exit status 2, nothing written, before any data is prepared or anything compiled), in ``RunLock`` and in
``train.py`` (and ``--check_only`` says so)."""

import os

import pytest

from minimax_jax.train.run_lock import LOCK_NAME, RunDirError, RunLock, is_run_dir, run_dir_problem
from tests.checkpoint_helpers import snapshot
from tests.train_helpers import micro_train_dict, train_script_main, write_yaml



def test_run_lock_takes_new_empty_and_run_folders_only(tmp_path):
    for d in (tmp_path / "new", tmp_path / "empty"):
        if d.name == "empty":
            d.mkdir()
        assert run_dir_problem(str(d)) is None
        with RunLock(str(d)):
            assert is_run_dir(str(d))
        assert run_dir_problem(str(d)) is None            # now a run folder: resumed
    old = tmp_path / "old_run"                            # a run from before the lock file
    (old / "checkpoints").mkdir(parents=True)
    (old / "model_config.yaml").write_text("{}")
    assert is_run_dir(str(old)) and run_dir_problem(str(old)) is None
    other = tmp_path / "paper"
    other.mkdir()
    (other / "config.yaml").write_text("my own config")
    with pytest.raises(RunDirError, match=f"not a train.py run directory \\(no {LOCK_NAME}\\)"):
        RunLock(str(other))
    assert os.listdir(other) == ["config.yaml"]
    (f := tmp_path / "file").write_text("x")
    assert "is a file" in run_dir_problem(str(f))


def test_train_py_refuses_a_folder_of_other_files(tmp_path, capsys):
    run = tmp_path / "results"
    run.mkdir()
    (run / "config.yaml").write_text("someone's config")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    before = snapshot(run)
    cfg = write_yaml(micro_train_dict(str(run), run={"steps": 1}), str(tmp_path / "c.yaml"))
    main = train_script_main()
    assert main(["--config", cfg]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if "compilation cache" not in x]
    assert len(err) == 1 and f"run.run_dir {str(run)!r} is a folder with files that is not a train.py run" in err[0]
    assert snapshot(run) == before
    assert main(["--config", cfg, "--check_only"]) == 2
    assert "# run_dir: run.run_dir" in capsys.readouterr().out and snapshot(run) == before
