"""Repetition, presence and frequency penalties on next-token logits (host NumPy, before sampling).

Math, per row, applied to the raw logits before temperature and the top-k / top-p / min-p filters
(the order of Hugging Face ``generate`` and vLLM):

* repetition penalty ``r > 0`` (Hugging Face ``RepetitionPenaltyLogitsProcessor``, CTRL, Keskar et
  al. 2019): every token seen in the prompt or the generated text gets ``l / r`` if ``l > 0`` else
  ``l * r``; ``r = 1`` is off, ``r > 1`` discourages repeats.
* presence ``p`` and frequency ``f`` penalties (OpenAI API): ``l - f * c - p * (c > 0)`` with ``c``
  the token's count in the generated text (the prompt is not counted, as in OpenAI and vLLM);
  ``0`` is off, positive values discourage repeats, negative ones encourage them.
* logit bias (OpenAI ``logit_bias``): ``l + b[t]`` for the listed token ids ``t`` (``apply_logit_bias``;
  after the penalties, all of which are additive except the repetition penalty).

Shapes: ``logits [B, V]`` float, ``seen [B, V]`` bool, ``counts [B, V]`` int; the result is float32.
"""

from __future__ import annotations

import numpy as np

__all__ = ["PenaltyTracker", "apply_logit_bias", "apply_penalties"]


def apply_penalties(logits, seen, counts, *, repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
                    frequency_penalty: float = 0.0) -> np.ndarray:
    """Penalised float32 copy of ``logits [B, V]`` (module doc). ``seen``: tokens of prompt + generated
    text; ``counts``: occurrences in the generated text. Raises ValueError on shape mismatches or
    ``repetition_penalty <= 0``."""
    x = np.array(logits, np.float32)
    seen, counts = np.asarray(seen, bool), np.asarray(counts)
    if x.ndim != 2 or seen.shape != x.shape or counts.shape != x.shape:
        raise ValueError(f"logits, seen and counts must all be [B, V]; got {x.shape}, {seen.shape}, {counts.shape}")
    if not repetition_penalty > 0:
        raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty}")
    if repetition_penalty != 1.0:
        r = np.float32(repetition_penalty)
        x = np.where(seen, np.where(x > 0, x / r, x * r), x)
    if frequency_penalty != 0.0:
        x = x - np.float32(frequency_penalty) * counts.astype(np.float32)
    if presence_penalty != 0.0:
        x = x - np.float32(presence_penalty) * (counts > 0).astype(np.float32)
    return x.astype(np.float32)


def apply_logit_bias(logits, token_ids, biases) -> np.ndarray:
    """float32 copy of ``logits [B, V]`` with ``biases[j]`` added to column ``token_ids[j]`` of every row
    (ids distinct, in ``[0, V)``). Raises ValueError on mismatched lengths or ids out of range."""
    x = np.array(logits, np.float32)
    ids, b = np.asarray(token_ids, np.int64), np.asarray(biases, np.float32)
    if ids.shape != b.shape or ids.ndim != 1:
        raise ValueError(f"token_ids and biases must be [n]; got {ids.shape}, {b.shape}")
    if x.ndim != 2 or (ids.size and not (0 <= ids.min() and ids.max() < x.shape[1])):
        raise ValueError(f"token ids must lie in [0, {x.shape[-1]}) of logits [B, V] {x.shape}")
    x[:, ids] += b
    return x


class PenaltyTracker:
    """Per-row ``seen`` / ``counts`` state for ``apply_penalties`` (rows = stable ints, vocab ``V``)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.seen: dict[int, np.ndarray] = {}
        self.counts: dict[int, np.ndarray] = {}

    def start(self, row: int, prompt) -> None:
        self.seen[row] = np.zeros(self.vocab_size, bool)
        self.seen[row][np.asarray(prompt, np.int64)] = True
        self.counts[row] = np.zeros(self.vocab_size, np.int32)

    def add(self, row: int, token: int) -> None:
        self.seen[row][token] = True
        self.counts[row][token] += 1

    def apply(self, logits, rows, **penalties) -> np.ndarray:
        """``apply_penalties`` of ``logits [len(rows), V]`` with these rows' state."""
        return apply_penalties(logits, np.stack([self.seen[r] for r in rows]),
                               np.stack([self.counts[r] for r in rows]), **penalties)
