"""One training process per run directory: an exclusive ``fcntl.flock`` on ``run_dir/train.lock``.

The lock file holds one JSON line ``{"pid", "host", "started"}`` of the holder, for the message a
second process prints. The kernel releases a ``flock`` when its process dies (a crash, ``kill -9``),
so a crashed run's directory is resumed without any cleanup: a lock file without a live lock on it
is stale and simply taken over. The file itself is never deleted (deleting it would let two
processes lock two different files of the same name).

A run directory is recognised by its lock file (``is_run_dir``; runs from before the lock by
``model_config.yaml`` beside ``checkpoints/``). ``RunLock`` takes a new or empty directory, or a run
directory (a resume), and refuses any other folder with files (``run_dir_problem``): a typo'd
``run.run_dir`` must not overwrite someone's ``config.yaml`` or ``metrics.jsonl``.

Errors: ``RunDirError`` (the directory cannot be created or written, or is a folder with files that is not a
run directory), ``RunDirLockedError`` (another live process holds the lock). File systems without ``flock``
(some FUSE mounts) run unlocked, with a warning.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import warnings

__all__ = ["LOCK_NAME", "RunDirError", "RunDirLockedError", "RunLock", "is_run_dir", "lock_holder", "run_dir_problem"]

LOCK_NAME = "train.lock"


class RunDirError(Exception):
    """``run.run_dir`` cannot be created or written."""


class RunDirLockedError(RunDirError):
    """Another live process trains in the same ``run.run_dir``."""


def is_run_dir(path: str) -> bool:
    """Whether ``path`` is a run directory of ``train.py``: it holds the lock file (or, written before runs took
    a lock, ``model_config.yaml`` and ``checkpoints/``)."""
    return (os.path.isfile(os.path.join(path, LOCK_NAME))
            or (os.path.isfile(os.path.join(path, "model_config.yaml")) and os.path.isdir(os.path.join(path, "checkpoints"))))


def run_dir_problem(run_dir: str) -> str | None:
    """Why training may not write into ``run_dir`` (one line), or None: a new or empty folder and a run
    directory (``is_run_dir``: resumed) are fine; a file, or a folder with files of something else, is not."""
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        return f"run.run_dir {run_dir!r} is a file; choose a folder (train.py creates it)"
    if not os.path.isdir(run_dir) or not os.listdir(run_dir) or is_run_dir(run_dir):
        return None
    return (f"run.run_dir {run_dir!r} is a folder with files that is not a train.py run directory (no {LOCK_NAME}); "
            f"choose a new or empty run.run_dir, or the run.run_dir of a run to resume")


def lock_holder(run_dir: str) -> dict | None:
    """The ``{"pid", "host", "started"}`` last written to ``run_dir``'s lock file, or None."""
    try:
        with open(os.path.join(run_dir, LOCK_NAME)) as f:
            return json.loads(f.read() or "null")
    except (OSError, ValueError):
        return None


class RunLock:
    """Hold the run directory's lock from construction until ``release`` (or the process's end).

    Creates ``run_dir`` when missing. Raises RunDirError / RunDirLockedError (see module docstring).
    """

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, LOCK_NAME)
        self._fd = None
        if problem := run_dir_problem(run_dir):
            raise RunDirError(problem)
        try:
            os.makedirs(run_dir, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RunDirError(f"run.run_dir {run_dir!r} cannot be written ({e.strerror or e}); "
                              f"choose a writable run.run_dir") from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                warnings.warn(f"{self.path}: the file system does not support locks ({e.strerror}); "
                              f"nothing stops a second run from writing to this run.run_dir", stacklevel=2)
            else:
                os.close(self._fd)
                self._fd = None
                raise RunDirLockedError(self._busy_message()) from None
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, (json.dumps(info) + "\n").encode(), 0)

    def _busy_message(self) -> str:
        who = lock_holder(self.run_dir) or {}
        return (f"run.run_dir {self.run_dir!r} is in use by another training process (pid {who.get('pid', '?')} "
                f"on host {who.get('host', '?')}, started {who.get('started', '?')}); wait for it to end or "
                f"use another run.run_dir")

    def release(self) -> None:
        """Unlock (idempotent); the file stays, naming the last holder."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
