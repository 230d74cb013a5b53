"""Checkpoints: SIGKILL mid-run + restart reproduces the uninterrupted loss sequence step for step
(params, optimizer state, step and the grain iterator position all restored); SIGTERM saves and
exits cleanly; a corrupt newest checkpoint falls back to the previous one with a warning.

Runs ``train.py`` in subprocesses on real text (Python stdlib sources, a small BPE tokenizer) with a
shared persistent compilation cache so each restart compiles only once.
"""

import json
import os
import shutil
import signal
import time

import numpy as np
import pytest

from tests.train_helpers import micro_train_dict, run_train_cli, stdlib_corpus, subprocess_env, write_yaml

STEPS = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    text, tok = stdlib_corpus(str(tmp / "corpus"), max_files=20)
    d = micro_train_dict(str(tmp / "unused"), data={
        "kind": "grain", "sources": [text], "tokenizer": tok, "seq_len": 64, "batch_size": 4, "num_epochs": None,
        "seed": 1}, checkpoint={"every": 2, "keep": 3, "async_save": True}, run={"steps": STEPS})
    cfg = write_yaml(d, str(tmp / "train.yaml"))
    env = subprocess_env(str(tmp / "jax_cache"))
    ref_dir = str(tmp / "ref")
    out = run_train_cli(cfg, f"run.run_dir={ref_dir}", env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return tmp, cfg, env, _losses(ref_dir)


def _rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f if x.strip()]


def _losses(run_dir):
    """step -> loss, the LAST record of each step winning (a resumed run re-logs replayed steps)."""
    return {r["step"]: r["loss"] for r in _rows(run_dir) if "loss" in r}


def _wait_for_step(run_dir, step, proc, timeout=600):
    t = time.time()
    while time.time() - t < timeout:
        if os.path.exists(os.path.join(run_dir, "metrics.jsonl")) and max(_losses(run_dir) or [0]) >= step:
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended before step {step}: {proc.stdout.read()[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {timeout}s")


def test_reference_loss_falls_and_is_complete(setup):
    _, _, _, ref = setup
    assert sorted(ref) == list(range(1, STEPS + 1))
    assert all(np.isfinite(v) for v in ref.values())


def test_sigkill_then_resume_matches_uninterrupted(setup):
    tmp, cfg, env, ref = setup
    run_dir = str(tmp / "killed")
    proc = run_train_cli(cfg, f"run.run_dir={run_dir}", env=env, wait=False)
    _wait_for_step(run_dir, 5, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    killed_at = max(_losses(run_dir))
    assert killed_at < STEPS
    out = run_train_cli(cfg, f"run.run_dir={run_dir}", env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "resumed from step" in out.stdout
    got = _losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    np.testing.assert_array_equal([got[s] for s in range(1, STEPS + 1)], [ref[s] for s in range(1, STEPS + 1)])


def test_sigterm_saves_and_exits(setup):
    tmp, cfg, env, ref = setup
    run_dir = str(tmp / "term")
    # Far more steps than can run before the signal lands, so the run cannot finish first on a
    # fast machine (metrics reach the file in bursts).
    proc = run_train_cli(cfg, f"run.run_dir={run_dir}", "checkpoint.every=0", "run.steps=100000", env=env,
                         wait=False)
    _wait_for_step(run_dir, 3, proc)
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, stdout[-3000:]            # saved but not finished (exit_codes: interrupted)
    assert "preempted at step" in stdout and "resume with the same command" in stdout
    last = max(_losses(run_dir))
    saved = sorted(int(s) for s in os.listdir(os.path.join(run_dir, "checkpoints")) if s.isdigit())
    assert saved == [last] and last < 100000  # checkpoint.every=0: only the SIGTERM save exists


def test_corrupt_latest_falls_back_with_warning(setup):
    tmp, cfg, env, ref = setup
    run_dir = str(tmp / "corrupt")
    shutil.copytree(str(tmp / "ref"), run_dir)
    ckpts = os.path.join(run_dir, "checkpoints")
    assert sorted(int(s) for s in os.listdir(ckpts) if s.isdigit()) == [4, 6, 8]
    for root, _, files in os.walk(os.path.join(ckpts, "8", "state")):
        for f in files:
            with open(os.path.join(root, f), "wb") as fh:
                fh.write(b"garbage")
    out = run_train_cli(cfg, f"run.run_dir={run_dir}", f"run.steps={STEPS}", env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "checkpoint step 8" in out.stderr and "falling back" in out.stderr
    assert "resumed from step 6" in out.stdout
    rows = _rows(run_dir)
    replayed = [r for r in rows if r["step"] in (7, 8)][-2:]
    np.testing.assert_array_equal([r["loss"] for r in replayed], [ref[7], ref[8]])


def test_resume_reports_changed_settings():
    from minimax_jax.train.loop import settings_changes

    saved = {"data": {"seq_len": 256, "sources": ["a"]}, "optim": {"lr": 1e-3}, "run": {"steps": 10}, "mesh": "data=1"}
    now = {"data": {"seq_len": 128, "sources": ["a"]}, "optim": {"lr": 1e-3}, "run": {"steps": 20}, "mesh": "fsdp=1"}
    assert settings_changes(saved, now) == ["data.seq_len: 256 -> 128", "mesh: 'data=1' -> 'fsdp=1'"]
    assert settings_changes(saved, saved) == [] and settings_changes(None, now) == []


def test_resume_logs_every_step_once(setup):
    """Killed after logging steps 7-8 (and half of a row) but before checkpoint 8 was written: the
    resume from 6 drops those rows, trains 7-8 again and logs them once."""
    tmp, cfg, env, ref = setup
    run_dir = str(tmp / "dedup")
    shutil.copytree(str(tmp / "ref"), run_dir)
    shutil.rmtree(os.path.join(run_dir, "checkpoints", "8"))
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        f.write('{"step": 9, "loss": 1.')
    out = run_train_cli(cfg, f"run.run_dir={run_dir}", env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "resumed from step 6" in out.stdout
    rows = _rows(run_dir)
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, STEPS + 1))
    np.testing.assert_array_equal([r["loss"] for r in rows], [ref[s] for s in range(1, STEPS + 1)])
    assert "dropped the log records past step 6 (they are trained again): metrics.jsonl: 3" in out.stdout


def test_truncate_after_drops_tensorboard_records_past_the_step(tmp_path):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.summary import Writer

    from minimax_jax.train.metrics_truncate import truncate_after

    w = Writer(str(tmp_path / "tensorboard"))
    for s in range(1, 9):
        w.add_scalar("loss", float(s), s)
    w.close()
    (name,) = os.listdir(tmp_path / "tensorboard")
    path = str(tmp_path / "tensorboard" / name)
    with open(path, "ab") as f:
        f.write(b"\x20\x00\x00\x00")  # a record cut short by a kill
    assert truncate_after(str(tmp_path), 5) == {f"tensorboard/{name}": 3 + 1}
    events = list(EventFileLoader(path).Load())
    assert [(e.step, e.summary.value[0].tag) for e in events if e.summary.value] == [(s, "loss") for s in range(1, 6)]
    assert events[0].file_version                       # the header record is kept
    assert truncate_after(str(tmp_path), 5) == {}       # nothing left to drop: the file is not rewritten
