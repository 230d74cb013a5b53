"""cuDNN fused attention: plain causal self-attention (``"cudnn"``) and packed causal GQA self-attention
with segment ids through cuDNN's ragged layout (``"cudnn_packed"``).

``"cudnn"``: ``jax.nn.dot_product_attention(implementation="cudnn")``. cuDNN's causal mask is by
storage index and assumes q_pos == kv_pos == arange(T): packed segments, T != S and windows are not
expressible, so it serves only the plain case (no segment ids, T == S, no window).

``"cudnn_packed"``: training rows pack
several documents; cuDNN's fused attention (flash forward and backward, Hopper+) serves them in its
"packed" (ragged, THD) layout: each row is cut into at most ``max_segments`` contiguous runs given by
their start offsets and lengths, and attention is causal inside each run and never crosses runs.

Why a private JAX API: ``jax.nn.dot_product_attention`` exposes only per-row sequence lengths, not
per-document offsets; the offsets are accepted by
``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention(..., q_seqlen, kv_seqlen, q_offsets,
kv_offsets, mask_type=PADDING_CAUSAL)`` (the function ``jax.nn.dot_product_attention`` itself calls).
Its packed path in jax <= 0.11.0 strides the key offsets by the QUERY head count (fixed upstream in
be78ee0f, "Fix cuDNN packed-attention kv_offsets for GQA/MQA"), so the k / v heads are repeated to H
here (a few MB per layer, negligible next to the attention) and the call is MHA on every version.

Contract (the same as the flash path, ``minimax_jax.ops.attention.flash``): self-attention (T == S), ONE
positions array and ONE segment-id array for queries and keys, positions strictly increasing inside
each segment, so that "causal by position inside a segment" equals "causal by storage index inside a
run". A run is a maximal stretch of equal segment ids. Rows with a negative segment id (padding) see
nothing under the op's contract; cuDNN lets their run attend to itself, so their output is zeroed
afterwards (their gradient too). The runs-per-row bound is static (cuDNN sizes its grid by it, and
time grows with it), so a few bounds are compiled and each call takes the smallest that holds its
most-packed row (``lax.switch``). A row with more runs than the largest bound cannot be expressed;
then the whole call runs the Pallas flash kernel instead and prints, from the device, which path
ran (``jax.debug.print``), or, with ``overflow="nan"``, returns NaN (training stops on a NaN loss
rather than learning from a wrong mask).

Numerics: scale ``1/sqrt(D)``, float32 softmax inside cuDNN, output in ``q.dtype`` (bf16/fp16 only).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from minimax_jax.ops import registry
from minimax_jax.ops.attention import flash
from pallas_kernels.common import gpu_compute_capability

__all__ = ["DEFAULT_MAX_SEGMENTS", "DEFAULT_OVERFLOW", "OVERFLOWS", "bucket_index", "cudnn", "cudnn_packed",
           "cudnn_packed_unsupported", "cudnn_unsupported", "packed_attention", "segment_runs",
           "unavailable_reason"]

#: Runs-per-row bounds ("buckets") of cuDNN's packed calls: cuDNN's grid covers B x bound sequences,
#: so a call uses the smallest bound that holds its most-packed row (see BENCHMARKS.md, flash_blocks).
DEFAULT_MAX_SEGMENTS = (2, 8, 32)
#: What a call whose most-packed row exceeds the largest bound does: "flash" (run the Pallas flash
#: kernel) or "nan" (return NaN, so the loss shows it). With one bound and "nan" the call has no XLA
#: conditional, whose predicate a GPU reads back to the host (a synchronisation per call).
DEFAULT_OVERFLOW = "flash"
OVERFLOWS = ("flash", "nan")


# ----------------------------------------------------------------------------- "cudnn"
def cudnn_unsupported(q, k, v, *, q_segment_ids, kv_segment_ids, sliding_window, **_) -> str | None:
    """Why ``"cudnn"`` cannot serve the call (module docstring); None when it can."""
    segments = not (q_segment_ids is None and kv_segment_ids is None)
    t, s = q.shape[1], k.shape[1]
    if segments or t != s or sliding_window is not None:
        return (f"serves only plain causal self-attention (no segment ids, T == S, no window); got segment ids: "
                f"{segments}, T={t}, S={s}, window={sliding_window}: use cudnn_packed, pallas_flash_gpu or xla")
    return None


def cudnn(q, k, v, **_):
    """``"cudnn"``: cuDNN's causal fused attention (after ``cudnn_unsupported``)."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


# ----------------------------------------------------------------------------- "cudnn_packed"
def _run_starts(segment_ids: jax.Array) -> jax.Array:
    """``[B, T]`` bool: where a run of equal segment ids starts."""
    first = jnp.ones(segment_ids.shape[:1] + (1,), bool)
    return jnp.concatenate([first, segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)


def segment_runs(segment_ids: jax.Array, max_segments: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Offsets and lengths of the contiguous runs of equal segment id in each row.

    Args:
      segment_ids: ``[B, T]`` int.
      max_segments: M, the number of runs per row reported (static).
    Returns: ``(seqlen [B, M], offsets [B, M + 1], count [B])`` int32 in the layout of cuDNN's packed
      attention (``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention``): ``offsets[b, i]``
      is the storage index where run i starts and ``seqlen[b, i]`` its length; unused entries are -1.
      ``count`` is the true number of runs, which may exceed M (then the rows' runs past M-1 are not
      described and the caller must not use cuDNN for that call).
    """
    if max_segments < 1:
        raise ValueError(f"max_segments must be >= 1, got {max_segments}")
    b, t = segment_ids.shape
    starts = _run_starts(segment_ids)
    count = starts.sum(axis=1, dtype=jnp.int32)
    # the storage index of the i-th run start, i < M (t where there is none)
    start_idx = jax.vmap(lambda s: jnp.nonzero(s, size=max_segments + 1, fill_value=t)[0])(starts)
    start_idx = start_idx.astype(jnp.int32)
    begin, end = start_idx[:, :max_segments], start_idx[:, 1:]
    valid = begin < t
    seqlen = jnp.where(valid, end - begin, -1)
    offsets = jnp.concatenate([jnp.where(valid, begin, -1), jnp.full((b, 1), -1, jnp.int32)], axis=1)
    return seqlen.astype(jnp.int32), offsets.astype(jnp.int32), count


def unavailable_reason(q: jax.Array) -> str | None:
    """Why cuDNN's packed attention cannot serve queries like ``q`` on this machine; None when it can.

    Args: q: ``[B, T, H, D]`` (only its dtype and D are read).
    Returns: a reason unless the backend (``registry.default_backend``) is GPU, a CUDA GPU of compute
      capability >= 9.0 (Hopper; cuDNN's packed layout needs it) is visible, q is bfloat16/float16 and D
      is a multiple of 8 up to 256 (cuDNN's fused-attention limits, per JAX's
      ``fused_attention_stablehlo.check_is_flash_attention``). Under ``registry.assume_backend("gpu")``
      without a GPU the reason says so: JAX's cuDNN attention reads the device when traced.
    """
    backend = registry.default_backend()
    if backend != "gpu":
        return f"cudnn_packed needs a CUDA GPU backend (got {backend!r})"
    cc = gpu_compute_capability()
    if cc is None:
        return ("cudnn_packed needs a CUDA GPU on this machine (the GPU backend is only assumed here; JAX's cuDNN "
                "attention reads the device's compute capability when traced)")
    if tuple(int(x) for x in str(cc).split(".")) < (9, 0):
        return f"cudnn_packed needs compute capability >= 9.0 (Hopper), got {cc}"
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"cudnn_packed needs bfloat16/float16 q/k/v, got {q.dtype}"
    d = q.shape[-1]
    if d % 8 or d > 256:
        return f"cudnn_packed needs a head dim that is a multiple of 8 up to 256, got {d}"
    return None


def cudnn_packed_unsupported(q, k, v, *, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                             sliding_window, **_) -> str | None:
    """Why ``"cudnn_packed"`` cannot serve the call: the flash contract (GPU), then ``unavailable_reason``."""
    return (flash.unsupported_reason(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                                     sliding_window, "gpu")
            or unavailable_reason(q))


def cudnn_packed(q, k, v, *, q_segment_ids, **_):
    """``"cudnn_packed"``: ``packed_attention`` with the op's defaults (after ``cudnn_packed_unsupported``)."""
    seg = jnp.zeros(q.shape[:2], jnp.int32) if q_segment_ids is None else q_segment_ids
    return packed_attention(q, k, v, seg)


def bucket_index(count: jax.Array, buckets: tuple[int, ...]) -> jax.Array:
    """Which bound serves a call: the index of the smallest of ``buckets`` (increasing ints) that is
    >= ``max(count)``, or ``len(buckets)`` when none is (the overflow branch).

    Args: count: int ``[B]`` runs per row (``segment_runs``' third output); buckets: static bounds.
    Returns: int32 scalar in ``[0, len(buckets)]`` (a ``lax.switch`` index).
    """
    worst = jnp.max(count)
    return sum((worst > m).astype(jnp.int32) for m in buckets)


def packed_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                     max_segments: int | tuple[int, ...] | None = None, overflow: str | None = None) -> jax.Array:
    """Causal GQA self-attention over packed rows with cuDNN's fused (flash) kernels.

    Args:
      q: ``[B, T, H, D]``; k, v: ``[B, T, G, D]`` (H % G == 0), bf16 or fp16.
      segment_ids: ``[B, T]`` int32, shared by queries and keys (module docstring: contract).
      max_segments: the runs per row cuDNN is given, static: one bound, or increasing bounds
        ("buckets", each >= 2) of which each call uses the smallest that holds its most-packed row
        (cuDNN's grid, and its time, grow with the bound). Default ``DEFAULT_MAX_SEGMENTS``.
      overflow: a call with a row of more runs than the largest bound runs the Pallas flash kernel
        and says so on the device's stdout (``"flash"``), or returns NaN everywhere (``"nan"``: no
        conditional when there is one bound). Default ``DEFAULT_OVERFLOW``.
    Returns: ``[B, T, H, D]`` in ``q.dtype``; rows with a negative segment id are zero.
    Raises: ValueError for bounds that are not increasing integers >= 2, an unknown ``overflow``, or
      when cuDNN's packed attention cannot run here (``unavailable_reason``).
    Source: FlashAttention-2 (Dao, 2023) as implemented by cuDNN's fused attention; the packed (THD)
    layout of ``jax._src.cudnn.fused_attention_stablehlo``.
    """
    max_segments = DEFAULT_MAX_SEGMENTS if max_segments is None else max_segments
    overflow = DEFAULT_OVERFLOW if overflow is None else overflow
    buckets = (max_segments,) if isinstance(max_segments, int) else tuple(max_segments)
    # a bound of 1 would take JAX's unpacked path, which ignores the offsets
    if not buckets or any(int(m) < 2 for m in buckets) or list(buckets) != sorted(set(buckets)):
        raise ValueError(f"max_segments must be increasing integers >= 2, got {max_segments!r}")
    if overflow not in OVERFLOWS:
        raise ValueError(f"overflow must be one of {OVERFLOWS}, got {overflow!r}")
    reason = unavailable_reason(q)
    if reason is not None:
        raise ValueError(reason)
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

    b, t, h, d = q.shape
    rep = h // k.shape[2]
    count = _run_starts(segment_ids).sum(axis=1, dtype=jnp.int32)      # runs per row

    def run_cudnn(m):
        def run(q, k, v):
            seqlen, offsets, _ = segment_runs(segment_ids, m)
            kk, vv = (jnp.repeat(x, rep, axis=2) if rep > 1 else x for x in (k, v))
            return dot_product_attention(q, kk, vv, None, None, seqlen, seqlen, offsets, offsets,
                                         scale=1.0 / math.sqrt(d), mask_type=MaskType.PADDING_CAUSAL,
                                         qkv_layout="BTNH")
        return run

    def fallback(q, k, v):
        jax.debug.print("cudnn_packed: a row has {n} runs of segment ids > max_segments=" + str(buckets[-1])
                        + "; this call ran pallas_flash_gpu", n=jnp.max(count))
        return flash.flash_attention(q, k, v, segment_ids, backend="gpu")

    def poison(q, k, v):
        return jnp.full(q.shape, jnp.nan, q.dtype)

    if overflow == "nan" and len(buckets) == 1:
        out = run_cudnn(buckets[0])(q, k, v)
        out = jnp.where(jnp.max(count) <= buckets[0], out, jnp.full((), jnp.nan, out.dtype))
    else:
        branches = [run_cudnn(m) for m in buckets] + [fallback if overflow == "flash" else poison]
        out = jax.lax.switch(bucket_index(count, buckets), branches, q, k, v)
    return jnp.where((segment_ids >= 0)[:, :, None, None], out, jnp.zeros((), out.dtype)).astype(q.dtype)
