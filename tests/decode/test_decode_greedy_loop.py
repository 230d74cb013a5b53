"""``DecodeEngine.decode_greedy`` (greedy steps in one compiled device loop, issue 34's host overhead):
the same tokens and cache as one ``decode_step`` per token with argmax in between, on a sparse MSA model
(contexts past 64 tokens), two rows of different lengths crossing page boundaries, with and without
padded decode rows; bad arguments refused."""

from __future__ import annotations

import numpy as np
import pytest

from minimax_jax.decode import DecodeEngine
from tests.decode.test_decode_fixtures import random_tokens, small_model


@pytest.mark.parametrize("query_rows", [None, 4])
def test_loop_equals_one_step_at_a_time(query_rows):
    cfg, params = small_model("m3")
    rng = np.random.default_rng(5)
    prompts = [random_tokens(rng, cfg, n) for n in (70, 29)]
    runs = []
    for loop in (False, True):
        eng = DecodeEngine(params, cfg, max_seqs=2, max_len=176, prefill_chunk=32, implementation="xla",
                           query_rows=query_rows)
        slots, logits = eng.prefill(prompts)
        cur = np.array([int(np.argmax(lg[0])) for lg in logits])
        out = []
        for _ in range(3):
            if loop:
                chosen = eng.decode_greedy(cur, slots, 6)
            else:
                chosen = []
                for _ in range(6):
                    cur = np.argmax(eng.decode_step(cur[:, None], slots)[:, 0], axis=-1)
                    chosen.append(cur)
                chosen = np.stack(chosen, axis=1)
            cur = chosen[:, -1]
            out.append(chosen)
        runs.append((np.concatenate(out, axis=1), [list(eng.seqs[s].tokens) for s in slots],
                     [eng.length(s) for s in slots]))
    (a, seq_a, len_a), (b, seq_b, len_b) = runs
    assert a.shape == (2, 18)
    np.testing.assert_array_equal(a, b)
    assert seq_a == seq_b and len_a == len_b == [70 + 18, 29 + 18]


def test_bad_arguments_are_refused():
    cfg, params = small_model("m3")
    eng = DecodeEngine(params, cfg, max_seqs=2, max_len=40, prefill_chunk=32, implementation="xla")
    (s,), _ = eng.prefill([list(range(3, 30))])
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        eng.decode_greedy(np.array([5]), [s], 0)
    with pytest.raises(ValueError, match=r"tokens must be \[len\(slots\)=1\]"):
        eng.decode_greedy(np.array([5, 6]), [s], 2)
    with pytest.raises(ValueError, match="exceeds max_len"):
        eng.decode_greedy(np.array([5]), [s], 20)
    assert eng.length(s) == 27                              # nothing reserved or written
