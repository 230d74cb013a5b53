"""Sampling settings and the per-row, seeded token choice used by the generation loop.

Plain decoding draws with ``minimax_jax.sampling.sample`` and one PRNG key per (row, step):
``fold_in(fold_in(key(seed), row), step)``, so a row's tokens depend only on its seed, its index
and its own history (not on which other rows are in the batch). Speculative decoding needs the
filtered target/draft distributions as probabilities (``probs``); the generation loop draws from a
per-row ``numpy`` generator seeded by ``(seed, row id)``. Penalties (``minimax_jax.infer.penalties``) are
applied to the logits by the generation loop before ``choose``; ``token_logprobs`` reports the model's
own log-probabilities of the chosen tokens.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from minimax_jax.sampling import filter_logits, greedy, sample

__all__ = ["SamplingParams", "RowSampler", "token_logprobs"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """``temperature`` 0 = greedy (argmax, lowest id on ties); ``top_k`` 0 = off; ``top_p`` 1 = off;
    ``min_p`` 0 = off; ``seed`` makes sampled runs reproducible; ``repetition_penalty`` (> 0, 1 = off),
    ``presence_penalty`` / ``frequency_penalty`` (in [-2, 2], 0 = off): ``minimax_jax.infer.penalties``.
    Raises ValueError when out of range."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def penalties(self) -> dict:
        return dict(repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                    frequency_penalty=self.frequency_penalty)

    def filters(self) -> dict:
        return dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p)


class RowSampler:
    """Token choice for a batch whose rows are identified by stable ids (their prompt index)."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self._base = jax.random.key(params.seed)
        filters = params.filters()
        self._probs = jax.jit(lambda x: jax.nn.softmax(filter_logits(x, **filters), axis=-1))

    def choose(self, logits: np.ndarray, rows, steps) -> np.ndarray:
        """One token per row from ``logits [n, V]``; ``steps[i]`` = tokens row ``rows[i]`` has drawn."""
        if self.params.greedy:
            return np.asarray(greedy(logits))
        keys = jnp.stack([jax.random.fold_in(jax.random.fold_in(self._base, r), s) for r, s in zip(rows, steps)])
        return np.asarray(sample(logits, keys, **self.params.filters()))

    def probs(self, logits: np.ndarray) -> np.ndarray:
        """Filtered sampling distribution(s) ``[..., V]`` float64 (what ``sample`` draws from)."""
        x = np.asarray(logits, np.float32)
        flat = x.reshape(-1, x.shape[-1])
        f = np.asarray(self._probs(flat), np.float64)
        return f.reshape(x.shape)



def token_logprobs(logits, tokens) -> np.ndarray:
    """``log_softmax(logits)[i, tokens[i]]`` float64 ``[n]`` from ``logits [n, V]`` (the raw model
    distribution: before penalties, temperature and filters)."""
    x = np.asarray(logits, np.float64)
    m = x.max(axis=-1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(x - m).sum(axis=-1))
    return x[np.arange(len(x)), np.asarray(tokens, np.int64)] - lse
