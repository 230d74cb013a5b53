"""Generation statistics: time to first token, throughput with JIT compilation apart, speculative
acceptance.

Compilation is measured, not guessed: ``CompileClock`` listens to JAX's monitoring time spans of
tracing, lowering and backend compilation (``jax.monitoring``; nested spans are merged, so a jit
traced inside another counts once). Decode throughput is steady state: the tokens of the decode
steps during which nothing compiled, over those steps' wall time; the steps that compiled are
reported apart as compile time (their whole wall time, so the steady rate is exact).
"""

from __future__ import annotations

import dataclasses
import threading
import time

__all__ = ["COMPILE_EVENTS", "CompileClock", "GenerationStats", "Timer", "combine_stats", "merged_seconds"]

#: ``jax.monitoring`` time-span events counted as compilation.
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")


class Timer:
    """Monotonic stopwatch started at construction."""

    def __init__(self):
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def merged_seconds(spans, start: float, end: float) -> float:
    """Length of the union of ``spans`` ``[(t0, t1), ...]`` clipped to ``[start, end]`` (seconds)."""
    total, reach = 0.0, start
    for a, b in sorted(spans):
        a, b = max(a, reach), min(b, end)
        if b > a:
            total += b - a
            reach = b
    return total


class CompileClock:
    """Wall-clock seconds JAX spent compiling (``time.time()`` windows, as JAX reports spans).

    ``now()`` marks a window start; ``since(t0)`` = compile seconds in ``[t0, now]``. One process-wide
    listener, registered on first use.
    """

    _spans: list = []
    _lock = threading.Lock()
    _registered = False

    def __init__(self):
        cls = type(self)
        with cls._lock:
            if not cls._registered:
                import jax.monitoring

                jax.monitoring.register_event_time_span_listener(cls._listen)
                cls._registered = True

    @classmethod
    def _listen(cls, event: str, start: float, end: float, **_kw) -> None:
        if event in COMPILE_EVENTS:
            with cls._lock:
                cls._spans.append((start, end))

    @staticmethod
    def now() -> float:
        return time.time()

    def since(self, t0: float) -> float:
        with self._lock:
            spans = [s for s in self._spans if s[1] > t0]
        return merged_seconds(spans, t0, time.time())


@dataclasses.dataclass
class GenerationStats:
    """Filled by the generation loop.

    ``engine``: what ran (``Backend.describe()``); ``batch``: rows; ``prompt_tokens`` / ``generated_tokens``: totals
    over the batch; ``prefill_s``: prefill wall time, of which ``prefill_compile_s`` compiling; ``ttft_s``: start of
    ``generate`` to the first sampled token; ``decode_s``: first token to the end; ``decode_steps``: model steps
    after prefill (in a device loop, those up to the last one whose tokens a row used), ``compile_steps`` of them
    in calls that compiled something, taking ``decode_compile_s``; the others took
    ``steady_s`` for ``steady_tokens``; ``drafted`` / ``accepted``: speculative drafts proposed / kept.
    """

    engine: str = ""
    speculative: str | None = None
    batch: int = 1
    decode_loop: int = 1
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    prefill_compile_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    compile_steps: int = 0
    decode_compile_s: float = 0.0
    steady_tokens: int = 0
    steady_s: float = 0.0
    drafted: int = 0
    accepted: int = 0

    def add_step(self, seconds: float, tokens: int, compiled: bool, steps: int = 1) -> None:
        """Account one decode call of ``seconds`` wall time that produced ``tokens`` (whole batch) in ``steps``
        model steps (a device loop: the steps whose tokens were used)."""
        if compiled:
            self.compile_steps += steps
            self.decode_compile_s += seconds
        else:
            self.steady_tokens += tokens
            self.steady_s += seconds

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / drafted, None without speculation."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens after the first one per second of decoding, compilation included."""
        return (self.generated_tokens - 1) / self.decode_s if self.decode_s > 0 and self.generated_tokens > 1 else 0.0

    @property
    def steady_tokens_per_s(self) -> float | None:
        """Tokens per second over the decode steps that compiled nothing (None: no such step)."""
        return self.steady_tokens / self.steady_s if self.steady_s > 0 else None

    @property
    def tokens_per_step(self) -> float:
        """Generated tokens per model step (prefill counts as one) per sequence of the batch."""
        return self.generated_tokens / max(self.decode_steps + 1, 1) / max(self.batch, 1)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(acceptance_rate=self.acceptance_rate, tokens_per_s=self.tokens_per_s,
                 steady_tokens_per_s=self.steady_tokens_per_s, tokens_per_step=self.tokens_per_step)
        return d

    def summary(self) -> str:
        """One human line (the engine is not repeated: it is printed when it is built)."""
        rate = self.steady_tokens_per_s
        steady = (f"{self.tokens_per_s:.1f} tok/s with compilation (no steady state: every decode step compiled)"
                  if rate is None else f"{rate:.1f} tok/s steady state")
        parts = [f"prompt {self.prompt_tokens} tok, prefill {self.prefill_s:.2f}s "
                 f"(compiled in {self.prefill_compile_s:.2f}s)",
                 f"TTFT {self.ttft_s:.2f}s",
                 f"generated {self.generated_tokens} tok in {self.decode_s:.2f}s"
                 + (f" (device loops of {self.decode_loop} steps)" if self.decode_loop > 1 else "")
                 + f": decode {steady} "
                 f"(excl. {self.decode_compile_s:.2f}s compile in {self.compile_steps} of {self.decode_steps} steps)"]
        if self.speculative:
            acc = self.acceptance_rate
            parts.append(f"speculative {self.speculative}: accepted {self.accepted}/{self.drafted} drafts "
                         f"({'n/a' if acc is None else f'{100 * acc:.1f}%'}), "
                         f"{self.tokens_per_step:.2f} tok/step")
        return " | ".join(parts)


def combine_stats(stats) -> GenerationStats:
    """Totals over several ``generate`` calls run one after the other (times and counts add up;
    ``batch`` is the largest batch; ``engine``, ``speculative`` and ``ttft_s`` those of the first). Raises
    ValueError for an empty list."""
    stats = list(stats)
    if not stats:
        raise ValueError("no statistics to combine")
    out = dataclasses.replace(stats[0])
    for s in stats[1:]:
        for f in dataclasses.fields(GenerationStats):
            v = getattr(s, f.name)
            if f.name in ("batch", "decode_loop"):
                setattr(out, f.name, max(getattr(out, f.name), v))
            elif isinstance(v, (int, float)) and not isinstance(v, bool) and f.name != "ttft_s":
                setattr(out, f.name, getattr(out, f.name) + v)
    return out
