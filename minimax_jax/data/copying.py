"""Copy documents: text that repeats itself, the densest training signal for in-context copying.

A small model trained for minutes on prose plus retrieval documents does not learn to copy (RESULTS.md,
three-way run 3: loss on a repeated Shakespeare passage 3.49 -> 3.32; every retrieval task at 0.00),
because retrieval answers are a tiny share of its tokens. Induction heads (Olsson et al. 2022,
"In-context Learning and Induction Heads", section 3) form quickly when many tokens can be predicted
only by looking back: here half or more of every copy document is such tokens. The copy share is
meant for a short first curriculum stage (experiments/three_way/train_all.sh, ``CURRICULUM_STEPS``).

Each document is a few segments, each a span shown once and then repeated 1-2 more times, separated
by blank lines. Spans are (evenly) one of:

- a passage of the haystack prose (characters ``[40, 400]``, cut at word boundaries);
- a list of random haystack words (not predictable from language statistics);
- groups of random digits (the shape of the retrieval tasks' answers).

Every document is deterministic in ``(seed, prefix, index)``.
"""

from __future__ import annotations

import random
import re

_WORD = re.compile(r"[A-Za-z][A-Za-z']{2,}")


def _passage(rng: random.Random, text: str, n: int) -> str:
    start = rng.randrange(max(1, len(text) - n - 1))
    chunk = text[start:start + n + 40]
    chunk = chunk[chunk.find(" ") + 1:] if " " in chunk else chunk     # start at a word boundary
    return " ".join(chunk[:n].split())


def _span(rng: random.Random, text: str, words: list[str]) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        return _passage(rng, text, rng.randint(40, 400))
    if kind == 1:
        return " ".join(rng.choice(words) for _ in range(rng.randint(6, 60)))
    return " ".join(str(rng.randrange(10 ** 7)).zfill(rng.randint(3, 7)) for _ in range(rng.randint(3, 24)))


def copy_document(index: int, text: str, words: list[str], *, seed: int, max_chars: int,
                  prefix: str = "train") -> dict:
    """Copy document ``index``: a dict with ``text`` (at most ``max_chars`` characters unless one
    span repeated twice is longer), ``source`` ``"copy"`` and ``id``."""
    rng = random.Random(f"copy:{prefix}:{seed}:{index}")
    parts: list[str] = []
    used = 0
    while True:
        span = _span(rng, text, words)
        seg = "\n\n".join([span] * rng.choice((2, 2, 3)))
        if parts and used + len(seg) + 2 > max_chars:
            break
        parts.append(seg)
        used += len(seg) + 2
        if used >= max_chars // 2 and rng.random() < 0.3:
            break
    return {"text": "\n\n".join(parts), "source": "copy", "id": f"{prefix}-copy-{index}"}


def copy_documents(seed: int, budget_bytes: int, haystack_text: str, *, max_chars: int = 1500,
                   prefix: str = "train") -> list[dict]:
    """Copy documents up to ``budget_bytes`` of UTF-8 text.

    Args:
      seed: with ``prefix``, determines every document.
      budget_bytes: total size of the returned documents (bytes); stops at the first that would exceed it.
      haystack_text: prose the passages and random words are drawn from (training prose only).
      max_chars: target document length in characters (>= 200).
    Raises:
      ValueError: ``max_chars < 200`` or a haystack with fewer than 100 distinct words.
    """
    if max_chars < 200:
        raise ValueError(f"copy documents need max_chars >= 200, got {max_chars}")
    words = sorted(set(_WORD.findall(haystack_text)))
    if len(words) < 100:
        raise ValueError(f"the haystack has only {len(words)} distinct words; copy documents need 100")
    out, used, i = [], 0, 0
    while True:
        d = copy_document(i, haystack_text, words, seed=seed, max_chars=max_chars, prefix=prefix)
        n = len(d["text"].encode("utf-8"))
        if used + n > budget_bytes:
            return out
        out.append(d)
        used += n
        i += 1
