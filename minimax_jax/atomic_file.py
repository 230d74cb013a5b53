"""Atomic file writes: a reader (or a crash, Ctrl-C, a full disk) never leaves a half-written file.

Standard library only (no jax): every layer may use it.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Sequence

__all__ = ["out_file_error", "write_atomic"]


def write_atomic(path: str, content: bytes | str) -> None:
    """Write ``content`` (str: UTF-8) to ``path`` through a hidden temporary sibling that is flushed, synced and
    renamed into place. On any exception (KeyboardInterrupt included) the temporary file is removed and
    ``path`` keeps what it held before; the temporary name (``.<pid>.partial``) never matches a result
    pattern (event files, ``*.jsonl``). Raises OSError as ``open`` / ``os.replace`` do."""
    if isinstance(content, str):
        content = content.encode("utf-8")
    tmp = os.path.join(os.path.dirname(path) or ".", f".{os.getpid()}.partial")
    try:
        with open(tmp, "wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def out_file_error(out: str, *, overwrite: bool, inside: Sequence[tuple[str, str]] = (),
                   inputs: Sequence[tuple[str, str]] = ()) -> str | None:
    """Why a result file cannot be written (atomically) at ``out``, as one line naming the problem, or None.

    Refused: a directory; a missing parent directory; an existing file that is not a regular file (a device, FIFO
    or socket: the atomic rename would replace it); a path inside one of ``inside`` (``(what, directory)``, e.g.
    the checkpoint being read); one of ``inputs`` (``(what, file)``, through links too); an existing file without
    ``overwrite``; a parent that cannot take a new file (a real write: ``os.access`` says yes to root on
    read-only mounts). Links are followed: write to ``os.path.realpath(out)``.
    """
    real = os.path.realpath(out)
    parent = os.path.dirname(real)
    if os.path.isdir(out):
        return f"--out {out!r} is a directory; give a file path, e.g. {os.path.join(out, 'results.json')}"
    if not os.path.isdir(parent):
        return f"--out {out!r}: its directory {parent!r} does not exist"
    if os.path.exists(real) and not stat.S_ISREG(os.stat(real).st_mode):
        return f"--out {out!r} is not a regular file (a device, FIFO or socket); write the results to a file"
    for what, d in inside:
        d = os.path.realpath(d)
        if os.path.commonpath([real, d]) == d:
            return f"--out {out!r} is inside {what}; write the results elsewhere"
    for what, f in inputs:
        if f and os.path.isfile(f) and os.path.exists(real) and os.path.samefile(real, f):
            return f"--out {out!r} is {what}; write the results elsewhere"
    if os.path.exists(real) and not overwrite:
        return f"--out {out!r} exists; pass --overwrite to replace it or choose another path"
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".out-probe-"):
            pass
    except OSError as e:
        return f"--out {out!r}: cannot write in {parent!r} ({e.strerror})"
    return None
