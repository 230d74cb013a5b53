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
