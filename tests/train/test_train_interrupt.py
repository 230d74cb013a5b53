"""Ctrl-C during training: ``train.py`` finishes the step, saves it, exits 130 with one line and no
traceback; the same command resumes to the end with every step logged once and the losses of an
uninterrupted run; a second Ctrl-C aborts at once (130, nothing saved).

``train.py`` runs in subprocesses (micro model, synthetic data) with SIGINT at its default; the resume and the
uninterrupted reference run train.py's ``main`` in this process.
"""

import os
import re
import signal
import time

import numpy as np
import pytest

from tests.train_helpers import micro_train_dict, subprocess_env, train_script_main, write_yaml
from tests.train_run_helpers import OutputReader, loss_steps, popen_train, rows, saved_steps, wait_for_step
from tests.train_run_helpers import no_leftover_runs  # noqa: F401  (autouse fixture)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("interrupt")
    d = micro_train_dict(str(tmp / "unused"), checkpoint={"every": 0, "keep": 2})
    return tmp, write_yaml(d, str(tmp / "train.yaml"))


def test_sigint_saves_then_resume_logs_every_step_once(setup, capsys):
    tmp, cfg = setup
    env = subprocess_env()
    run_dir = str(tmp / "int")
    # Far more steps than can run before the signal lands: the run cannot finish first.
    proc = popen_train(cfg, f"run.run_dir={run_dir}", "run.steps=100000", env=env)
    wait_for_step(run_dir, 3, proc)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    m = re.search(r"train\.py: interrupted at step (\d+): checkpoint saved to (\S+); resume with the same command",
                  out)
    assert m, out[-3000:]
    stop = int(m.group(1))
    assert m.group(2) == os.path.join(os.path.abspath(run_dir), "checkpoints", str(stop))
    assert saved_steps(run_dir) == [stop]           # checkpoint.every=0: only the interrupt's save
    assert loss_steps(run_dir) == list(range(1, stop + 1))

    # the resume and the uninterrupted reference: train.py's ``main`` in this process (no interpreter start-up)
    main = train_script_main()
    end = stop + 3
    capsys.readouterr()
    code = main(["--config", cfg, "--set", f"run.run_dir={run_dir}", "--set", f"run.steps={end}"])
    out, err = capsys.readouterr()
    assert code == 0, out[-3000:] + err[-3000:]
    assert f"resumed from step {stop}" in out
    assert loss_steps(run_dir) == list(range(1, end + 1))   # every step exactly once

    ref_dir = str(tmp / "ref")
    code = main(["--config", cfg, "--set", f"run.run_dir={ref_dir}", "--set", f"run.steps={end}"])
    out, err = capsys.readouterr()
    assert code == 0, out[-3000:] + err[-3000:]
    got = {r["step"]: r["loss"] for r in rows(run_dir) if "loss" in r}
    want = {r["step"]: r["loss"] for r in rows(ref_dir) if "loss" in r}
    np.testing.assert_array_equal([got[s] for s in range(1, end + 1)], [want[s] for s in range(1, end + 1)])


def test_second_sigint_aborts_at_once(setup):
    tmp, cfg = setup
    env = subprocess_env()
    env.pop("JAX_COMPILATION_CACHE_DIR", None)       # a real compile: seconds to interrupt in
    run_dir = str(tmp / "abort")
    proc = popen_train(cfg, f"run.run_dir={run_dir}", "run.steps=100000", env=env)
    reader = OutputReader(proc)
    if not reader.wait_for("compiling the train step", 120):  # the loop's handlers are in place by then
        proc.kill()
        raise AssertionError("no 'compiling the train step' line: " + reader.text()[-3000:])
    proc.send_signal(signal.SIGINT)
    # The second Ctrl-C once the first was handled: two signals sent back to back can reach the process
    # as one (POSIX keeps one pending SIGINT), which a loaded machine makes likely.
    if not reader.wait_for("interrupt: stopping after the current step", 30):
        proc.kill()
        raise AssertionError("the first SIGINT was not reported: " + reader.text()[-3000:])
    proc.send_signal(signal.SIGINT)
    t = time.time()
    try:
        proc.wait(timeout=60)
    finally:
        proc.kill()
    waited = time.time() - t
    out = reader.text()
    assert proc.returncode == 130, out[-3000:]
    assert "Traceback" not in out and "aborting now without saving" in out, out[-3000:]
    assert "compiled in" not in out, out[-3000:]     # it did not wait for the compile to end
    assert waited < 5.0
    assert saved_steps(run_dir) == [] and loss_steps(run_dir) == []
