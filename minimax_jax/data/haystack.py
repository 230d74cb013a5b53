"""Haystack text, length measures and length fitting for the synthetic long-context tasks.

Lengths are measured by a ``CountFn`` (``str -> int``): :func:`token_counter` counts tokens of a
``tokenizers`` tokenizer (evaluation), :func:`char_counter` counts characters (training documents
built without a tokenizer). :func:`fit_length` finds an amount of filler that brings the rendered
prompt to the requested length (never over it, within a small tolerance under it).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable

from minimax_jax.data.prose import read_text, shakespeare_files, split_works

CountFn = Callable[[str], int]

# Filler used when no prose is installed: plain sentences written for this project.
_NOISE_SENTENCES = (
    "The river ran slowly past the old mill.",
    "A cold wind came down from the hills at dusk.",
    "Children played by the gate until the lamps were lit.",
    "The baker opened his shop before the sun was up.",
    "Clouds gathered over the harbour and the boats came home.",
    "In the market, traders argued over the price of wool.",
    "The library was quiet except for the turning of pages.",
    "Snow covered the fields and the roads were empty.",
)


class LengthError(ValueError):
    """The requested length cannot be met (too short for the template, or filler exhausted)."""


def token_counter(tokenizer) -> CountFn:
    """CountFn counting tokens of ``tokenizer`` (a ``tokenizers.Tokenizer``), no special tokens added."""

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False).ids)

    return count


def char_counter(text: str) -> int:
    """CountFn counting Unicode characters."""
    return len(text)


class Haystack:
    """A long filler text read from a seeded start, wrapping around at the end.

    Args:
      text: the filler (e.g. concatenated held-out prose); blank-line runs are collapsed.
      name: label stored in examples' metadata.
    Raises:
      LengthError: when ``text`` has fewer than 100 non-space characters.
    """

    def __init__(self, text: str, name: str = "custom"):
        text = re.sub(r"\n[ \t]*\n(\s*\n)+", "\n\n", text.replace("\r\n", "\n")).strip()
        if len(text.replace(" ", "")) < 100:
            raise LengthError("haystack text is too short (need at least 100 characters)")
        self.text = text + "\n"
        self.name = name
        self._words: list[str] | None = None

    def start_offset(self, rng: random.Random) -> int:
        """A seeded start at a line beginning."""
        i = rng.randrange(len(self.text))
        j = self.text.find("\n", i)
        return 0 if j < 0 or j + 1 >= len(self.text) else j + 1

    def piece(self, start: int, n_chars: int) -> str:
        """``n_chars`` characters from ``start`` (wrapping), cut back to the last whitespace."""
        if n_chars <= 0:
            return ""
        reps = (start + n_chars) // len(self.text) + 1
        s = (self.text * reps)[start : start + n_chars]
        if len(s) == n_chars:
            cut = max(s.rfind(" "), s.rfind("\n"))
            if cut > 0:
                s = s[:cut]
        return s.strip()

    def words(self) -> list[str]:
        """Sorted distinct lowercase alphabetic words of at least 4 letters (for word-list tasks)."""
        if self._words is None:
            self._words = sorted({w.lower() for w in re.findall(r"[A-Za-z]{4,}", self.text)})
        return self._words


def noise_haystack() -> Haystack:
    """A haystack of repeated plain sentences (no extra package needed)."""
    return Haystack(" ".join(_NOISE_SENTENCES * 4).replace(". ", ".\n"), name="noise")


def prose_haystack(heldout_works: int = 4, seed: int = 0, split: str = "heldout") -> Haystack:
    """Shakespeare haystack from the held-out (or train) works of :func:`split_works`.

    Defaults match :mod:`minimax_jax.data.corpus`, so evaluation haystacks are held-out text.
    Raises:
      MissingDataError: when the ``shakespeare`` package is missing.
    """
    train, heldout = split_works(shakespeare_files(), heldout_works, seed)
    files = heldout if split == "heldout" else train
    return Haystack("\n\n".join(read_text(f) for f in files), name=f"shakespeare-{split}")


def insertion_point(text: str, depth: float) -> int:
    """Index in ``text`` at fraction ``depth`` in [0, 1], moved to the nearest line start (within
    ``max(80, len(text) // 50)`` characters), else back to a word start."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    i = int(round(depth * len(text)))
    if i >= len(text) or i == 0:
        return i
    window = max(80, len(text) // 50)
    before = text.rfind("\n", 0, i)
    after = text.find("\n", i)
    candidates = [p + 1 for p in (before, after) if p >= 0 and abs(p + 1 - i) <= window]
    if candidates:
        return min(candidates, key=lambda p: (abs(p - i), p))
    space = text.rfind(" ", 0, i + 1)
    return space + 1 if space >= 0 else 0


def insert_needles(text: str, needles: list[tuple[float, str]]) -> str:
    """Inserts each ``(depth, sentence)`` into ``text`` as its own line at that depth.

    Depths refer to the filler without needles; needles with equal depth keep their order.
    """
    points = sorted(
        ((insertion_point(text, d), k, s) for k, (d, s) in enumerate(needles)), key=lambda t: t[:2]
    )
    out, prev = [], 0
    for pos, _, sentence in points:
        chunk = text[prev:pos]
        if chunk and not chunk.endswith("\n"):
            chunk += "\n"
        out.append(chunk)
        out.append(sentence + "\n")
        prev = pos
    out.append(text[prev:])
    return "".join(out)


def fit_length(build: Callable[[int], str], target: int, count: CountFn, upper: int,
               tolerance: int | None = None) -> tuple[int, str, int]:
    """Finds ``n`` in ``[0, upper]`` with ``target - tolerance <= count(build(n)) <= target``.

    ``build`` must be (nearly) monotone in ``n``. The search interpolates on the measured lengths
    (falling back to bisection when interpolation stalls), so long prompts are measured only a
    handful of times. ``tolerance`` defaults to ``max(2, target // 2000)``; when no ``n`` lands in
    the window (one unit adds more than the tolerance), the largest fitting ``n`` is returned.

    Returns:
      ``(n, text, length)``.
    Raises:
      LengthError: when even ``build(0)`` exceeds ``target`` (the template alone is too long), or
        when ``build(upper)`` still falls short (not enough filler to reach the target).
    """
    tol = max(2, target // 2000) if tolerance is None else max(0, tolerance)
    base_text = build(0)
    base = count(base_text)
    if base > target:
        raise LengthError(f"target length {target} is shorter than the task template ({base})")
    lo, lo_len, lo_text = 0, base, base_text  # largest n known to fit
    hi, hi_len = None, None  # smallest n known not to fit
    aim = target - tol / 2
    last, streak = None, 0
    while lo_len < target - tol and (hi is None or hi - lo > 1):
        if hi is None:  # extrapolate from the density so far (first step: a small probe)
            g = min(upper, 1024) if lo == 0 else lo + (aim - lo_len) * lo / max(lo_len - base, 1e-9)
            g = max(min(upper, int(g)), lo + 1)
        elif streak >= 3:  # interpolation keeps landing on one side: bisect
            g = (lo + hi) // 2
        else:
            g = lo + int((aim - lo_len) * (hi - lo) / max(hi_len - lo_len, 1e-9))
            g = min(max(g, lo + 1), hi - 1)
        text = build(g)
        c = count(text)
        side = "lo" if c <= target else "hi"
        streak = streak + 1 if side == last else 1
        last = side
        if side == "lo":
            lo, lo_len, lo_text = g, c, text
            if lo >= upper and lo_len < target - tol:
                raise LengthError(
                    f"not enough filler: {upper} units only reach length {lo_len} < target {target}"
                )
        else:
            hi, hi_len = g, c
    return lo, lo_text, lo_len
