"""Checksum manifests: one digest per array, written with every checkpoint save and export and
checked on load, so flipped or truncated bytes fail naming the tensor instead of loading as garbage.

File ``<checkpoint dir>/minimax_manifest.json`` (train checkpoints: the ``manifest`` item)::

    {"format": "minimax-jax manifest v1", "hash": "blake2b-128", "writer": "convert",
     "tensors": {"segments.0.mlp.w1": {"shape": [2, 64, 32], "dtype": "bfloat16", "digest": "<32 hex>"}}}

A digest is blake2b (16-byte digest; hashlib, ~1 GB/s per core, no extra dependency) over the
array's bytes in C order. Leaves sharded across processes (multi-host) have no digest: no process
holds them whole. The manifest also marks a directory as written by minimax-jax: only such a
directory may be replaced by an overwrite (``atomic_dir.check_destination``).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import sys
from typing import Any, Iterator

import numpy as np

from minimax_jax.convert.errors import ChecksumMismatch

__all__ = ["MANIFEST_FILE", "FORMAT", "StreamDigest", "leaf_name", "array_digest", "entry", "tree_entries",
           "manifest_dict", "write_manifest", "read_manifest", "is_manifest", "verify_tree", "default_warn"]

MANIFEST_FILE = "minimax_manifest.json"
FORMAT = "minimax-jax manifest v1"
HASH = "blake2b-128"
_CHUNK_BYTES = 256 * 2 ** 20      # host bytes per piece of a device array being hashed
_WORKERS = min(8, os.cpu_count() or 1)   # hashlib releases the GIL: leaves hash in parallel


class StreamDigest:
    """Digest of an array fed in consecutive C-order pieces (e.g. layer ``j`` of a stacked leaf)."""

    def __init__(self):
        self._h = hashlib.blake2b(digest_size=16)

    def update(self, arr) -> None:
        self._h.update(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def leaf_name(path: tuple) -> str:
    """Dotted name of a ``jax.tree_util`` key path: ``('params', 'segments', 0, 'w1')`` style keys ->
    ``params.segments.0.w1``."""
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts)


def _host_pieces(x) -> Iterator[np.ndarray] | None:
    """``x`` in C-order host pieces of at most ~``_CHUNK_BYTES`` (slices along axis 0), or None when
    this process does not hold the whole array."""
    if isinstance(x, np.ndarray) or not hasattr(x, "addressable_shards"):
        return iter([np.asarray(x)])
    if not x.is_fully_addressable:
        if not x.is_fully_replicated:
            return None
        x = x.addressable_shards[0].data
    if x.ndim == 0 or x.nbytes <= _CHUNK_BYTES:
        return iter([np.asarray(x)])
    rows = max(1, _CHUNK_BYTES // max(1, x.nbytes // x.shape[0]))
    return (np.asarray(x[i:i + rows]) for i in range(0, x.shape[0], rows))


def array_digest(x) -> str | None:
    """Hex digest of ``x`` (numpy or jax array), or None when this process does not hold it whole."""
    pieces = _host_pieces(x)
    if pieces is None:
        return None
    d = StreamDigest()
    for p in pieces:
        d.update(p)
    return d.hexdigest()


def _dtype(x) -> np.dtype:
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype


def entry(shape, dtype, digest: str | None) -> dict:
    return {"shape": [int(s) for s in shape], "dtype": np.dtype(dtype).name, "digest": digest}


def _flat(tree, is_leaf=None) -> list[tuple[str, Any]]:
    import jax

    return [(leaf_name(p), v) for p, v in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]]


def _digests(leaves: list) -> list[str | None]:
    if len(leaves) <= 1:
        return [array_digest(x) for x in leaves]
    with concurrent.futures.ThreadPoolExecutor(_WORKERS) as ex:
        return list(ex.map(array_digest, leaves))


def tree_entries(tree) -> dict[str, dict]:
    """Manifest entries of every array leaf of ``tree`` (digests computed in parallel)."""
    flat = _flat(tree)
    return {n: entry(np.shape(x), _dtype(x), d) for (n, x), d in zip(flat, _digests([x for _, x in flat]))}


def manifest_dict(entries: dict[str, dict], *, writer: str) -> dict:
    return {"format": FORMAT, "hash": HASH, "writer": writer, "tensors": dict(sorted(entries.items()))}


def write_manifest(directory: str, entries: dict[str, dict], *, writer: str) -> None:
    """Write ``directory/minimax_manifest.json``."""
    with open(os.path.join(directory, MANIFEST_FILE), "w") as f:
        json.dump(manifest_dict(entries, writer=writer), f, indent=1)
        f.write("\n")


def is_manifest(obj: Any) -> bool:
    return isinstance(obj, dict) and obj.get("format") == FORMAT and isinstance(obj.get("tensors"), dict)


def read_manifest(directory: str) -> dict | None:
    """The manifest of ``directory``, or None when it has none (written before manifests existed).

    Raises: ChecksumMismatch when the file exists but is not a manifest (damaged).
    """
    path = os.path.join(directory, MANIFEST_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            m = json.load(f)
    except (OSError, ValueError) as e:
        raise ChecksumMismatch(f"checkpoint {directory}: {MANIFEST_FILE} is unreadable ({e})") from e
    if not is_manifest(m):
        raise ChecksumMismatch(f"checkpoint {directory}: {MANIFEST_FILE} is not a {FORMAT!r} file")
    return m


def verify_tree(tree, manifest: dict, where: str) -> int:
    """Check every leaf of ``tree`` (restored arrays) against ``manifest``; returns how many were
    checked. Leaves restored in another dtype than saved (a cast on restore), without a recorded
    digest, or not held whole by this process are skipped.

    Raises: ChecksumMismatch ``checkpoint WHERE: tensor 'NAME' checksum mismatch ...`` (first in tree
      order), or naming the first leaf that has no manifest entry (a damaged manifest).
    """
    tensors = manifest["tensors"]
    leaves = list(_flat(tree))
    missing = [n for n, _ in leaves if n not in tensors]
    if missing:
        raise ChecksumMismatch(f"checkpoint {where}: tensor {missing[0]!r} has no entry in the manifest (the manifest "
                               f"is damaged, or belongs to another checkpoint); restore it from a good copy",
                               tensor=missing[0])
    todo = [(n, x) for n, x in leaves if tensors[n].get("digest")
            and _dtype(x).name == tensors[n]["dtype"] and list(np.shape(x)) == tensors[n]["shape"]]
    got = _digests([x for _, x in todo])
    for (n, _), d in zip(todo, got):
        if d is not None and d != tensors[n]["digest"]:
            raise ChecksumMismatch(f"checkpoint {where}: tensor {n!r} checksum mismatch (file flipped or truncated); "
                                   "restore it from a good copy", tensor=n)
    return sum(d is not None for d in got)


def default_warn(msg: str) -> None:
    """One ``warning: ...`` line on stderr."""
    print(f"warning: {msg}", file=sys.stderr, flush=True)
