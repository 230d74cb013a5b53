"""Helpers for the checkpoint integrity tests: damage a stored tensor in place, list a tree's files."""

from __future__ import annotations

import hashlib
import os

import numpy as np

__all__ = ["flip_byte_of", "snapshot", "blake2b_hex"]


def flip_byte_of(directory: str, array, *, offset: int | None = None) -> str:
    """Flip one bit of the stored bytes of ``array`` (its raw bytes must appear verbatim in one
    file under ``directory``: uncompressed, or incompressible data). The file keeps its size.
    Returns the damaged file's path; AssertionError when the bytes are not found once."""
    raw = np.ascontiguousarray(np.asarray(array)).tobytes()
    at = len(raw) // 2 if offset is None else offset
    needle = raw[max(0, at - 16):at + 16]
    hits = []
    for d, _, files in os.walk(directory):
        for n in files:
            p = os.path.join(d, n)
            with open(p, "rb") as f:
                data = f.read()
            i = data.find(needle)
            if i >= 0:
                hits.append((p, i + (at - max(0, at - 16)), data))
    assert len(hits) == 1, f"the array's bytes were found in {len(hits)} files under {directory}"
    path, i, data = hits[0]
    data = bytearray(data)
    data[i] ^= 0x04
    with open(path, "wb") as f:
        f.write(bytes(data))
    return path


def snapshot(root) -> dict[str, str]:
    """``relative path -> sha256`` of every file under ``root`` (directories listed with "")."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs:
            out[os.path.relpath(os.path.join(d, n), root) + "/"] = ""
        for n in files:
            with open(os.path.join(d, n), "rb") as f:
                out[os.path.relpath(os.path.join(d, n), root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def blake2b_hex(array) -> str:
    """The manifest digest of ``array``, computed independently: blake2b-128 of its C-order bytes."""
    return hashlib.blake2b(np.ascontiguousarray(np.asarray(array)).tobytes(), digest_size=16).hexdigest()
