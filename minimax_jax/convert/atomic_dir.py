"""Build an output directory atomically: everything is written into a hidden temporary sibling
(``.<name>.partial-<pid>-<random>``) that is renamed to the destination only when complete. A
failed or interrupted run leaves at most that clearly-partial directory (removed on a Python
exception), never something at the destination path that looks complete.

Before anything is written, ``check_destination`` refuses (``DestinationError``, nothing touched) a
destination whose parent is not a directory, one that is, contains or lies inside one of the sources,
one that exists without ``overwrite``, and, with ``overwrite``, one this tool did not write (no manifest
in it; an empty directory may be replaced) or holding entries this tool does not write (a user's files).
Nothing beside the destination is ever touched. Ctrl-C during the cleanup or the final renames is
held until they are done (then KeyboardInterrupt), so it never leaves a half-removed directory.

Also: the small files that travel with a converted checkpoint (our config, tokenizer, chat
template) and their copying.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading
import time
import uuid
from typing import Iterator

import yaml

from minimax_jax.config import ModelConfig
from minimax_jax.convert.errors import DestinationError, DestinationExistsError
from minimax_jax.convert.manifest import MANIFEST_FILE, is_manifest
from minimax_jax.convert.safetensors_io import INDEX_FILE

__all__ = ["atomic_output_dir", "check_destination", "TOKENIZER_FILES", "copy_side_files", "write_config",
           "read_config", "CONFIG_FILE", "PARAMS_DIR", "REPORT_FILE", "write_json"]

CONFIG_FILE = "config.yaml"
PARAMS_DIR = "params"
REPORT_FILE = "conversion.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")


def _overlap(a: str, b: str) -> str | None:
    """How real path ``a`` relates to real path ``b``: "is", "is inside", "contains" or None."""
    if a == b:
        return "is"
    common = os.path.commonpath([a, b])
    return "is inside" if common == b else "contains" if common == a else None


def _ours(path: str) -> bool:
    """``path`` is a directory this tool wrote (a manifest; a ``conversion.json`` of an earlier
    converter), or an empty directory (nothing in it to lose)."""
    if not os.path.isdir(path) or os.path.islink(path):
        return False
    if not os.listdir(path):
        return True
    for name in (MANIFEST_FILE, REPORT_FILE):
        try:
            with open(os.path.join(path, name)) as f:
                obj = json.load(f)
        except (OSError, ValueError):
            continue
        if is_manifest(obj) or (name == REPORT_FILE and str(obj.get("format", "")).startswith("minimax-jax")):
            return True
    return False


#: What marks each kind of output folder (``check_destination(kind=)``): an orbax checkpoint holds
#: ``config.yaml`` + ``params/``; a Hugging Face export ``config.json`` + safetensors shards.
_KIND_MARKS = {"orbax": (CONFIG_FILE, PARAMS_DIR), "hf": ("config.json",)}
#: The top-level entries each kind of output may hold (every writer's; an HF export also holds the shards its
#: index lists). An entry outside these is a user's: ``overwrite`` refuses its folder before any work (the
#: final check, after the work, is stricter: what the new output lacks must be the old index's shards).
_KIND_ENTRIES = {"orbax": {CONFIG_FILE, PARAMS_DIR, REPORT_FILE, MANIFEST_FILE, "fp8_weights.json", "hf_config.json",
                           *TOKENIZER_FILES},
                 "hf": {"config.json", INDEX_FILE, MANIFEST_FILE, *TOKENIZER_FILES}}


def _indexed_shards(path: str) -> set[str]:
    """The shard files the HF index in ``path`` (one this tool wrote) lists: that export's own files."""
    try:
        with open(os.path.join(path, INDEX_FILE)) as f:
            files = json.load(f).get("weight_map", {}).values()
    except (OSError, ValueError, AttributeError):
        return set()
    return {f for f in files if isinstance(f, str) and os.path.basename(f) == f and f.endswith(".safetensors")}


def _foreign_entries(path: str, kind: str | None, new: str | None = None) -> list[str]:
    """Top-level entries of ``path`` (an earlier output of ours) that this tool did not write: not in the
    new output ``new``, not an entry of ``kind`` outputs (None: none), and not a shard listed in its own index."""
    ours = _indexed_shards(path) | _KIND_ENTRIES.get(kind, set()) | (set(os.listdir(new)) if new else set())
    return sorted(set(os.listdir(path)) - ours)


def _refuse_foreign(dst: str, extra: list[str]) -> None:
    if extra:
        shown = ", ".join(extra[:3]) + (f" and {len(extra) - 3} more" if len(extra) > 3 else "")
        raise DestinationError(f"destination {dst} holds entries this tool did not write ({shown}); nothing was "
                               "replaced: move them out or choose another destination", dst)


def _check_parent(dst: str) -> None:
    """Refuse ``dst`` when its nearest existing ancestor is not a directory (a file in the way)."""
    parent = os.path.dirname(dst)
    while not os.path.lexists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if os.path.lexists(parent) and not os.path.isdir(parent):
        raise DestinationError(f"destination {dst}: parent {parent} is not a directory; nothing was written: "
                               "choose another destination", dst)


def _other_kind(path: str, kind: str) -> str | None:
    """The kind of output ``path`` holds when it is not ``kind`` (None: the same kind, or unknown)."""
    entries = set(os.listdir(path))
    return next((k for k, marks in _KIND_MARKS.items() if k != kind and entries & set(marks)), None)


def check_destination(dst: str | os.PathLike, *, sources=(), overwrite: bool = False, kind: str | None = None) -> str:
    """Refuse a destination whose writing could lose data; returns its absolute path.

    ``kind`` ("orbax" | "hf"): what will be written; an existing ``dst`` holding the other kind, or entries
    such outputs never hold, is refused up front (replacing it would fail only after the writing).
    Raises (nothing touched): DestinationError when the parent of ``dst`` is not a directory, ``dst`` is,
      contains or lies inside one of ``sources`` (paths compared after resolving symlinks), or exists but was
      not written by this tool, or exists with ``overwrite`` but holds another kind of output or a user's
      entries; DestinationExistsError (a FileExistsError) when it is ours and not ``overwrite``.
    """
    dst = os.path.abspath(os.fspath(dst))
    _check_parent(dst)
    real = os.path.realpath(dst)
    for src in sources:
        if src is None:
            continue
        src = os.path.abspath(os.fspath(src))
        how = _overlap(real, os.path.realpath(src))
        if how:
            raise DestinationError(f"destination {dst} {how} the source {src}; "
                                   "nothing was written: choose a destination outside the source", dst)
    if os.path.lexists(dst):
        if not _ours(dst):      # said first: overwrite would not replace it either
            raise DestinationError(f"destination {dst} exists and was not written by minimax-jax (no {MANIFEST_FILE} "
                                   "in it: not ours, or from a version before manifests); nothing was replaced: "
                                   "remove it yourself or choose another destination", dst)
        if not overwrite:
            raise DestinationExistsError(f"destination {dst} already exists (pass overwrite=True to replace it)", dst)
        other = _other_kind(dst, kind) if kind is not None and os.path.isdir(dst) else None
        if other is not None:
            names = {"orbax": "an orbax checkpoint", "hf": "a Hugging Face export"}
            raise DestinationError(f"destination {dst} holds {names[other]}, not {names[kind]}; nothing was "
                                   "replaced: choose another destination", dst)
        if kind is not None and os.path.isdir(dst):
            _refuse_foreign(dst, _foreign_entries(dst, kind))
    return dst


@contextlib.contextmanager
def atomic_output_dir(dst: str | os.PathLike, *, overwrite: bool = False, sources=(),
                      kind: str | None = None) -> Iterator[str]:
    """Yield a fresh temporary directory next to ``dst``; on normal exit rename it to ``dst``.

    Raises DestinationError / DestinationExistsError (before anything is written): see
    ``check_destination`` (``kind`` as there). With ``overwrite`` an old ``dst`` this tool wrote is moved
    aside, replaced, then deleted, unless it holds top-level entries that are neither in the new output
    nor shards listed in its own index (files a user put there): then DestinationError and the old
    ``dst`` stays as it was. On an exception (Ctrl-C included) the temporary
    directory is removed and the exception propagates.
    """
    dst = check_destination(dst, sources=sources, overwrite=overwrite, kind=kind)
    parent = os.path.dirname(dst)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(dst)}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.mkdir(tmp)
    try:
        yield tmp
        with _sigint_held():
            _fsync_dir(tmp)
            if os.path.exists(dst):
                _refuse_foreign(dst, _foreign_entries(dst, None, new=tmp))
                old = tmp + ".old"
                os.rename(dst, old)
                try:
                    os.rename(tmp, dst)
                except BaseException:
                    os.rename(old, dst)
                    raise
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, dst)
            _fsync_dir(parent)
    except BaseException:
        with _sigint_held():
            _remove_settled(tmp)
        raise


@contextlib.contextmanager
def _sigint_held() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) until the block is done, then raise KeyboardInterrupt (unless the block
    raised). Only in the main thread under Python's default SIGINT handler; elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    got = []
    signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if got:
        raise KeyboardInterrupt


def _remove_settled(path: str, *, settle_s: float = 0.2, attempts: int = 50) -> None:
    """Remove ``path`` and make sure it stays removed.

    A failed orbax save can leave its writer threads finishing a file or two after the exception
    reached us; they would re-create the directory we just deleted. Retry until it has been absent
    for ``settle_s`` seconds (at most ``attempts`` tries).
    """
    for _ in range(attempts):
        shutil.rmtree(path, ignore_errors=True)
        time.sleep(settle_s)
        if not os.path.exists(path):
            return


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def copy_side_files(src: str, dst: str, names=TOKENIZER_FILES) -> list[str]:
    """Copy the tokenizer / chat-template / generation files present in ``src`` to ``dst``."""
    copied = []
    for n in names:
        p = os.path.join(src, n)
        if os.path.isfile(p):
            shutil.copy2(p, os.path.join(dst, n))
            copied.append(n)
    return copied


def write_config(cfg: ModelConfig, directory: str) -> None:
    """Write ``cfg.to_dict()`` as ``config.yaml`` (readable by ``ModelConfig.from_yaml``)."""
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)


def read_config(directory: str) -> ModelConfig:
    p = os.path.join(os.fspath(directory), CONFIG_FILE)
    if not os.path.exists(p):
        raise FileNotFoundError(f"{p} not found: not a converted minimax-jax checkpoint directory")
    return ModelConfig.from_yaml(p)


def write_json(obj, path: str) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
