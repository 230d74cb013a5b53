"""Held-out perplexity through a logprob_fn: exact values for known models, window coverage."""

import math
import os
import sysconfig

import numpy as np
import pytest

from minimax_jax.data.tokenizer import train_tokenizer_from_paths
from minimax_jax.eval.perplexity import heldout_perplexity, stream_perplexity, token_stream

STD = sysconfig.get_paths()["stdlib"]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer_from_paths([os.path.join(STD, "json", "*.py")], 500)


def unigram_fn(logp):
    def fn(tokens):
        return logp[tokens[:, 1:]]
    return fn


def test_uniform_model_has_perplexity_vocab():
    V = 50
    stream = np.random.default_rng(0).integers(0, V, size=1001).astype(np.int32)
    r = stream_perplexity(lambda t: np.full((t.shape[0], t.shape[1] - 1), -math.log(V)), stream, 64, 3)
    assert r["tokens"] == 1000
    assert r["perplexity"] == pytest.approx(V)


def test_unigram_model_matches_direct_sum(tok):
    text = open(os.path.join(STD, "json", "decoder.py")).read()
    stream = token_stream([text], tok, bos_id=1)
    counts = np.bincount(stream, minlength=tok.get_vocab_size()) + 1.0
    logp = np.log(counts / counts.sum())
    want = -logp[stream[1:]].mean()
    for seq_len, bs in [(16, 1), (100, 4), (len(stream) + 10, 2)]:
        r = heldout_perplexity(unigram_fn(logp), [text], tok, seq_len=seq_len, batch_size=bs, bos_id=1)
        assert r["tokens"] == len(stream) - 1
        assert r["nll"] == pytest.approx(want, rel=1e-9)
        assert r["bytes"] == len(text.encode())  # bos decodes to nothing
        assert r["bits_per_byte"] == pytest.approx(want * r["tokens"] / math.log(2) / r["bytes"])


def test_windows_never_exceed_seq_len_plus_one_and_max_tokens(tok):
    seen = []

    def fn(tokens):
        seen.append(tokens.shape)
        return np.full((tokens.shape[0], tokens.shape[1] - 1), -1.0)

    r = heldout_perplexity(fn, ["abc " * 500, "def " * 500], tok, seq_len=32, batch_size=5,
                           max_tokens=300)
    assert r["tokens"] == 299 and all(s[1] <= 33 for s in seen) and max(s[0] for s in seen) <= 5


def test_bad_logprob_fn_is_reported():
    stream = np.arange(10, dtype=np.int32)
    with pytest.raises(ValueError, match="returned shape"):
        stream_perplexity(lambda t: np.zeros((t.shape[0], t.shape[1])), stream, 4)
    with pytest.raises(ValueError, match="positive log-probabilities"):
        stream_perplexity(lambda t: np.ones((t.shape[0], t.shape[1] - 1)), stream, 4)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        stream_perplexity(lambda t: t, np.zeros(1, np.int32), 4)
