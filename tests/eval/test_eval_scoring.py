"""Scoring: right / wrong / partial answers, exact match, aggregation."""

import pytest

from minimax_jax.data.haystack import noise_haystack, char_counter
from minimax_jax.eval.scoring import score_examples, score_output
from minimax_jax.data.tasks import completion, generate


def test_contains_whole_words():
    assert score_output(["1234567"], " 1234567.") == 1.0
    assert score_output(["1234567"], "it is 91234567") == 0.0
    assert score_output(["1234567"], "7654321") == 0.0
    assert score_output(["ABCDE", "FGHIJ"], "abcde and fghij") == 1.0
    assert score_output(["ABCDE", "FGHIJ", "KLMNO", "PQRST"], "ABCDE, KLMNO") == 0.5
    assert score_output(["amber-falcon"], "the amber-falcon code") == 1.0


def test_exact():
    assert score_output(["a", "b"], " A, b.\n", metric="exact") == 1.0
    assert score_output(["a", "b"], "a, b, c", metric="exact") == 0.0


def test_errors():
    with pytest.raises(ValueError, match="unknown metric"):
        score_output(["x"], "x", metric="fuzzy")
    with pytest.raises(ValueError, match="no expected answers"):
        score_output([], "x")
    with pytest.raises(TypeError, match="must be a str"):
        score_output(["x"], None)
    with pytest.raises(ValueError, match="2 examples but 1 outputs"):
        score_examples([None, None], ["x"])


def test_reference_completion_scores_one_and_wrong_scores_zero():
    hay = noise_haystack()
    exs = [generate(t, 3000, char_counter, hay, seed=s) for t in
           ("niah_single", "niah_multivalue", "variable_tracking") for s in (0, 1)]
    right = score_examples(exs, [completion(e) for e in exs])
    assert right["mean"] == 1.0 and right["count"] == 6
    assert set(right["by_task"]) == {"niah_single", "niah_multivalue", "variable_tracking"}
    wrong = score_examples(exs, [" 0000000." for _ in exs])
    assert wrong["mean"] == 0.0
    mixed = score_examples(exs, [completion(e) if i % 2 else "no idea" for i, e in enumerate(exs)])
    assert mixed["mean"] == 0.5
    assert mixed["by_task"]["niah_single"] == {"3000": 0.5}


def test_wilson_interval():
    """Textbook values (Wilson 1927, z = 1.96): 8 of 16 -> [0.280, 0.720]; 16 of 16 -> [0.806, 1]; 0 of 16 ->
    [0, 0.194]; the interval narrows with n and stays inside [0, 1]; bad input raises."""
    from minimax_jax.eval.scoring import wilson_interval
    assert wilson_interval(0.5, 16) == pytest.approx((0.2800, 0.7200), abs=5e-4)
    assert wilson_interval(1.0, 16) == pytest.approx((0.8064, 1.0), abs=5e-4)
    assert wilson_interval(0.0, 16) == pytest.approx((0.0, 0.1936), abs=5e-4)
    a, b = wilson_interval(0.75, 16), wilson_interval(0.75, 64)
    assert b[1] - b[0] < a[1] - a[0]
    for bad in ((0.5, 0), (1.5, 4), (-0.1, 4)):
        with pytest.raises(ValueError, match="wilson_interval"):
            wilson_interval(*bad)


def test_position_buckets_and_by_position():
    """Position buckets default to powers of two from 1024; a model whose log-prob depends on the position
    gives each bucket its own perplexity, and bad edges raise."""
    import math

    import numpy as np

    from minimax_jax.eval.perplexity import position_buckets, stream_perplexity
    assert position_buckets(8192) == [0, 1024, 2048, 4096, 8192]
    assert position_buckets(1000) == [0, 1000]
    fn = lambda t: -np.broadcast_to(np.where(np.arange(t.shape[1] - 1) < 4, 1.0, 2.0), (t.shape[0], t.shape[1] - 1))  # noqa: E731
    r = stream_perplexity(fn, np.arange(33, dtype=np.int32), 8, buckets=[0, 4, 8])
    assert [(b["lo"], b["hi"], b["tokens"]) for b in r["by_position"]] == [(0, 4, 16), (4, 8, 16)]
    assert [b["perplexity"] for b in r["by_position"]] == pytest.approx([math.e, math.e ** 2])
    with pytest.raises(ValueError, match="position buckets"):
        stream_perplexity(fn, np.arange(33, dtype=np.int32), 8, buckets=[0, 4, 4, 8])
