"""Prefill attention over a gathered key view: the queries are a causal suffix of the keys (op "prefill_attention").

A prefill chunk's ``T`` queries sit at ``q_positions`` of a contiguous key view ``k, v [B, S, G, D]``
(``minimax_jax.decode.cache.gather_pages``: key ``j`` of the view is absolute position ``j``); query
``i`` sees the keys ``j <= q_positions[b, i]`` (and ``q_pos - j < W`` with a window W); a padding
row (position ``-1``) sees nothing and returns zeros. Scale ``1/sqrt(D)``, float32 softmax.

Implementations (``minimax_jax.ops.registry``; what ran is recorded under ``"prefill_attention"``):
- ``"xla"``: ``minimax_jax.ops.attention`` with ``implementation="xla"`` (the chunked reference,
  memory O(512 x S)); every platform.
- ``"pallas_gpu"`` / ``"pallas_gpu_interpret"``: the suffix-attention kernel
  (``pallas_kernels.prefill.gpu_attention``; compiled on GPU / Pallas interpret mode anywhere),
  whose programs walk only the keys their rows can see; ``supports`` = its ``unsupported_reason``
  (no sliding window, a head dim that is a power of two in [16, 256], one float dtype).
- ``"auto"``: that kernel on a GPU backend when it serves the call, else ``"xla"`` (the reason
  under ``"prefill_attention.auto_reason"``); ``"xla"`` on other backends.
Other names (e.g. the MSA-only ``"pallas_tpu"``) raise ImplementationUnavailable.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from minimax_jax.ops import registry
from minimax_jax.ops.attention import attention
from minimax_jax.ops.registry import Implementation
from pallas_kernels.prefill.gpu_attention import suffix_attention_gpu, unsupported_reason

__all__ = ["prefill_attention", "IMPLEMENTATIONS"]


def prefill_attention(q, k, v, q_positions, *, sliding_window: int | None = None,
                      implementation: str = "auto") -> jax.Array:
    """Causal GQA attention of queries at ``q_positions`` over a contiguous key view (module docstring).

    Args:
      q: ``[B, T, H, D]``; k, v: ``[B, S, G, D]`` (head h uses kv head ``h // (H / G)``).
      q_positions: ``[B, T]`` int, ``-1`` = padding row; valid positions ``< S``.
      sliding_window: None or the layer's window in tokens (query included).
      implementation: module docstring.
    Returns: ``[B, T, H, D]`` in ``q.dtype``.
    Raises: ValueError for bad shapes; ImplementationUnavailable.
    """
    op = "prefill_attention"
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"{op}: q must be [B,T,H,D] and k, v [B,S,G,D]; got {q.shape}, {k.shape}, {v.shape}")
    b, t, h, d = q.shape
    if k.shape[0] != b or k.shape[3] != d or h % k.shape[2]:
        raise ValueError(f"{op}: k {k.shape} does not fit q {q.shape} (B and D equal, H % G == 0)")
    if tuple(q_positions.shape) != (b, t):
        raise ValueError(f"{op}: q_positions must be [B={b}, T={t}], got {q_positions.shape}")
    return registry.dispatch(op, implementation, q, k, v, q_positions.astype(jnp.int32),
                             sliding_window=sliding_window)


def _xla(q, k, v, q_positions, *, sliding_window):
    b, s = k.shape[:2]
    return attention(q, k, v, q_positions=jnp.maximum(q_positions, 0),
                     kv_positions=jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)),
                     q_segment_ids=jnp.where(q_positions >= 0, 0, 1).astype(jnp.int32),   # padding sees nothing
                     kv_segment_ids=jnp.zeros((b, s), jnp.int32), sliding_window=sliding_window,
                     implementation="xla")


def _kernel(q, k, v, q_positions, *, sliding_window, interpret):
    return suffix_attention_gpu(q, k, v, q_positions, interpret=interpret)


def _supports(q, k, v, q_positions, *, sliding_window):
    return unsupported_reason(q, k, v, sliding_window)


registry.register("prefill_attention", [
    Implementation("xla", _xla),
    Implementation("pallas_gpu", functools.partial(_kernel, interpret=False), ("gpu",), _supports),
    Implementation("pallas_gpu_interpret", functools.partial(_kernel, interpret=True), None, _supports),
], auto=lambda backend, *args, **kwargs: ("pallas_gpu", "xla") if backend == "gpu" else ("xla",))

#: Every ``implementation=`` name of ``prefill_attention`` (``"auto"`` first).
IMPLEMENTATIONS = registry.implementation_names("prefill_attention")
