"""Text document sources: plain files, directories, globs, JSONL and array_record.

A *document* is one unit of text that the pipeline tokenises and packs:

- a plain text file (any extension other than those below) is one document;
- each line of a ``.jsonl`` / ``.json`` file is one JSON object, the document is ``obj[field]``;
- each record of an ``.array_record`` / ``.arrayrecord`` file is one document: the record bytes are
  decoded as UTF-8; when the text starts with ``{`` it is parsed as JSON and ``obj[field]`` is taken.

Paths may be files, directories (walked recursively, every regular file, sorted) or glob patterns
(``**`` allowed). The resolved file list is sorted so the document order is deterministic.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from collections.abc import Iterator, Sequence

JSONL_SUFFIXES = (".jsonl", ".json")
ARRAY_RECORD_SUFFIXES = (".array_record", ".arrayrecord")


class SourceError(ValueError):
    """A text source path or record cannot be used (missing file, bad JSON, missing field)."""


def _kind(path: str) -> str:
    low = path.lower()
    if low.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if low.endswith(ARRAY_RECORD_SUFFIXES):
        return "array_record"
    return "text"


def resolve_paths(paths: Sequence[str] | str) -> list[str]:
    """Expands files, directories and glob patterns into a sorted, de-duplicated list of files.

    Args:
      paths: one path or a sequence of paths; each is a file, a directory (walked recursively,
        hidden entries and ``__pycache__`` skipped) or a glob pattern (``*``, ``?``, ``[``, ``**``).
    Returns:
      Sorted list of absolute file paths.
    Raises:
      SourceError: when ``paths`` is empty or an entry matches no file.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [os.fspath(paths)]
    if not paths:
        raise SourceError("no text sources given (expected files, directories or glob patterns)")
    found: set[str] = set()
    for p in paths:
        p = os.path.expanduser(os.fspath(p))
        if any(ch in p for ch in "*?["):
            matches = [m for m in glob.glob(p, recursive=True) if os.path.isfile(m)]
            if not matches:
                raise SourceError(f"glob pattern {p!r} matches no file")
            found.update(os.path.abspath(m) for m in matches)
        elif os.path.isdir(p):
            before = len(found)
            for root, dirs, files in os.walk(p):
                dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
                for f in files:
                    if not f.startswith("."):
                        found.add(os.path.abspath(os.path.join(root, f)))
            if len(found) == before:
                raise SourceError(f"directory {p!r} contains no file")
        elif os.path.isfile(p):
            found.add(os.path.abspath(p))
        else:
            raise SourceError(f"text source {p!r} does not exist")
    return sorted(found)


def _jsonl_offsets(path: str) -> list[int]:
    offsets = []
    pos = 0
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                offsets.append(pos)
            pos += len(line)
    return offsets


def _field_of(obj, field: str, where: str) -> str:
    if not isinstance(obj, dict):
        raise SourceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if field not in obj:
        raise SourceError(f"{where}: JSON object has no field {field!r} (fields: {sorted(obj)[:10]})")
    value = obj[field]
    if not isinstance(value, str):
        raise SourceError(f"{where}: field {field!r} is {type(value).__name__}, expected a string")
    return value


@dataclasses.dataclass(frozen=True)
class _Entry:
    path: str
    kind: str
    offset: int  # byte offset (jsonl), record index (array_record), 0 (text)


class DocumentSource:
    """Random-access source of documents (``str``) over files, JSONL lines and array_record records.

    Implements grain's ``RandomAccessDataSource`` protocol (``__len__``, ``__getitem__``), so it
    can be wrapped with ``grain.MapDataset.source``. The index (one entry per document) is built
    at construction: JSONL files are scanned once for line offsets; array_record files are opened
    with ``grain.sources.ArrayRecordDataSource`` (needs the ``array_record`` package).

    Args:
      paths: files, directories or globs (see :func:`resolve_paths`).
      field: JSON field holding the text for JSONL / JSON array_record records.
    Raises:
      SourceError: bad paths; ImportError naming ``array_record`` when such files are given
        without the package installed.
    """

    def __init__(self, paths: Sequence[str] | str, field: str = "text"):
        self.field = field
        self.files = resolve_paths(paths)
        self._entries: list[_Entry] = []
        self._array_sources: dict[str, object] = {}
        for path in self.files:
            kind = _kind(path)
            if kind == "jsonl":
                self._entries.extend(_Entry(path, kind, off) for off in _jsonl_offsets(path))
            elif kind == "array_record":
                src = self._array_source(path)
                self._entries.extend(_Entry(path, kind, i) for i in range(len(src)))
            else:
                self._entries.append(_Entry(path, kind, 0))

    def _array_source(self, path: str):
        if path not in self._array_sources:
            try:
                import array_record  # noqa: F401
                from grain.sources import ArrayRecordDataSource
            except ImportError as e:  # pragma: no cover - depends on the environment
                raise ImportError(
                    f"reading {path!r} needs the 'array_record' package (pip install array_record)"
                ) from e
            self._array_sources[path] = ArrayRecordDataSource([path])
        return self._array_sources[path]

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, index: int) -> str:
        e = self._entries[index]
        if e.kind == "text":
            with open(e.path, encoding="utf-8", errors="replace") as f:
                return f.read()
        if e.kind == "jsonl":
            with open(e.path, "rb") as f:
                f.seek(e.offset)
                line = f.readline()
            where = f"{e.path} at byte {e.offset}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise SourceError(f"{where}: invalid JSON ({err})") from err
            return _field_of(obj, self.field, where)
        raw = self._array_source(e.path)[e.offset]
        text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else str(raw)
        if text.lstrip().startswith("{"):
            where = f"{e.path} record {e.offset}"
            try:
                obj = json.loads(text)
            except json.JSONDecodeError:
                return text
            return _field_of(obj, self.field, where)
        return text

    def __repr__(self) -> str:
        return f"DocumentSource({len(self.files)} files, {len(self)} documents, field={self.field!r})"


def iter_documents(paths: Sequence[str] | str, field: str = "text") -> Iterator[str]:
    """Yields every document of ``paths`` in deterministic order (see :class:`DocumentSource`)."""
    src = DocumentSource(paths, field=field)
    for i in range(len(src)):
        yield src[i]
