"""One training process per run directory: a second ``train.py`` on a busy ``run_dir`` exits 2 at once
with one line naming the first (pid, host) while the first trains on; a run killed with SIGKILL
leaves a stale lock that does not stop the resume."""

import os
import signal
import socket
import time

import pytest

from minimax_jax.train.run_lock import LOCK_NAME, RunDirLockedError, RunLock, lock_holder
from tests.train_helpers import micro_train_dict, subprocess_env, train_script_main, write_yaml
from tests.train_run_helpers import loss_steps, popen_train, saved_steps, wait_for_step
from tests.train_run_helpers import no_leftover_runs  # noqa: F401  (autouse fixture)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lock")
    d = micro_train_dict(str(tmp / "unused"), checkpoint={"every": 2, "keep": 2})
    return tmp, write_yaml(d, str(tmp / "train.yaml")), subprocess_env()


def test_lock_is_exclusive_and_names_its_holder(tmp_path):
    run_dir = str(tmp_path / "run")
    with RunLock(run_dir):
        assert lock_holder(run_dir)["pid"] == os.getpid()
        with pytest.raises(RunDirLockedError, match=f"pid {os.getpid()} on host {socket.gethostname()}"):
            RunLock(run_dir)
    with RunLock(run_dir):  # released: free again
        pass


def test_second_process_exits_2_and_first_finishes(setup, capsys):
    """The second ``train.py`` is this process (train.py's ``main``: the lock is taken before any compile; no
    interpreter start-up while the first one trains on)."""
    tmp, cfg, env = setup
    run_dir = str(tmp / "busy")
    first = popen_train(cfg, f"run.run_dir={run_dir}", "run.steps=100000", "checkpoint.every=0", env=env)
    wait_for_step(run_dir, 2, first)
    capsys.readouterr()
    code = train_script_main()(["--config", cfg, "--set", f"run.run_dir={run_dir}", "--set", "run.steps=5"])
    out, stderr = capsys.readouterr()
    assert code == 2, out[-3000:] + stderr[-3000:]
    err = [x for x in stderr.strip().splitlines() if "compilation cache:" not in x]   # an info line
    assert len(err) == 1 and f"in use by another training process (pid {first.pid} on host" in err[0], err
    assert first.poll() is None                      # the first one trains on, undisturbed
    first.send_signal(signal.SIGTERM)
    out, _ = first.communicate(timeout=300)
    assert first.returncode == 130 and "preempted at step" in out, out[-3000:]
    last = max(loss_steps(run_dir))
    assert loss_steps(run_dir) == list(range(1, last + 1)) and saved_steps(run_dir) == [last]


def test_stale_lock_of_a_killed_run_does_not_block_resume(setup):
    tmp, cfg, env = setup
    run_dir = str(tmp / "stale")
    first = popen_train(cfg, f"run.run_dir={run_dir}", "run.steps=100000", env=env)
    wait_for_step(run_dir, 3, first)
    t = time.time()
    while not saved_steps(run_dir) and time.time() - t < 120:   # a finished checkpoint to resume from
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=60)
    assert lock_holder(run_dir)["pid"] == first.pid  # the dead run's lock file is still there
    assert os.path.exists(os.path.join(run_dir, LOCK_NAME))
    end = max(loss_steps(run_dir)) + 2
    again = popen_train(cfg, f"run.run_dir={run_dir}", f"run.steps={end}", env=env)
    out, _ = again.communicate(timeout=300)
    assert again.returncode == 0 and "resumed from step" in out, out[-3000:]
    assert lock_holder(run_dir)["pid"] == again.pid
    assert loss_steps(run_dir) == list(range(1, end + 1))
