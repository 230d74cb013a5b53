"""Resume without duplicated steps: drop the per-step logs written after the restored checkpoint.

A run killed at step 17 with its last checkpoint at 16 resumes from 16 and trains step 17 again;
without this, ``metrics.jsonl`` and the TensorBoard event files would hold step 17 twice.
``truncate_after(run_dir, step)`` rewrites both with only the records of steps ``<= step``:

- ``metrics.jsonl``: rows with ``"step" > step`` and unparsable lines (a write cut short by a
  crash) are dropped;
- ``tensorboard/events.out.tfevents.*``: TFRecord files; each record (length, CRC, ``Event`` proto,
  CRC) is copied byte for byte when its ``Event.step <= step``, a cut-short final record is dropped.

Each file is rewritten as a temporary sibling renamed into place (never half-written) and only
when something is dropped.
"""

from __future__ import annotations

import json
import os
import struct

from minimax_jax.atomic_file import write_atomic

__all__ = ["truncate_after"]


def truncate_after(run_dir: str, step: int) -> dict[str, int]:
    """Drop what ``run_dir``'s logs hold past ``step``. Returns ``{file name: records dropped}``
    for the files that changed."""
    dropped: dict[str, int] = {}
    path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.isfile(path):
        n = _truncate_jsonl(path, step)
        if n:
            dropped["metrics.jsonl"] = n
    tb = os.path.join(run_dir, "tensorboard")
    if os.path.isdir(tb):
        for name in sorted(os.listdir(tb)):
            if name.startswith("events.out.tfevents"):
                n = _truncate_events(os.path.join(tb, name), step)
                if n:
                    dropped[f"tensorboard/{name}"] = n
    return dropped


def _keep_row(line: str, step: int) -> bool:
    try:
        row = json.loads(line)
    except ValueError:
        return False
    return not isinstance(row, dict) or int(row.get("step", 0)) <= step


def _truncate_jsonl(path: str, step: int) -> int:
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [x for x in f.read().split("\n") if x.strip()]    # JSONL lines end at "\n" only
    keep = [x for x in lines if _keep_row(x, step)]
    if len(keep) < len(lines):
        write_atomic(path, "".join(x + "\n" for x in keep).encode())
    return len(lines) - len(keep)


def _records(data: bytes):
    """``(raw record, payload)`` of each complete TFRecord in ``data``."""
    i = 0
    while i + 12 <= len(data):
        (n,) = struct.unpack_from("<Q", data, i)
        end = i + 12 + n + 4
        if end > len(data):
            return
        yield data[i:end], data[i + 12:i + 12 + n]
        i = end


def _truncate_events(path: str, step: int) -> int:
    try:
        from tensorboard.compat.proto.event_pb2 import Event
    except ImportError:
        return 0
    with open(path, "rb") as f:
        data = f.read()
    keep, total, size = [], 0, 0
    for raw, payload in _records(data):
        total += 1
        size += len(raw)
        if Event.FromString(payload).step <= step:
            keep.append(raw)
    cut_short = size < len(data)
    if len(keep) < total or cut_short:
        write_atomic(path, b"".join(keep))
    return total - len(keep) + int(cut_short)
