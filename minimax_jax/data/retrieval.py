"""Synthetic retrieval training documents built from the evaluation tasks (:mod:`minimax_jax.data.tasks`).

Two modes (``MODES``):

- ``"single"``: one task example per document, ``prompt + completion`` (one supervised answer),
  lengths log-uniform in ``[min_chars, max_chars]``. The original recipe (issue 10's first run).
- ``"dense"`` (default): many supervised answers per byte.

  * Lengths are log-uniform from ``min_chars`` (default 500: a few hundred characters of haystack)
    to ``max_chars``, so most documents are short complete examples (many answers per byte) while
    the bytes are spread evenly over all lengths up to ``max_chars`` (long-range retrieval).
  * ``niah_multikey`` documents (a third of all) hide ``length // 800`` to ``length // 400``
    (at most 48, at least 2-4 where the length allows) name -> code needles and ask for EVERY one
    of them, each question followed by its answer; ``variable_tracking`` documents hold up to
    ``length // 2000`` chains (at most 8) and ask about every chain. Each question is the eval prompt's own tail with the key (or
    value) swapped, so the first question+answer after the haystack is exactly the eval prompt and
    its reference completion, and every later pair has the same wording::

        {head}\\n\\n{haystack with needles}\\n\\n{question 1}\\nAnswer: ... is 1234567.\\n\\n{question 2}...

  * the other three tasks (one question each by construction) are plain examples.

Every document is deterministic in ``(seed, prefix, index)``, so documents can be generated in any
order by any number of processes (:func:`retrieval_documents` with ``workers > 1``) and give the
same corpus. Lengths are in characters (no tokenizer exists yet when the corpus is built) and every
document is at most ``max_chars`` long.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import math
import multiprocessing as mp
import random
import re

from minimax_jax.data.haystack import Haystack, LengthError, char_counter
from minimax_jax.data.tasks import Example, completion, generate

MODES = ("dense", "single")
DEFAULT_MODE = "dense"
DEFAULT_MIN_CHARS = {"dense": 500, "single": 2000}
# Task of document i: TASK_ORDER[i % 6]. Multi-key twice: its documents carry the most answers.
TASK_ORDER = ("common_words", "niah_multikey", "niah_multivalue", "niah_single", "variable_tracking",
              "niah_multikey")
# Documents per work unit of the parallel generator (also the granularity of the budget check).
CHUNK = 64
WORKER_TIMEOUT_S = 120
# Upper bounds on the characters one extra question + answer adds (see _extras).
_MULTIKEY_EXTRA = 150
_VT_EXTRA = 240
_MULTIKEY_NEEDLE = re.compile(r"The special code for (\S+) is (\d+)\.")

_SINGLE_PARAMS = {
    "niah_single": lambda rng, n: {},
    "niah_multikey": lambda rng, n: {"num_keys": rng.randint(2, 8)},
    "niah_multivalue": lambda rng, n: {"num_values": rng.randint(2, 6)},
    "variable_tracking": lambda rng, n: {"num_hops": rng.randint(2, 6), "num_chains": rng.randint(1, 3)},
    "common_words": lambda rng, n: {"num_common": rng.randint(3, 10)},
}
_DENSE_PARAMS = {
    "niah_single": lambda rng, n: {},
    "niah_multikey": lambda rng, n: {"num_keys": _upper_half(rng, max(4, min(48, n // 400)))},
    "niah_multivalue": lambda rng, n: {"num_values": rng.randint(2, 6)},
    "variable_tracking": lambda rng, n: {"num_hops": rng.randint(2, 6),
                                         "num_chains": _upper_half(rng, max(2, min(8, n // 2000)))},
    "common_words": lambda rng, n: {"num_common": rng.randint(3, 10)},
}


def _upper_half(rng: random.Random, hi: int) -> int:
    return rng.randint(max(1, hi // 2), hi)


def _tail(ex: Example) -> str:
    """The eval prompt's question + answer prefix (everything after the last blank line)."""
    return ex.prompt.rsplit("\n\n", 1)[1]


def _reserve(task: str, params: dict, mode: str) -> int:
    """Characters kept free for the extra questions of a dense document."""
    if mode != "dense":
        return 0
    if task == "niah_multikey":
        return (params["num_keys"] - 1) * _MULTIKEY_EXTRA
    if task == "variable_tracking":
        return (params["num_chains"] - 1) * _VT_EXTRA
    return 0


def _extras(ex: Example, rng: random.Random) -> list[tuple[str, tuple[str, ...]]]:
    """(question tail, answers) of the extra questions of a dense document: the eval tail with the
    queried key (multi-key) or value (variable tracking) replaced by another one."""
    tail = _tail(ex)
    if ex.task == "niah_multikey":
        pairs = [_MULTIKEY_NEEDLE.fullmatch(s).groups() for s in ex.metadata["needles"]]
        key = ex.metadata["key"]
        others = [(k, v) for k, v in pairs if k != key]
        rng.shuffle(others)
        return [(tail.replace(key, k), (v,)) for k, v in others]
    if ex.task == "variable_tracking":
        value = ex.metadata["value"]
        others = list(ex.metadata["chains"][1:])
        rng.shuffle(others)
        return [(tail.replace(value, v), tuple(chain)) for v, chain in others]
    return []


def make_document(task: str, index: int, haystack: Haystack, *, seed: int, min_chars: int,
                  max_chars: int, mode: str = DEFAULT_MODE, prefix: str = "train") -> dict | None:
    """Document ``index`` (a dict with ``text``, ``source``, ``id``, ``answers``: the number of
    supervised answers), or None when its task cannot reach the drawn length (rare; skipped)."""
    rng = random.Random(f"retrieval:{mode}:{prefix}:{seed}:{index}")
    length = int(math.exp(rng.uniform(math.log(min_chars), math.log(max_chars))))
    params = (_DENSE_PARAMS if mode == "dense" else _SINGLE_PARAMS)[task](rng, length)
    # The index of the eval generator: disjoint between prefixes (train / heldout).
    gen_index = index if prefix == "train" else (1 << 40) + index
    for _ in range(3):  # a too-short length for the task's template: try twice as long
        reserve = _reserve(task, params, mode)
        if task == "niah_multikey" and length - reserve < min(length, 600):
            params["num_keys"] = max(1, 1 + (length - 600) // _MULTIKEY_EXTRA)
            reserve = _reserve(task, params, mode)
        try:
            ex = generate(task, length - reserve, char_counter, haystack, seed=seed, index=gen_index, **params)
            break
        except LengthError:
            if length >= max_chars:
                return None
            length = min(max_chars, 2 * length)
    else:
        return None
    parts = [ex.prompt, completion(ex)]
    n = 1
    if mode == "dense":
        for tail, answers in _extras(ex, rng):
            parts += ["\n\n", tail, " " + ", ".join(answers) + "."]
            n += 1
    return {"text": "".join(parts), "source": f"synthetic:{task}", "id": f"{prefix}-{index}", "answers": n}


# --- parallel generation -----------------------------------------------------------------------

_WORKER_HAYSTACK: Haystack | None = None


def _init_worker(text: str, name: str) -> None:
    global _WORKER_HAYSTACK
    _WORKER_HAYSTACK = Haystack(text, name=name)
    _WORKER_HAYSTACK.words()


def _chunk(args) -> list[dict]:
    start, kw = args
    out = []
    for i in range(start, start + CHUNK):
        d = make_document(TASK_ORDER[i % len(TASK_ORDER)], i, _WORKER_HAYSTACK, **kw)
        if d is not None:
            out.append(d)
    return out


def retrieval_documents(seed: int, budget_bytes: int, haystack_text: str, *, min_chars: int | None = None,
                        max_chars: int = 24000, mode: str = DEFAULT_MODE, prefix: str = "train",
                        max_docs: int | None = None, workers: int = 1) -> list[dict]:
    """Synthetic retrieval documents of all five tasks (in turn) up to ``budget_bytes`` of UTF-8.

    The result does not depend on ``workers`` (processes; 1 = in this process): documents are made
    in chunks of :data:`CHUNK` indices and taken in index order until the budget is met.

    Raises:
      ValueError: unknown mode, or not ``300 <= min_chars <= max_chars``.
    """
    if mode not in MODES:
        raise ValueError(f"synthetic mode must be one of {MODES}, got {mode!r}")
    min_chars = DEFAULT_MIN_CHARS[mode] if min_chars is None else min_chars
    if not 300 <= min_chars <= max_chars:
        raise ValueError(f"need 300 <= synthetic_min_chars <= synthetic_max_chars, got {min_chars}, {max_chars}")
    kw = {"seed": seed, "min_chars": min_chars, "max_chars": max_chars, "mode": mode, "prefix": prefix}
    name = "shakespeare-train" if prefix == "train" else f"shakespeare-{prefix}"
    docs: list[dict] = []
    used = 0

    def full() -> bool:
        return used >= budget_bytes or (max_docs is not None and len(docs) >= max_docs)

    def take(chunk: list[dict]) -> None:
        nonlocal used
        for d in chunk:
            if full():
                return
            docs.append(d)
            used += len(d["text"].encode("utf-8"))

    if workers <= 1:
        _init_worker(haystack_text, name)
        start = 0
        while not full():
            take(_chunk((start, kw)))
            start += CHUNK
        return docs
    # spawn, not fork: the caller (train.py's data preparation) may already run JAX threads.
    # concurrent.futures, not multiprocessing.Pool: Pool.get() waits forever when a worker dies, and
    # Pool.terminate() can deadlock on the task queue's lock (seen: a test hung 12 min with both
    # workers defunct); the executor raises BrokenProcessPool instead and shuts down cleanly.
    # A window of 2 chunks per worker is in flight; results are taken in index order.
    ex = cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_init_worker,
                                initargs=(haystack_text, name))
    try:
        pending: collections.deque = collections.deque()
        start = 0
        while not full():
            while len(pending) < 2 * workers:
                pending.append(ex.submit(_chunk, (start, kw)))
                start += CHUNK
            try:
                take(pending.popleft().result(timeout=WORKER_TIMEOUT_S))
            except cf.TimeoutError:
                raise RuntimeError(f"a synthetic-document worker gave no result in {WORKER_TIMEOUT_S} s (a {CHUNK}-"
                                   f"document chunk normally takes about a second); rerun with workers=1 to see "
                                   f"its error") from None
    finally:
        ex.shutdown(wait=True, cancel_futures=True)
    return docs
