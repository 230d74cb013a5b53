"""The tokenizer shipped for the tiny configs (configs/tiny-data/): rebuilt exactly from the shipped
text by the documented command, its ids and special tokens fit tiny-m2 / tiny-m3, the tiny training
configs use it, and the text through it is learnable (its token distribution is far from uniform)."""

import collections
import math
import os

from minimax_jax.config import load_config
from minimax_jax.data.tokenizer import load_tokenizer, special_token_ids, train_tokenizer_from_paths
from minimax_jax.train.config import load_train_config
from tests.paths import REPO_ROOT

DATA = os.path.join(REPO_ROOT, "configs", "tiny-data")
TOKENIZER = os.path.join(DATA, "tokenizer.json")
TEXT = os.path.join(DATA, "romeo_and_juliet.txt")


def test_shipped_tokenizer_is_rebuilt_exactly_from_the_shipped_text():
    """`python -m minimax_jax.data.tokenizer train --input TEXT --vocab_size 512 --out configs/tiny-data`."""
    rebuilt = train_tokenizer_from_paths([TEXT], 512)
    assert rebuilt.to_str() == load_tokenizer(TOKENIZER).to_str()
    assert os.path.getsize(TOKENIZER) < 100_000 and os.path.getsize(TEXT) < 300_000


def test_ids_and_special_tokens_fit_every_tiny_model():
    tok = load_tokenizer(TOKENIZER)
    ids = special_token_ids(tok)
    for name in ("tiny-m2", "tiny-m3"):
        cfg = load_config(name)
        assert tok.get_vocab_size() <= cfg.vocab_size, name
        assert max(tok.get_vocab().values()) < cfg.vocab_size, name
        assert (cfg.bos_token_id, cfg.eos_token_id) == (ids["bos_token_id"], ids["eos_token_id"]), name


def test_tiny_training_configs_use_it_and_need_nothing_prepared(monkeypatch):
    from minimax_jax.train.prepare import missing_data

    monkeypatch.chdir(REPO_ROOT)          # the README runs train.py from the repository root
    for name in ("tiny-m3.yaml", "tiny.yaml"):
        tc = load_train_config(os.path.join("configs", "train", name))
        assert tc.data.kind == "grain" and os.path.samefile(tc.data.fields["tokenizer"], TOKENIZER), name
    tc = load_train_config(os.path.join("configs", "train", "tiny-m3.yaml"))
    assert missing_data(tc) == []
    assert [os.path.abspath(s) for s in tc.data.fields["sources"]] == [TEXT]


def test_text_round_trips_and_is_far_from_uniform():
    tok = load_tokenizer(TOKENIZER)
    with open(TEXT, encoding="utf-8") as f:
        text = f.read()
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    other = "def f(x):\n    return {'é': x ** 2}  # ünïcödé, 12345\n"
    assert tok.decode(tok.encode(other).ids) == other          # byte-level: any text round-trips
    assert len(text) / len(ids) > 1.8                          # merges compress it (bytes alone: 1.0)
    n = len(ids)
    entropy = -sum(c / n * math.log(c / n) for c in collections.Counter(ids).values())
    # a model that only learns the token frequencies already beats the uniform loss ln(512) by ~1 nat
    assert entropy < math.log(512) - 0.9, entropy
