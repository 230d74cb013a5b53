"""Byte-level BPE training with the MiniMax special tokens, saving, loading, CLI."""

import os
import subprocess
import sys
import sysconfig

import pytest

from minimax_jax.data.tokenizer import (
    SPECIAL_TOKENS, TokenizerError, load_tokenizer, main, save_tokenizer, special_token_ids,
    train_tokenizer, train_tokenizer_from_paths,
)

STD = sysconfig.get_paths()["stdlib"]
JSON_SRC = os.path.join(STD, "json", "*.py")


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer_from_paths([JSON_SRC], 700)


def test_vocab_size_and_special_ids_first(tok):
    assert tok.get_vocab_size() == 700
    assert [tok.token_to_id(s) for s in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert special_token_ids(tok) == {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


@pytest.mark.parametrize("text", [
    "def f(x):\n\treturn x  # comment\n",
    "héllo wörld, naïve café — 東京 🚀 \x00\x7f",
    "   leading and trailing spaces   \n\n\n",
    "",
])
def test_round_trip_any_text(tok, text):
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_are_single_ids_in_context(tok):
    for s in SPECIAL_TOKENS:
        text = f"abc{s}def {s}\n"
        enc = tok.encode(text, add_special_tokens=False)
        assert enc.ids.count(tok.token_to_id(s)) == 2
        assert tok.decode(enc.ids, skip_special_tokens=False) == text
    turn = "]~!b[]~b]user\nhi[e~[\n]~b]ai\n<think>\nx\n</think>\n\nok[e~[\n"
    ids = tok.encode(turn, add_special_tokens=False).ids
    assert tok.decode(ids, skip_special_tokens=False) == turn


def test_merges_learned_from_the_corpus(tok):
    # a word frequent in json/*.py compresses well below one token per byte
    word = " return"
    assert len(tok.encode(word, add_special_tokens=False).ids) < len(word.encode()) / 2


def test_save_load_and_missing_file(tok, tmp_path):
    path = save_tokenizer(tok, str(tmp_path / "t"))
    assert os.path.basename(path) == "tokenizer.json"
    for where in (str(tmp_path / "t"), path):
        again = load_tokenizer(where)
        assert again.encode("x = {'a': 1}").ids == tok.encode("x = {'a': 1}").ids
    with pytest.raises(FileNotFoundError, match=r"empty.*tokenizer\.json"):
        os.makedirs(tmp_path / "empty")
        load_tokenizer(str(tmp_path / "empty"))


def test_too_small_vocab_and_deterministic_training():
    with pytest.raises(TokenizerError, match="vocab_size=100 is too small"):
        train_tokenizer(["abc"], 100)
    a = train_tokenizer_from_paths([JSON_SRC], 400)
    b = train_tokenizer_from_paths([JSON_SRC], 400)
    assert a.to_str() == b.to_str()


def test_jsonl_field_and_cli(tmp_path):
    src = tmp_path / "c.jsonl"
    src.write_text("".join('{"body": "the quick brown fox %d"}\n' % i for i in range(50)))
    out = tmp_path / "out"
    assert main(["train", "--input", str(src), "--vocab_size", "300", "--out", str(out),
                 "--field", "body"]) == 0
    tok = load_tokenizer(str(out))
    assert len(tok.encode(" quick", add_special_tokens=False).ids) == 1
    r = subprocess.run([sys.executable, "-m", "minimax_jax.data.tokenizer", "train", "--input",
                        str(src), "--vocab_size", "300", "--out", str(tmp_path / "o2"), "--field",
                        "missing"], capture_output=True, text=True)
    assert r.returncode != 0 and "no field 'missing'" in r.stderr
