"""Self-distillation data (minimax_jax.data.self_distill): prompts are whole-token windows of corpus documents,
seeded; join pairs each generation record with its prompt by id; outputs are written whole or not at all."""

import json
import os

import pytest

from minimax_jax.data import self_distill as sd
from minimax_jax.data.tokenizer import load_tokenizer

TOKENIZER = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints", "demo", "tokenizer.json")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TOKENIZER)


CORPUS = ["ROMEO: But, soft! what light through yonder window breaks? " * 12, "short", "def f(x):\n    return x\n" * 30]


def test_prompts_are_seeded_token_windows_of_long_enough_documents(tok):
    a = sd.sample_prompts(CORPUS, tok, 20, 16, 40, seed=3)
    assert a == sd.sample_prompts(CORPUS, tok, 20, 16, 40, seed=3)
    assert a != sd.sample_prompts(CORPUS, tok, 20, 16, 40, seed=4)
    assert [p["id"] for p in a] == [f"sd-{i}" for i in range(20)]
    for p in a:
        n = len(tok.encode(p["prompt"]).ids)
        assert 12 <= n <= 44, n                      # decode -> encode may merge a few tokens at the edges
        assert any(p["prompt"].strip()[:10] in doc for doc in CORPUS[::2])    # never the 1-token document


def test_prompts_refuse_bad_counts_and_a_corpus_too_short(tok):
    with pytest.raises(ValueError, match="min_tokens"):
        sd.sample_prompts(CORPUS, tok, 4, 50, 20)
    with pytest.raises(ValueError, match="no corpus document has 100000 tokens"):
        sd.sample_prompts(CORPUS, tok, 4, 100000, 100000)


def test_join_pairs_records_with_their_prompts():
    prompts = [{"prompt": "A: ", "id": "sd-0"}, {"prompt": "B: ", "id": "sd-1"}]
    gens = [{"id": "sd-1", "sample": 0, "text": "bee"}, {"id": "sd-0", "sample": 0, "text": "ay"}]
    assert sd.join_generations(prompts, gens) == [{"text": "B: bee", "source": "self", "id": "sd-1-0"},
                                                  {"text": "A: ay", "source": "self", "id": "sd-0-0"}]
    with pytest.raises(ValueError, match="'sd-9' matches no prompt"):
        sd.join_generations(prompts, [{"id": "sd-9", "text": "x"}])
    with pytest.raises(ValueError, match="has no text"):
        sd.join_generations(prompts, [{"id": "sd-0"}])


def test_cli_writes_whole_files_refuses_existing_ones_and_drops_a_cut_last_record(tmp_path, capsys):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS))
    out = tmp_path / "p.jsonl"
    args = ["prompts", "--corpus", str(corpus), "--tokenizer", TOKENIZER, "--num", "3", "--min_tokens", "8",
            "--max_tokens", "16", "--out", str(out)]
    assert sd.main(args) == 0
    prompts = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(prompts) == 3
    assert sd.main(args) == 2 and "exists" in capsys.readouterr().err
    assert out.read_text().count("\n") == 3                       # untouched
    gen = tmp_path / "g.jsonl"                                    # a generator killed mid-record
    gen.write_text(json.dumps({"id": "sd-0", "text": "x"}) + "\n" + '{"id": "sd-1", "te')
    dst = tmp_path / "d" / "train.jsonl"
    assert sd.main(["join", "--prompts", str(out), "--generations", str(gen), "--out", str(dst)]) == 0
    assert "unfinished last line" in capsys.readouterr().err
    assert [json.loads(x)["id"] for x in dst.read_text().splitlines()] == ["sd-0-0"]
    assert os.listdir(dst.parent) == ["train.jsonl"]                # no temporary file left
    assert sd.main(["prompts", "--corpus", str(tmp_path / "none*.jsonl"), "--tokenizer", TOKENIZER,
                    "--out", str(tmp_path / "q.jsonl")]) == 2
    assert "matches no file" in capsys.readouterr().err


def test_join_refuses_duplicates_and_nothing_to_join():
    prompts = [{"prompt": "A: ", "id": "sd-0"}]
    with pytest.raises(ValueError, match="prompt id 'sd-0' appears twice"):
        sd.join_generations(prompts * 2, [{"id": "sd-0", "text": "x"}])
    with pytest.raises(ValueError, match="appears twice"):
        sd.join_generations(prompts, [{"id": "sd-0", "text": "x"}] * 2)
    with pytest.raises(ValueError, match="no generation record"):
        sd.join_generations(prompts, [])


def test_cli_names_the_bad_line_and_keeps_a_whole_last_record(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "A", "id": "sd-0"}) + "\n" + json.dumps({"prompt": "B", "id": "sd-1"}))
    gen = tmp_path / "g.jsonl"                 # two whole records, the last without its newline: both kept
    gen.write_text(json.dumps({"id": "sd-0", "text": "a"}) + "\n" + json.dumps({"id": "sd-1", "text": "b"}))
    dst = tmp_path / "d.jsonl"
    assert sd.main(["join", "--prompts", str(prompts), "--generations", str(gen), "--out", str(dst)]) == 0
    assert len(dst.read_text().splitlines()) == 2
    for body, msg in (("[1, 2]\n", "g2.jsonl:1: not a JSON object"), ('{"text": "a"}\n', None)):
        bad = tmp_path / "g2.jsonl"
        bad.write_text(body)
        out = tmp_path / "e.jsonl"
        assert sd.main(["join", "--prompts", str(prompts), "--generations", str(bad), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert (msg or "matches no prompt") in err and not out.exists()
    bad_p = tmp_path / "p2.jsonl"
    bad_p.write_text(json.dumps({"id": "sd-0"}) + "\n")
    assert sd.main(["join", "--prompts", str(bad_p), "--generations", str(gen), "--out", str(tmp_path / "f.jsonl")]) == 2
    assert "p2.jsonl:1: no 'prompt'" in capsys.readouterr().err
    assert sd.main(["join", "--prompts", str(prompts), "--generations", str(gen), "--out", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err


def test_odd_line_separators_ids_and_prompts(tmp_path, capsys):
    """Text holding U+2028 / U+2029 / U+0085 (str.splitlines breaks there) goes through prompts -> infer.py's
    --prompts_file reader -> join unchanged; ids and prompts of the wrong JSON type, a non-UTF-8 file and an
    empty --out are one-line errors."""
    from minimax_jax.infer.prompts_io import read_prompts_file
    odd = "a\u2028b\u2029c\x85d"
    prompts = tmp_path / "p.jsonl"
    sd._write_jsonl(str(prompts), [{"prompt": odd, "id": "sd-0"}, {"prompt": "B", "id": 7}])
    assert [(i.id, i.text) for i in read_prompts_file(str(prompts))] == [("sd-0", odd), (7, "B")]
    gen = tmp_path / "g.jsonl"
    gen.write_text(json.dumps({"id": "sd-0", "text": odd}, ensure_ascii=False) + "\n", encoding="utf-8")
    dst = tmp_path / "d.jsonl"
    assert sd.main(["join", "--prompts", str(prompts), "--generations", str(gen), "--out", str(dst)]) == 0
    assert [json.loads(x) for x in dst.read_text(encoding="utf-8").split("\n") if x] == [
        {"text": odd + odd, "source": "self", "id": "sd-0-0"}]
    for rows, msg in (([{"prompt": "A", "id": ["a"]}], "'id' must be a string or an integer, got list"),
                      ([{"prompt": 5, "id": "a"}], "'prompt' must be a string, got int")):
        with pytest.raises(ValueError, match=msg):
            sd.join_generations(rows, [{"id": "a", "text": "x"}])
    with pytest.raises(ValueError, match="'id' must be a string or an integer, got list"):
        sd.join_generations([{"prompt": "A", "id": "a"}], [{"id": ["a"], "text": "x"}])
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"id": "sd-0", "text": "\xff"}\n')
    assert sd.main(["join", "--prompts", str(prompts), "--generations", str(bad), "--out", str(tmp_path / "e")]) == 2
    assert "bad.jsonl: not UTF-8 text" in capsys.readouterr().err
    assert sd.main(["join", "--prompts", str(prompts), "--generations", str(gen), "--out", ""]) == 2
    assert "--out is empty" in capsys.readouterr().err



def test_an_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
    """Ctrl-C while the output is written (here: at the sync before the rename): no output, no temporary file."""
    def interrupted(fd):
        raise KeyboardInterrupt
    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sd._write_jsonl(str(tmp_path / "o.jsonl"), [{"text": "x"}])
    assert os.listdir(tmp_path) == []
