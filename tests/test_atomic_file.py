"""minimax_jax.atomic_file.write_atomic: whole files or nothing."""

import os

import pytest

from minimax_jax.atomic_file import write_atomic


def test_writes_text_and_bytes_and_replaces(tmp_path):
    p = str(tmp_path / "f.txt")
    write_atomic(p, "é\n")
    assert open(p, encoding="utf-8").read() == "é\n"
    write_atomic(p, b"\x00\x01")
    assert open(p, "rb").read() == b"\x00\x01" and os.listdir(tmp_path) == ["f.txt"]


@pytest.mark.parametrize("where", ["write", "fsync", "replace"])
def test_a_failure_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch, where):
    p = tmp_path / "f.txt"
    p.write_text("old")

    def boom(*a, **k):
        raise KeyboardInterrupt if where != "replace" else OSError(28, "No space left on device")
    if where == "write":
        monkeypatch.setattr("builtins.open", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    else:
        monkeypatch.setattr(os, where, boom)
    with pytest.raises((KeyboardInterrupt, OSError)):
        write_atomic(str(p), "new")
    monkeypatch.undo()
    assert p.read_text() == "old" and os.listdir(tmp_path) == ["f.txt"]
