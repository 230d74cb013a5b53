"""Server metrics in the Prometheus text exposition format (``GET /metrics``).

Histograms (seconds): ``minimax_serve_time_to_first_token_seconds`` (arrival to the first token's
logits: queueing + prefill), ``minimax_serve_inter_token_latency_seconds``. Counters:
``minimax_serve_generated_tokens_total``, ``minimax_serve_prompt_tokens_total``,
``minimax_serve_cached_prompt_tokens_total`` (served from the prefix cache),
``minimax_serve_requests_finished_total{reason}``, ``minimax_serve_requests_rejected_total`` (429).
Gauges: ``minimax_serve_queue_length``, ``minimax_serve_active_sequences``,
``minimax_serve_free_pages``, ``minimax_serve_cached_pages``, ``minimax_serve_prefix_cache_hit_rate``
(cached / prompt tokens), ``minimax_serve_tokens_per_second`` (generated over the last
``window_s`` seconds). Thread-safe (the worker thread writes, the HTTP side reads).
"""

from __future__ import annotations

import bisect
import collections
import threading
import time

__all__ = ["Histogram", "Metrics"]

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_P = "minimax_serve_"


class Histogram:
    """Cumulative-bucket histogram (Prometheus semantics: ``le`` upper bounds, +Inf last)."""

    def __init__(self, buckets=_BUCKETS):
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += 1
        self.sum += v
        self.count += 1

    def lines(self, name: str, help_: str) -> list[str]:
        out = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        acc = 0
        for b, c in zip(self.bounds + (float("inf"),), self.counts):
            acc += c
            le = "+Inf" if b == float("inf") else repr(b)
            out.append(f'{name}_bucket{{le="{le}"}} {acc}')
        out += [f"{name}_sum {self.sum!r}", f"{name}_count {self.count}"]
        return out


class Metrics:
    def __init__(self, window_s: float = 10.0):
        self._lock = threading.Lock()
        self.ttft, self.itl = Histogram(), Histogram()
        self.generated = self.prompt_tokens = self.cached_tokens = self.rejected = 0
        self.drafted = self.accepted = 0
        self.finished_by = collections.Counter()
        self.state = dict(queue=0, active=0, free_pages=0, cached_pages=0)
        self.window_s = window_s
        self._recent: collections.deque[float] = collections.deque()

    def admitted(self, prompt_tokens: int, cached_tokens: int, ttft_s: float) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.cached_tokens += cached_tokens
            self.ttft.observe(ttft_s)

    def token(self, since_last_s: float | None) -> None:
        now = time.monotonic()
        with self._lock:
            self.generated += 1
            self._recent.append(now)
            if since_last_s is not None:
                self.itl.observe(since_last_s)

    def finished(self, reason: str) -> None:
        with self._lock:
            self.finished_by[reason] += 1

    def verified(self, drafted: int, accepted: int) -> None:
        """Speculative decoding: ``drafted`` draft tokens verified, ``accepted`` of them kept."""
        with self._lock:
            self.drafted += drafted
            self.accepted += accepted

    def reject(self) -> None:
        with self._lock:
            self.rejected += 1

    def set_state(self, **values) -> None:
        with self._lock:
            self.state.update(values)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def render(self) -> str:
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0] < now - self.window_s:
                self._recent.popleft()
            lines = self.ttft.lines(_P + "time_to_first_token_seconds", "Arrival to first token (queue + prefill).")
            lines += self.itl.lines(_P + "inter_token_latency_seconds", "Time between two tokens of a sequence.")
            for name, v, h in (("generated_tokens_total", self.generated, "Generated tokens."),
                               ("prompt_tokens_total", self.prompt_tokens, "Prompt tokens admitted."),
                               ("cached_prompt_tokens_total", self.cached_tokens, "Prompt tokens from the prefix cache."),
                               ("requests_rejected_total", self.rejected, "Requests refused with 429."),
                               ("draft_tokens_total", self.drafted, "Speculative draft tokens verified."),
                               ("accepted_draft_tokens_total", self.accepted, "Speculative draft tokens kept.")):
                lines += [f"# HELP {_P}{name} {h}", f"# TYPE {_P}{name} counter", f"{_P}{name} {v}"]
            lines += [f"# HELP {_P}requests_finished_total Finished sequences by reason.",
                      f"# TYPE {_P}requests_finished_total counter"]
            lines += [f'{_P}requests_finished_total{{reason="{r}"}} {n}' for r, n in sorted(self.finished_by.items())]
            gauges = dict(queue_length=self.state["queue"], active_sequences=self.state["active"],
                          free_pages=self.state["free_pages"], cached_pages=self.state["cached_pages"],
                          prefix_cache_hit_rate=self.hit_rate,
                          tokens_per_second=len(self._recent) / self.window_s)
            for name, v in gauges.items():
                lines += [f"# TYPE {_P}{name} gauge", f"{_P}{name} {v!r}"]
        return "\n".join(lines) + "\n"
