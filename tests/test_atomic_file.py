"""minimax_jax.atomic_file: write_atomic writes whole files or nothing; out_file_error names an --out it must not take."""

import os

import pytest

from minimax_jax.atomic_file import out_file_error, write_atomic


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


def test_out_file_error_names_each_refusal(tmp_path):
    d, f, inp = tmp_path / "ck", tmp_path / "old.json", tmp_path / "in.txt"
    d.mkdir()
    f.write_text("x")
    inp.write_text("y")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    kw = {"inside": [("the checkpoint", str(d))], "inputs": [("the --text_file", str(inp))]}
    assert out_file_error(str(tmp_path / "new.json"), overwrite=False, **kw) is None
    assert out_file_error(str(f), overwrite=True, **kw) is None
    cases = {str(d): "is a directory; give a file path", str(tmp_path / "no" / "r.json"): "its directory",
             str(fifo): "is not a regular file", str(d / "r.json"): "is inside the checkpoint",
             str(inp): "is the --text_file", str(f): "exists; pass --overwrite"}
    for out, words in cases.items():
        err = out_file_error(out, overwrite=out != str(f), **kw)
        assert err.startswith(f"--out {out!r}") and words in err and "\n" not in err, (out, err)
    link = tmp_path / "link"
    link.symlink_to(inp)                  # a link to an input is that input
    assert "is the --text_file" in out_file_error(str(link), overwrite=True, **kw)
