"""Generation statistics: time to first token, throughput, speculative acceptance."""

from __future__ import annotations

import dataclasses
import time

__all__ = ["GenerationStats", "Timer"]


class Timer:
    """Monotonic stopwatch started at construction."""

    def __init__(self):
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


@dataclasses.dataclass
class GenerationStats:
    """Filled by the generation loop.

    ``engine``: what ran (``Backend.describe()``); ``batch``: prompts; ``prompt_tokens`` / ``generated_tokens``: totals
    over the batch; ``prefill_s``: prefill wall time (includes compilation on a first run);
    ``ttft_s``: start of ``generate`` to the first sampled token; ``decode_s``: first token to the
    end; ``decode_steps``: model steps after prefill; ``drafted`` / ``accepted``: speculative drafts
    proposed / kept (0 / 0 without speculation).
    """

    engine: str = ""
    speculative: str | None = None
    batch: int = 1
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / drafted, None without speculation."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens after the first one, per second of decoding."""
        return (self.generated_tokens - 1) / self.decode_s if self.decode_s > 0 and self.generated_tokens > 1 else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Generated tokens per model step (prefill counts as one) per sequence of the batch."""
        return self.generated_tokens / max(self.decode_steps + 1, 1) / max(self.batch, 1)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(acceptance_rate=self.acceptance_rate, tokens_per_s=self.tokens_per_s,
                 tokens_per_step=self.tokens_per_step)
        return d

    def summary(self) -> str:
        """One human line."""
        parts = [f"engine: {self.engine}",
                 f"prompt {self.prompt_tokens} tok, prefill {self.prefill_s:.2f}s",
                 f"TTFT {self.ttft_s:.2f}s",
                 f"generated {self.generated_tokens} tok in {self.decode_s:.2f}s ({self.tokens_per_s:.1f} tok/s)"]
        if self.speculative:
            rate = self.acceptance_rate
            parts.append(f"speculative {self.speculative}: accepted {self.accepted}/{self.drafted} drafts "
                         f"({'n/a' if rate is None else f'{100 * rate:.1f}%'}), "
                         f"{self.tokens_per_step:.2f} tok/step")
        return " | ".join(parts)
