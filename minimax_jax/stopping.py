"""Host-side stop handling for generation: stop token ids, stop strings, repetition, length.

One ``StopChecker`` per sequence; call ``update(token_id, text)`` after each generated token
with the detokenised text of all generated tokens so far (the caller owns the tokenizer; the
text must only grow by appending). Checks, in this order:

1. stop token: ``token_id in stop_token_ids``. The final text is the text before this token
   (the stop token's own text, e.g. ``[e~[``, is not part of the output).
2. stop string: the earliest occurrence of any stop string in the text (the longest one when
   several start at the same place); the final text is trimmed just before it. Only the region
   that the new token could have completed is searched, so each step costs O(new text + longest
   stop string).
3. repetition: with ``repeat_max_period = P`` and ``repeat_max_count = m`` (both > 0), stop when
   for some cycle length ``p <= P`` the generated tokens end with ``m + 1`` consecutive copies of
   the same ``p``-token block, i.e. a cycle repeated more than ``m`` times (``P=1, m=3`` stops at
   the 4th identical token in a row). The text is kept whole; the reported period is the
   shortest one found.
4. length: ``max_new_tokens`` tokens have been generated; the text is kept whole.

``emittable_text`` gives the prefix that is safe to stream: it holds back any tail of the text
that could still grow into a stop string.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

__all__ = ["StopChecker", "StopConfig", "StopResult", "find_stop_string", "held_back_length",
           "repetition_period"]


@dataclasses.dataclass(frozen=True)
class StopConfig:
    """What ends a sequence (see module doc). Raises ValueError on invalid values."""

    stop_token_ids: frozenset = frozenset()
    stop_strings: tuple = ()
    max_new_tokens: int | None = None
    repeat_max_period: int = 0
    repeat_max_count: int = 0

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", frozenset(int(t) for t in self.stop_token_ids))
        if isinstance(self.stop_strings, str):
            raise ValueError("stop_strings must be a sequence of strings, not one string")
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ValueError("stop_strings must be non-empty strings")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.repeat_max_period < 0 or self.repeat_max_count < 0:
            raise ValueError("repeat_max_period and repeat_max_count must be >= 0")
        if (self.repeat_max_period > 0) != (self.repeat_max_count > 0):
            raise ValueError("set both repeat_max_period and repeat_max_count (> 0) or neither")


@dataclasses.dataclass(frozen=True)
class StopResult:
    """Why and where a sequence stopped.

    ``reason``: "stop_token" | "stop_string" | "repetition" | "length"; ``text``: final output
    text; ``num_tokens``: generated tokens kept (a stop token is not counted); ``detail``: the
    stop token id, the stop string, or the repetition period (None for length).
    """

    reason: str
    text: str
    num_tokens: int
    detail: object = None


def find_stop_string(text: str, stop_strings: Sequence[str], start: int = 0
                     ) -> tuple[int, str] | None:
    """(index, stop string) of the earliest occurrence at index >= ``start`` (longest first on
    ties), or None."""
    best = None
    for s in stop_strings:
        i = text.find(s, start)
        if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(s) > len(best[1]))):
            best = (i, s)
    return best


def held_back_length(text: str, stop_strings: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    out = 0
    for s in stop_strings:
        for n in range(min(len(s) - 1, len(text)), out, -1):
            if text.endswith(s[:n]):
                out = n
                break
    return out


def repetition_period(tokens: Sequence[int], max_period: int, max_count: int) -> int | None:
    """Shortest p <= max_period such that ``tokens`` ends with max_count + 1 copies of its last
    p tokens; None if there is none (or max_period / max_count is 0)."""
    if max_period <= 0 or max_count <= 0:
        return None
    toks = list(tokens)
    for p in range(1, max_period + 1):
        n = p * (max_count + 1)
        if n > len(toks):
            break
        tail = toks[-n:]
        if tail[p:] == tail[:-p]:
            return p
    return None


class StopChecker:
    """Tracks one sequence; ``update`` returns a StopResult once it must stop, else None."""

    def __init__(self, config: StopConfig):
        self.config = config
        self.tokens: list[int] = []
        self.text = ""
        self.result: StopResult | None = None
        self._max_stop = max((len(s) for s in config.stop_strings), default=0)

    @property
    def finished(self) -> bool:
        return self.result is not None

    def update(self, token_id: int, text: str) -> StopResult | None:
        """Record ``token_id`` and the generated ``text`` so far (including this token).

        Raises RuntimeError when called after the sequence stopped.
        """
        if self.result is not None:
            raise RuntimeError("sequence already stopped: " + self.result.reason)
        cfg = self.config
        token_id = int(token_id)
        if token_id in cfg.stop_token_ids:
            self.result = StopResult("stop_token", self.text, len(self.tokens), token_id)
            return self.result
        start = max(0, len(self.text) - self._max_stop + 1)
        self.tokens.append(token_id)
        self.text = text
        hit = find_stop_string(text, cfg.stop_strings, start) if cfg.stop_strings else None
        if hit is not None:
            self.result = StopResult("stop_string", text[:hit[0]], len(self.tokens), hit[1])
            return self.result
        period = repetition_period(self.tokens, cfg.repeat_max_period, cfg.repeat_max_count)
        if period is not None:
            self.result = StopResult("repetition", text, len(self.tokens), period)
        elif cfg.max_new_tokens is not None and len(self.tokens) >= cfg.max_new_tokens:
            self.result = StopResult("length", text, len(self.tokens))
        return self.result

    def emittable_text(self) -> str:
        """Text safe to stream now: the final text once stopped, else the text minus any tail
        that may still become a stop string."""
        if self.result is not None:
            return self.result.text
        return self.text[:len(self.text) - held_back_length(self.text, self.config.stop_strings)]

    def run(self, steps: Iterable[tuple[int, str]]) -> StopResult | None:
        """Feed (token_id, text) pairs until a stop; returns the result or None."""
        for token_id, text in steps:
            if self.update(token_id, text) is not None:
                break
        return self.result
