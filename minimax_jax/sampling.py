"""Next-token sampling in pure JAX: greedy, temperature, top-k, top-p (nucleus), min-p.

All functions take ``logits [B, V]`` (any float dtype; computed in float32) and per-row
parameters that are Python scalars or arrays ``[B]``; they are jit-compatible (no Python control
flow on array values) and reproducible: the same key and inputs give the same tokens.

Order of filters (the usual one, as in Hugging Face ``generate`` and vLLM):
temperature -> top-k -> top-p -> min-p, then a categorical draw.

* temperature ``t``: logits / t. ``t == 0`` selects greedy (argmax, lowest id on ties) for that
  row, ignoring the other filters; ``t < 0`` is refused when given as a Python number.
* top-k ``k``: keep tokens whose tempered logit is >= the k-th largest (ties at the boundary are
  kept, as in HF). ``k <= 0`` or ``k >= V`` disables it.
* top-p ``p``: over the top-k survivors sorted by probability, keep the smallest prefix whose
  mass reaches ``p`` (a token is kept iff the mass strictly before it is < p; the most likely
  token is always kept). ``p >= 1`` disables it. Ties at the boundary logit are kept.
* min-p ``m``: keep tokens with probability >= m * (largest probability), i.e. tempered logit
  >= max + log(m). ``m <= 0`` disables it.

Keys: one PRNG key (typed ``jax.random.key`` or raw uint32 ``[2]``) for the whole batch, or a
batch of keys (``[B]`` typed or ``[B, 2]`` raw) so that each row's draw depends only on its own
key (useful when requests move between batch slots).
Recommended MiniMax-M2 settings (MODEL_FACTS.md): temperature 1.0, top_p 0.95, top_k 40.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

__all__ = ["filter_logits", "greedy", "sample"]


def _check_scalar(name: str, value, lo: float | None = None, hi: float | None = None) -> None:
    if isinstance(value, numbers.Number) and not isinstance(value, bool):
        if value != value or (lo is not None and value < lo) or (hi is not None and value > hi):   # NaN first
            raise ValueError(f"{name}={value} is outside [{lo}, {hi}]")


def _per_row(value, batch: int, dtype, name: str) -> jax.Array:
    arr = jnp.asarray(value, dtype=dtype)
    if arr.ndim == 0:
        return jnp.broadcast_to(arr, (batch,))
    if arr.shape != (batch,):
        raise ValueError(f"{name} must be a scalar or have shape ({batch},), got {arr.shape}")
    return arr


def _check_logits(logits) -> jax.Array:
    logits = jnp.asarray(logits)
    if logits.ndim != 2:
        raise ValueError(f"logits must have shape [B, V], got {logits.shape}")
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    return logits.astype(jnp.float32)


def greedy(logits) -> jax.Array:
    """Argmax token per row. logits [B, V] float -> int32 [B] (lowest id on ties)."""
    return jnp.argmax(_check_logits(logits), axis=-1).astype(jnp.int32)


def filter_logits(logits, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> jax.Array:
    """Tempered logits with filtered-out tokens set to -inf.

    Args:
      logits: [B, V] float.
      temperature, top_k, top_p, min_p: scalars or [B] arrays (see module doc). Rows with
        temperature 0 are divided by 1 (``sample`` replaces them by greedy).
    Returns:
      float32 [B, V]: ``logits / t`` where kept, ``-inf`` elsewhere; at least one token per row
      is kept (the most likely one) when the row has a finite logit.
    Raises:
      ValueError: wrong shapes, or Python-scalar parameters out of range.
    """
    x, temp, k, p, m = _prepare(logits, temperature, top_k, top_p, min_p)
    return _filter(x, temp, k, p, m)


def _prepare(logits, temperature, top_k, top_p, min_p):
    """Validate; return x f32 [B,V] and per-row temp f32, k int32, p f32, m f32, each [B]."""
    _check_scalar("temperature", temperature, 0.0)
    _check_scalar("top_k", top_k, 0)
    _check_scalar("top_p", top_p, 0.0, 1.0)
    _check_scalar("min_p", min_p, 0.0, 1.0)
    x = _check_logits(logits)
    b = x.shape[0]
    return (x, _per_row(temperature, b, jnp.float32, "temperature"),
            _per_row(top_k, b, jnp.int32, "top_k"), _per_row(top_p, b, jnp.float32, "top_p"),
            _per_row(min_p, b, jnp.float32, "min_p"))


@jax.jit
def _filter(x, temp, k, p, m):
    v = x.shape[1]
    x = x / jnp.where(temp > 0, temp, 1.0)[:, None]
    s = -jnp.sort(-x, axis=-1)  # descending
    ranks = jnp.arange(v, dtype=jnp.int32)[None, :]
    k_eff = jnp.where((k <= 0) | (k >= v), v, k)[:, None]
    in_k = ranks < k_eff
    s_k = jnp.where(in_k, s, -jnp.inf)
    probs = jax.nn.softmax(s_k, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = in_k & ((mass_before < p[:, None]) | (p[:, None] >= 1.0) | (ranks == 0))
    last = jnp.sum(keep, axis=-1) - 1  # keep is a prefix of the sorted order
    threshold = jnp.take_along_axis(s, last[:, None], axis=-1)[:, 0]
    min_p_threshold = jnp.where(m > 0, s[:, 0] + jnp.log(jnp.maximum(m, 1e-38)), -jnp.inf)
    threshold = jnp.maximum(threshold, min_p_threshold)
    return jnp.where(x >= threshold[:, None], x, -jnp.inf)


def _draw(key, filtered: jax.Array) -> jax.Array:
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    batched = key.ndim == (1 if typed else 2)
    if not batched:
        if key.ndim != (0 if typed else 1):
            raise ValueError(f"key must be one PRNG key or a batch of {filtered.shape[0]} keys, "
                             f"got shape {key.shape}")
        return jax.random.categorical(key, filtered, axis=-1)
    if key.shape[0] != filtered.shape[0]:
        raise ValueError(f"got {key.shape[0]} keys for a batch of {filtered.shape[0]}")
    return jax.vmap(lambda kk, row: jax.random.categorical(kk, row))(key, filtered)


def sample(logits, key, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> jax.Array:
    """Draw one token per row.

    Args:
      logits: [B, V] float (computed in float32).
      key: one PRNG key, or [B] keys (typed) / [B, 2] uint32 (raw), one per row.
      temperature, top_k, top_p, min_p: scalars or [B] arrays; order and meaning in module doc.
    Returns:
      int32 [B] token ids; rows with temperature 0 get ``greedy(logits)``.
    Raises:
      ValueError: wrong shapes or out-of-range Python-scalar parameters.
    """
    x, temp, k, p, m = _prepare(logits, temperature, top_k, top_p, min_p)
    return _sample(x, key, temp, k, p, m)


@jax.jit
def _sample(x, key, temp, k, p, m):
    drawn = _draw(key, _filter(x, temp, k, p, m)).astype(jnp.int32)
    return jnp.where(temp > 0, drawn, jnp.argmax(x, axis=-1).astype(jnp.int32))
