"""eval.recall's files: an existing --out is replaced only with --overwrite (never the --text_file),
written atomically; a --text_file that is not UTF-8 is named in one line (exit 2), before the model loads."""

import json
import os

import pytest

from minimax_jax.eval import recall
from tests.train_helpers import REPO

CKPT = os.path.join(REPO, "checkpoints", "demo")


@pytest.fixture
def no_model(monkeypatch):
    import minimax_jax.convert

    def fake_load(_ckpt):
        return None, None
    monkeypatch.setattr(minimax_jax.convert, "load_checkpoint", fake_load)
    monkeypatch.setattr(recall, "indexer_recall", lambda params, cfg, ids: {"mean": 0.5, "n": int(len(ids))})


def _err(capsys):
    err = capsys.readouterr().err
    return [line for line in err.splitlines() if "compilation cache" not in line]


def test_recall_keeps_an_existing_out_unless_overwrite(tmp_path, capsys, no_model):
    text = tmp_path / "t.txt"
    text.write_text("to be or not to be, that is the question " * 20)
    out = tmp_path / "notes.txt"
    out.write_text("my notes")
    argv = ["--checkpoint", CKPT, "--text_file", str(text), "--length", "16", "--out", str(out)]
    assert recall.main(argv) == 2
    assert _err(capsys) == [f"{recall.PROG}: error: --out {str(out)!r} exists; pass --overwrite to replace it "
                            "or choose another path"]
    assert out.read_text() == "my notes"
    for extra in ([], ["--overwrite"]):                 # the input is never the output
        assert recall.main(["--checkpoint", CKPT, "--text_file", str(text), "--out", str(text), *extra]) == 2
        assert _err(capsys) == [f"{recall.PROG}: error: --out {str(text)!r} is the --text_file; write the results "
                                "elsewhere"]
    assert recall.main([*argv, "--overwrite"]) == 0
    assert json.loads(out.read_text()) == {"mean": 0.5, "n": 16}
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "t.txt"]     # no temporary file left
    fresh = tmp_path / "r.json"
    assert recall.main(["--checkpoint", CKPT, "--text_file", str(text), "--length", "16", "--out", str(fresh)]) == 0
    assert json.loads(fresh.read_text())["n"] == 16


def test_recall_names_a_text_file_that_is_not_utf8(tmp_path, capsys, monkeypatch):
    import minimax_jax.convert

    def never(*a, **k):
        raise AssertionError("loaded the model")
    monkeypatch.setattr(minimax_jax.convert, "load_checkpoint", never)
    text = tmp_path / "latin1.txt"
    text.write_bytes("Roméo et Juliette".encode("latin-1"))
    assert recall.main(["--checkpoint", CKPT, "--text_file", str(text), "--length", "16"]) == 2
    assert _err(capsys) == [f"{recall.PROG}: error: --text_file {str(text)!r} is not UTF-8 text (byte 3)"]


def test_recall_never_writes_into_the_checkpoint_or_over_a_special_file(tmp_path, capsys, no_model):
    """--out inside the checkpoint read (even with --overwrite) or on a FIFO / device: refused in one line, nothing
    touched; an --out that is a link is written through (the link stays)."""
    import shutil

    text = tmp_path / "t.txt"
    text.write_text("to be or not to be, that is the question " * 20)
    ck = tmp_path / "ck"
    shutil.copytree(CKPT, ck)
    before = (ck / "config.yaml").read_text()
    argv = ["--checkpoint", str(ck), "--text_file", str(text), "--length", "16", "--overwrite"]
    assert recall.main([*argv, "--out", str(ck / "config.yaml")]) == 2
    assert _err(capsys) == [f"{recall.PROG}: error: --out {str(ck / 'config.yaml')!r} is inside the checkpoint "
                            f"{str(ck)!r}; write the results elsewhere"]
    assert (ck / "config.yaml").read_text() == before
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert recall.main([*argv, "--out", str(fifo)]) == 2
    assert "is not a regular file" in _err(capsys)[0] and os.path.exists(fifo) and not os.path.isfile(fifo)
    target, link = tmp_path / "r.json", tmp_path / "link.json"
    target.write_text("old")
    link.symlink_to(target)
    assert recall.main([*argv, "--out", str(link)]) == 0
    assert os.path.islink(link) and json.loads(target.read_text())["n"] == 16
