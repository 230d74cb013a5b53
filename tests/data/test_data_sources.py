"""Text sources: files, directories, globs, JSONL fields, array_record, errors."""

import json
import os

import pytest

from minimax_jax.data.sources import DocumentSource, SourceError, iter_documents, resolve_paths


def test_files_dirs_globs(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "__pycache__").mkdir()
    (tmp_path / "a" / "__pycache__" / "x.pyc").write_bytes(b"\x00\x01")
    (tmp_path / "a" / "one.txt").write_text("first")
    (tmp_path / "a" / "two.py").write_text("second")
    (tmp_path / "b.txt").write_text("third")
    got = resolve_paths([str(tmp_path / "a"), str(tmp_path / "*.txt"), str(tmp_path / "b.txt")])
    assert [os.path.basename(p) for p in got] == ["one.txt", "two.py", "b.txt"]
    assert list(iter_documents(str(tmp_path / "a" / "*.py"))) == ["second"]


def test_jsonl_lines_and_errors(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text(json.dumps({"text": "α"}) + "\n\n" + json.dumps({"text": "b", "k": 1}) + "\n")
    src = DocumentSource(str(p))
    assert len(src) == 2 and [src[0], src[1]] == ["α", "b"]
    with pytest.raises(SourceError, match="no field 'body'"):
        DocumentSource(str(p), field="body")[0]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": 1}\nnot json\n')
    with pytest.raises(SourceError, match="field 'text' is int"):
        DocumentSource(str(bad))[0]
    with pytest.raises(SourceError, match="invalid JSON"):
        DocumentSource(str(bad))[1]


def test_missing_inputs_name_the_path(tmp_path):
    with pytest.raises(SourceError, match="does not exist"):
        resolve_paths(str(tmp_path / "nope.txt"))
    with pytest.raises(SourceError, match="matches no file"):
        resolve_paths(str(tmp_path / "*.zzz"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="contains no file"):
        resolve_paths(str(tmp_path / "empty"))
    with pytest.raises(SourceError, match="no text sources"):
        resolve_paths([])


def test_array_record(tmp_path):
    ar = pytest.importorskip("array_record.python.array_record_module")
    path = str(tmp_path / "d.array_record")
    w = ar.ArrayRecordWriter(path, "group_size:1")
    for rec in [b"plain text", json.dumps({"text": "from json"}).encode()]:
        w.write(rec)
    w.close()
    src = DocumentSource(path)
    assert [src[0], src[1]] == ["plain text", "from json"]
