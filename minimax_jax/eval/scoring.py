"""Scoring of model outputs against synthetic-task answers.

``contains`` (default, the RULER-style "all answers must appear" metric): the score of one output is
the fraction of expected answers found in it as whole words (case-insensitive; ``1234567`` does
not match inside ``91234567``). ``exact``: 1.0 iff the output, stripped of surrounding whitespace
and a final period, equals the answers joined by ``", "`` (case-insensitive).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Sequence

from minimax_jax.data.tasks import Example

METRICS = ("contains", "exact")


def _found(answer: str, output: str) -> bool:
    pattern = r"(?<![0-9A-Za-z_])" + re.escape(answer) + r"(?![0-9A-Za-z_])"
    return re.search(pattern, output, flags=re.IGNORECASE) is not None


def score_output(answers: Sequence[str], output: str, metric: str = "contains") -> float:
    """Score in [0, 1] of one ``output`` string against expected ``answers``.

    Raises:
      ValueError: unknown metric or no answers.
    """
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; known: {METRICS}")
    if not answers:
        raise ValueError("no expected answers to score against")
    if not isinstance(output, str):
        raise TypeError(f"model output must be a str, got {type(output).__name__}")
    if metric == "exact":
        got = output.strip().rstrip(".").strip().lower()
        return float(got == ", ".join(answers).lower())
    return sum(_found(a, output) for a in answers) / len(answers)


def wilson_interval(mean: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval (95 % for ``z = 1.96``) of a mean score in [0, 1] over ``n`` prompts.

    Exact in form for 0/1 scores (Wilson 1927); for fractional scores (multi-answer tasks under
    ``contains``) it is conservative, as a score in [0, 1] with mean p has variance <= p (1 - p).
    Raises ValueError for n < 1 or a mean outside [0, 1]."""
    if n < 1 or not 0.0 <= mean <= 1.0:
        raise ValueError(f"wilson_interval needs n >= 1 and a mean in [0, 1], got n={n}, mean={mean}")
    denom = 1.0 + z * z / n
    centre = (mean + z * z / (2 * n)) / denom
    half = z * math.sqrt(mean * (1.0 - mean) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def score_examples(examples: Sequence[Example], outputs: Sequence[str], metric: str = "contains") -> dict:
    """Mean scores of outputs for examples, overall and per task and length, with 95 % intervals.

    Returns:
      ``{"mean": float, "count": int, "by_task": {task: {str(length): mean}}, "intervals": {task:
      {str(length): [lo, hi]}}`` (``wilson_interval``), ``"counts": {task: {str(length): prompts}},
      "scores": [float]}``.
    Raises:
      ValueError: when the two sequences differ in length.
    """
    if len(examples) != len(outputs):
        raise ValueError(f"{len(examples)} examples but {len(outputs)} outputs")
    scores = [score_output(e.answers, o, metric) for e, o in zip(examples, outputs)]
    groups: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for e, s in zip(examples, scores):
        groups[e.task][str(e.target_length)].append(s)
    by_task = {t: {L: sum(v) / len(v) for L, v in d.items()} for t, d in groups.items()}
    intervals = {t: {L: list(wilson_interval(by_task[t][L], len(v))) for L, v in d.items()} for t, d in groups.items()}
    counts = {t: {L: len(v) for L, v in d.items()} for t, d in groups.items()}
    mean = sum(scores) / len(scores) if scores else float("nan")
    return {"mean": mean, "count": len(scores), "by_task": by_task, "intervals": intervals, "counts": counts,
            "scores": scores}
