"""``DecodeEngine.prefill_start(hidden_last=...)`` + ``prefill_advance``: the interleaved prefill hands back
the hidden states of each prompt's last positions (the MTP drafter's input in the server), across chunk
boundaries, equal to ``prefill(return_hidden=True, hidden_last=...)``; slots started without it get
plain logits; a negative ``hidden_last`` is refused."""

from __future__ import annotations

import numpy as np
import pytest

from minimax_jax.decode import DecodeEngine
from tests.decode.test_decode_fixtures import random_tokens, small_model


def _engine(params, cfg):
    return DecodeEngine(params, cfg, max_seqs=3, max_len=128, prefill_chunk=32, implementation="xla",
                        prefix_cache=False)


def test_prefill_advance_returns_last_hidden_states_across_chunks():
    cfg, params = small_model("m3")
    rng = np.random.default_rng(0)
    prompts = [random_tokens(rng, cfg, n) for n in (70, 5, 40)]     # 70 = 32 + 32 + 6: the last 20 span two chunks
    want = {0: 20, 1: 20, 2: 0}
    ref = _engine(params, cfg)
    _, ref_logits, ref_hidden = ref.prefill(prompts, return_hidden=True, hidden_last=20)

    eng = _engine(params, cfg)
    slots = [eng.prefill_start(p, hidden_last=want[i]) for i, p in enumerate(prompts)]
    done: dict = {}
    while len(done) < len(slots):
        done.update(eng.prefill_advance([s for s in slots if s not in done]))
    for i, s in enumerate(slots):
        if want[i]:
            logits, hidden = done[s]
            assert hidden.shape == (min(20, len(prompts[i])), cfg.hidden_size)
            np.testing.assert_allclose(hidden, ref_hidden[i], rtol=1e-5, atol=1e-5)
        else:
            logits = done[s]
            assert not isinstance(logits, tuple)
        assert logits.shape == (1, cfg.vocab_size)
        np.testing.assert_allclose(logits, ref_logits[i], rtol=1e-5, atol=1e-5)
        assert eng.length(s) == len(prompts[i])


def test_negative_hidden_last_is_refused_and_admits_nothing():
    cfg, params = small_model("m3")
    eng = _engine(params, cfg)
    with pytest.raises(ValueError, match="hidden_last"):
        eng.prefill_start([1, 2, 3], hidden_last=-1)
    assert all(s is None for s in eng.seqs)
