"""Held-out perplexity through a ``logprob_fn`` callable.

Contract of ``logprob_fn``: given ``tokens`` int32 ``[B, T]`` it returns float ``[B, T - 1]`` with
``out[b, t] = log p(tokens[b, t + 1] | tokens[b, : t + 1])`` (natural log).

Texts are tokenised (each document prefixed with bos when given), concatenated into one stream and
cut into windows of ``seq_len + 1`` tokens that overlap by one token, so every token after the first
is scored exactly once, each with up to ``seq_len`` tokens of context. The last window may be
shorter; windows are batched by equal length.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

LogprobFn = Callable[[np.ndarray], np.ndarray]


def token_stream(texts: Sequence[str], tokenizer, bos_id: int | None = None,
                 max_tokens: int | None = None) -> np.ndarray:
    """int32 stream of all texts' ids (each preceded by ``bos_id`` when given), capped at max_tokens."""
    ids: list[int] = []
    for t in texts:
        if bos_id is not None:
            ids.append(bos_id)
        ids.extend(tokenizer.encode(t, add_special_tokens=False).ids)
        if max_tokens is not None and len(ids) >= max_tokens:
            break
    if max_tokens is not None:
        ids = ids[:max_tokens]
    return np.asarray(ids, dtype=np.int32)


def position_buckets(seq_len: int, first: int = 1024) -> list[int]:
    """Default bucket edges of ``stream_perplexity``'s ``by_position``: 0, then powers of two from ``first``
    below ``seq_len``, then ``seq_len`` (e.g. 0, 1024, 2048, 4096, 8192 for 8K windows)."""
    edges, e = [0], first
    while e < seq_len:
        edges.append(e)
        e *= 2
    return edges + [seq_len]


def stream_perplexity(logprob_fn: LogprobFn, stream: np.ndarray, seq_len: int, batch_size: int = 1,
                      tokenizer=None, buckets: Sequence[int] | None = None) -> dict:
    """Perplexity of ``stream`` (int32 [N]) under ``logprob_fn`` (see module docstring).

    ``buckets``: increasing edges ``[e0 = 0, e1, ..., en = seq_len]`` of the position of a scored token
    in its window (= its context length - 1; default ``position_buckets(seq_len)``).
    Returns:
      ``{"nll": mean negative log-likelihood per scored token (nats), "perplexity": exp(nll),
      "tokens": scored tokens, "by_position": [{"lo", "hi", "tokens", "nll", "perplexity"}] per bucket
      [lo, hi) that scored any token, "bits_per_byte": when ``tokenizer`` is given, total nll in bits
      over the UTF-8 bytes of the decoded scored tokens (special tokens count 0 bytes), else absent}``.
    Raises:
      ValueError: stream shorter than 2 tokens, bad seq_len / batch_size / buckets, or a logprob_fn
        output of the wrong shape or with non-finite / positive values.
    """
    stream = np.asarray(stream)
    if stream.ndim != 1 or len(stream) < 2:
        raise ValueError(f"need a 1-D stream of at least 2 tokens, got shape {stream.shape}")
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
    edges = np.asarray(position_buckets(seq_len) if buckets is None else list(buckets), np.int64)
    if edges.ndim != 1 or len(edges) < 2 or edges[0] != 0 or edges[-1] != seq_len or np.any(np.diff(edges) <= 0):
        raise ValueError(f"position buckets must increase from 0 to seq_len={seq_len}, got {edges.tolist()}")
    b_nll = np.zeros(len(edges) - 1)
    b_count = np.zeros(len(edges) - 1, np.int64)
    windows = [stream[s : s + seq_len + 1] for s in range(0, len(stream) - 1, seq_len)]
    total, count, nbytes = 0.0, 0, 0
    by_len: dict[int, list[np.ndarray]] = {}
    for w in windows:
        by_len.setdefault(len(w), []).append(w)
    for length, group in sorted(by_len.items()):
        for i in range(0, len(group), batch_size):
            batch = np.stack(group[i : i + batch_size]).astype(np.int32)
            lp = np.asarray(logprob_fn(batch), dtype=np.float64)
            if lp.shape != (batch.shape[0], length - 1):
                raise ValueError(
                    f"logprob_fn returned shape {lp.shape} for tokens {batch.shape}; expected "
                    f"{(batch.shape[0], length - 1)}"
                )
            if not np.all(np.isfinite(lp)) or np.any(lp > 1e-6):
                raise ValueError("logprob_fn returned non-finite or positive log-probabilities")
            total -= float(lp.sum())
            count += lp.size
            which = np.searchsorted(edges, np.arange(length - 1), side="right") - 1   # bucket of each position
            np.add.at(b_nll, which, -lp.sum(axis=0))
            np.add.at(b_count, which, lp.shape[0])
            if tokenizer is not None:
                for row in batch:
                    nbytes += len(tokenizer.decode(row[1:].tolist()).encode("utf-8"))
    nll = total / count
    by_position = [{"lo": int(edges[i]), "hi": int(edges[i + 1]), "tokens": int(b_count[i]),
                    "nll": float(b_nll[i] / b_count[i]), "perplexity": math.exp(b_nll[i] / b_count[i])}
                   for i in range(len(b_count)) if b_count[i]]
    out = {"nll": nll, "perplexity": math.exp(nll), "tokens": count, "by_position": by_position}
    if tokenizer is not None:
        out["bytes"] = nbytes
        out["bits_per_byte"] = total / math.log(2) / max(nbytes, 1)
    return out


def heldout_perplexity(logprob_fn: LogprobFn, texts: Sequence[str], tokenizer, *, seq_len: int,
                       batch_size: int = 1, max_tokens: int | None = None,
                       bos_id: int | None = None, buckets: Sequence[int] | None = None) -> dict:
    """Perplexity of held-out ``texts`` tokenised by ``tokenizer``; see :func:`stream_perplexity`."""
    stream = token_stream(texts, tokenizer, bos_id=bos_id, max_tokens=max_tokens)
    return stream_perplexity(logprob_fn, stream, seq_len, batch_size, tokenizer=tokenizer, buckets=buckets)
