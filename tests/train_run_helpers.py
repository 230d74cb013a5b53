"""Helpers for the tests that start, signal and resume ``train.py`` subprocesses: the command, a Popen
with SIGINT at its default (a test runner started as a background job ignores SIGINT, and its
children would inherit that), and readers of a run directory's metrics and checkpoints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.train_helpers import REPO

__all__ = ["train_cmd", "popen_train", "no_leftover_runs", "rows", "loss_steps", "wait_for_step", "saved_steps",
           "OutputReader"]


def train_cmd(cfg: str, *overrides: str) -> list[str]:
    """``python train.py --config cfg --set o ...``."""
    cmd = [sys.executable, os.path.join(REPO, "train.py"), "--config", cfg]
    for o in overrides:
        cmd += ["--set", o]
    return cmd


_STARTED: list[subprocess.Popen] = []


def popen_train(cfg: str, *overrides: str, env: dict) -> subprocess.Popen:
    """Start ``train_cmd`` with stdout+stderr piped (text) and SIGINT at its default."""
    proc = subprocess.Popen(train_cmd(cfg, *overrides), env=env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    _STARTED.append(proc)
    return proc


@pytest.fixture(autouse=True)
def no_leftover_runs():
    """Import into a test module: after each test, SIGKILL the ``popen_train`` processes still
    running (a failed test's long run)."""
    yield
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)


def rows(run_dir: str) -> list[dict]:
    """The rows of ``run_dir/metrics.jsonl`` ([] when missing)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


def loss_steps(run_dir: str) -> list[int]:
    """The step of every metrics row with a loss, in file order."""
    return [r["step"] for r in rows(run_dir) if "loss" in r]


def wait_for_step(run_dir: str, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Wait until ``proc`` logged ``step`` (AssertionError when it ends first or ``timeout`` passes)."""
    t = time.time()
    while time.time() - t < timeout:
        try:
            if max(loss_steps(run_dir) or [0]) >= step:
                return
        except ValueError:  # a row being written
            pass
        if proc.poll() is not None:
            raise AssertionError(f"run ended before step {step}: {proc.stdout.read()[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {timeout}s")


def saved_steps(run_dir: str) -> list[int]:
    """The checkpointed steps of ``run_dir``, ascending."""
    ck = os.path.join(run_dir, "checkpoints")
    return sorted(int(s) for s in os.listdir(ck) if s.isdigit()) if os.path.isdir(ck) else []


class OutputReader:
    """Collect a Popen's text stdout in a thread, so a test can wait for a line with a timeout."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[str] = []
        self._thread = threading.Thread(target=lambda: self.lines.extend(proc.stdout), daemon=True)
        self._thread.start()

    def wait_for(self, needle: str, timeout: float) -> bool:
        """True once a line containing ``needle`` arrived; False after ``timeout`` s or at EOF."""
        t = time.time()
        while time.time() - t < timeout:
            if any(needle in x for x in list(self.lines)):
                return True
            if not self._thread.is_alive():
                return any(needle in x for x in self.lines)
            time.sleep(0.02)
        return False

    def text(self, timeout: float = 30) -> str:
        """Everything read, once the stream ended (or ``timeout`` s)."""
        self._thread.join(timeout)
        return "".join(self.lines)
