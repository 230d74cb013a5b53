"""Build an output directory atomically: everything is written into a hidden temporary sibling
(``.<name>.partial-<pid>-<random>``) that is renamed to the destination only when complete. A
failed or interrupted run leaves at most that clearly-partial directory (removed on a Python
exception), never something at the destination path that looks complete.

Also: the small files that travel with a converted checkpoint (our config, tokenizer, chat
template) and their copying.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import uuid
from typing import Iterator

import yaml

from minimax_jax.config import ModelConfig

__all__ = ["atomic_output_dir", "TOKENIZER_FILES", "copy_side_files", "write_config", "read_config",
           "CONFIG_FILE", "PARAMS_DIR", "REPORT_FILE", "write_json"]

CONFIG_FILE = "config.yaml"
PARAMS_DIR = "params"
REPORT_FILE = "conversion.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")


@contextlib.contextmanager
def atomic_output_dir(dst: str | os.PathLike, *, overwrite: bool = False) -> Iterator[str]:
    """Yield a fresh temporary directory next to ``dst``; on normal exit rename it to ``dst``.

    Raises FileExistsError (before anything is written) when ``dst`` exists and not ``overwrite``.
    With ``overwrite`` the old ``dst`` is moved aside, replaced, then deleted.
    On an exception the temporary directory is removed and the exception propagates.
    """
    dst = os.path.abspath(os.fspath(dst))
    if os.path.exists(dst) and not overwrite:
        raise FileExistsError(f"destination {dst} already exists (pass overwrite=True to replace it)")
    parent = os.path.dirname(dst)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(dst)}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.mkdir(tmp)
    try:
        yield tmp
        _fsync_dir(tmp)
        if os.path.exists(dst):
            old = tmp + ".old"
            os.rename(dst, old)
            os.rename(tmp, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, dst)
        _fsync_dir(parent)
    except BaseException:
        _remove_settled(tmp)
        raise


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
