"""Atomic file writes: a reader (or a crash, Ctrl-C, a full disk) never leaves a half-written file.

Standard library only (no jax): every layer may use it.
"""

from __future__ import annotations

import contextlib
import os

__all__ = ["write_atomic"]


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
