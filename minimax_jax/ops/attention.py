"""Dense (and sliding-window) GQA attention op with an ``implementation=`` choice.

Masking is defined by positions and segment ids (docs/ARCHITECTURE.md): key j is visible to
query i iff ``kv_seg[j] == q_seg[i]``, ``kv_seg[j] >= 0``, ``kv_pos[j] <= q_pos[i]`` and, with a
window W, ``q_pos[i] - kv_pos[j] < W``. Scale ``1/sqrt(D)``; softmax in float32.

Implementations:
- ``"xla"``: reference in plain JAX, queries processed in chunks so memory is O(chunk * S).
- ``"cudnn"``: ``jax.nn.dot_product_attention(implementation="cudnn")`` (GPU only; only for the
  plain causal case T == S with default positions, no segments; raises otherwise).
- ``"cudnn_packed"``: cuDNN's fused flash attention in its packed (ragged) layout for packed causal
  self-attention with segment ids (minimax_jax/ops/cudnn_packed.py; GPU, Hopper or newer, bf16/fp16).
  The same contract as ``"pallas_flash"`` (below); a call with a row of more segment runs than the
  largest of ``cudnn_packed.DEFAULT_MAX_SEGMENTS`` runs the flash kernel instead and prints so.
- ``"pallas_flash"``: flash attention with O(T) memory in forward AND backward for packed causal
  self-attention (minimax_jax/ops/flash.py): JAX's Pallas Triton ``mha`` on GPU, the Pallas TPU
  ``flash_attention`` on TPU. Self-attention only (T == S, the same positions / segment-id arrays
  for queries and keys, positions strictly increasing inside each segment), no sliding window;
  raises ImplementationUnavailable otherwise. Recorded as ``"pallas_flash_gpu"`` / ``"_tpu"``.
- ``"pallas_flash_gpu_interpret"`` / ``"pallas_flash_tpu_interpret"``: the same kernels in Pallas
  interpret mode (CPU tests).
- ``"xla_banded"``: sliding-window self-attention in plain JAX that computes only the band: query
  chunk ``[c, c + C)`` attends to the key slice ``[c - W, c + C)`` (memory and FLOPs O(T * (C + W))
  instead of O(T * S)). Needs a window, T == S, ONE positions array for queries and keys (the same
  object) whose values increase by at least 1 per storage step inside each segment (packed training
  rows, whole-sequence forward), so that every key within W positions of a query lies within W
  storage slots of it; the visibility mask is still applied exactly inside the slice.
- ``"auto"``: on GPU, ``"cudnn"`` for plain causal self-attention (T == S, no segment ids, no
  window) and, for packed self-attention (segment ids; one positions array and one segment-id array
  for queries and keys) when ``flash.check_applicable`` accepts the call, ``"cudnn_packed"`` where
  cuDNN's packed layout runs (Hopper or newer, bf16/fp16; validated on the H200 on 2026-12-02:
  compiled kernels vs XLA outputs and gradients, 8K training steps 2x faster attention than the flash
  kernel) and ``"pallas_flash"`` otherwise (validated on the H200 on 2026-11-30);
  ``"xla_banded"`` for a sliding window when its conditions hold; else ``"xla"``. The choice is
  recorded. On TPU ``"auto"`` does not pick the flash kernel (not yet run on TPU hardware).
  Sliding-window layers of the model use ``ModelConfig.sliding_attention_impl`` (no flash kernel here
  has a window).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from minimax_jax.ops import cudnn_packed, flash
from minimax_jax.ops.common import ImplementationUnavailable, default_backend, record_implementation

__all__ = ["BACKENDS_OF", "IMPLEMENTATIONS", "attention", "visibility_mask"]

_NEG = -1e30
#: flash implementation name -> flash.py backend (None: the default backend's kernel).
_FLASH = {"pallas_flash": None, "pallas_flash_gpu_interpret": "gpu_interpret",
          "pallas_flash_tpu_interpret": "tpu_interpret"}
#: Every ``implementation=`` name (module docstring).
IMPLEMENTATIONS = ("auto", "xla", "xla_banded", "cudnn", "cudnn_packed", *_FLASH)
#: Implementations that run only on some backends (the others run anywhere): name -> backends.
BACKENDS_OF = {"cudnn": ("gpu",), "cudnn_packed": ("gpu",), "pallas_flash": ("gpu", "tpu")}


def visibility_mask(q_pos, kv_pos, q_seg, kv_seg, sliding_window=None):
    """Boolean mask ``[B, T, S]`` of visible (query, key) pairs (see module docstring)."""
    m = kv_pos[:, None, :] <= q_pos[:, :, None]
    m &= kv_seg[:, None, :] == q_seg[:, :, None]
    m &= kv_seg[:, None, :] >= 0
    if sliding_window is not None:
        m &= (q_pos[:, :, None] - kv_pos[:, None, :]) < sliding_window
    return m


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_positions: jax.Array,
    kv_positions: jax.Array,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    sliding_window: int | None = None,
    implementation: str = "xla",
    chunk_size: int = 512,
) -> jax.Array:
    """Causal GQA attention.

    Args:
      q: ``[B, T, H, D]``; k, v: ``[B, S, G, D]`` with ``H % G == 0`` (head h uses kv head h // (H/G)).
      q_positions: ``[B, T]`` int32; kv_positions: ``[B, S]`` int32.
      q_segment_ids / kv_segment_ids: ``[B, T]`` / ``[B, S]`` int32 or None (all zero); -1 marks an
        empty key slot.
      sliding_window: None or window W in tokens (query included).
      implementation: ``"xla" | "xla_banded" | "cudnn" | "cudnn_packed" | "pallas_flash" |
        "pallas_flash_gpu_interpret" | "pallas_flash_tpu_interpret" | "auto"`` (module docstring).
      chunk_size: query chunk of the XLA path (memory O(chunk * S)).
    Returns: ``[B, T, H, D]`` in ``q.dtype``. Rows with no visible key return zeros.
    Raises: ValueError on shape mismatch; ImplementationUnavailable when the requested
      implementation cannot serve the call (the message says why).
    """
    b, t, h, d = q.shape
    s, g = k.shape[1], k.shape[2]
    if k.shape != (b, s, g, d) or v.shape != k.shape:
        raise ValueError(f"attention: k {k.shape} / v {v.shape} do not match q {q.shape} as [B,S,G,D]")
    if h % g:
        raise ValueError(f"attention: {h} query heads not divisible by {g} kv heads")
    user_segments = None if q_segment_ids is None and kv_segment_ids is None else True
    seg_args = (q_segment_ids, kv_segment_ids)   # as passed (flash checks they are one array)
    if q_segment_ids is None:
        q_segment_ids = jnp.zeros((b, t), jnp.int32)
    if kv_segment_ids is None:
        kv_segment_ids = jnp.zeros((b, s), jnp.int32)
    impl = implementation
    if impl == "auto":
        plain = user_segments is None and t == s and sliding_window is None
        packed = user_segments is not None and t == s and sliding_window is None
        if default_backend() == "gpu" and plain:
            impl = "cudnn"
        elif default_backend() == "gpu" and packed and _flash_applies(q, k, v, q_positions, kv_positions, seg_args):
            impl = "cudnn_packed" if _cudnn_packed_applies(q) else "pallas_flash"
        elif sliding_window is not None and t == s and q_positions is kv_positions:
            impl = "xla_banded"
        else:
            impl = "xla"
    if impl in _FLASH:
        backend = _FLASH[impl] or {"gpu": "gpu", "tpu": "tpu"}.get(default_backend())
        if backend is None:
            raise ImplementationUnavailable(
                f"pallas_flash needs a GPU or TPU backend (got {default_backend()!r}); use "
                f"pallas_flash_gpu_interpret / pallas_flash_tpu_interpret on CPU")
        flash.check_applicable(q, k, v, q_positions, kv_positions, *seg_args, sliding_window, backend)
        record_implementation("attention", f"pallas_flash_{backend}")
        return flash.flash_attention(q, k, v, q_segment_ids, backend=backend)
    if impl == "cudnn_packed":
        flash.check_applicable(q, k, v, q_positions, kv_positions, *seg_args, sliding_window, "gpu")
        cudnn_packed.check_available(q)
        record_implementation("attention", "cudnn_packed")
        return cudnn_packed.packed_attention(q, k, v, q_segment_ids)
    if impl == "cudnn":
        # cuDNN's causal mask is by storage index: packed segments, T != S and windows are not expressible.
        if user_segments is not None or t != s or sliding_window is not None:
            raise ImplementationUnavailable(
                f"cudnn attention serves only plain causal self-attention (no segment ids, T == S, no window); got "
                f"segment ids: {user_segments is not None}, T={t}, S={s}, window={sliding_window}: use cudnn_packed, "
                f"pallas_flash or xla")
        if default_backend() != "gpu":
            raise ImplementationUnavailable("cudnn attention needs a GPU backend")
        record_implementation("attention", "cudnn")
        # cuDNN's causal mask assumes q_pos == kv_pos == arange(T); segments via seq lengths are not
        # expressible for packed rows, so we only take this path for T == S unpacked calls.
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    if impl == "xla_banded":
        if sliding_window is None or t != s or q_positions is not kv_positions:
            raise ImplementationUnavailable(
                "xla_banded needs a sliding window and self-attention with one positions array for queries and "
                f"keys (got window={sliding_window}, T={t}, S={s}, same positions: {q_positions is kv_positions})")
        record_implementation("attention", "xla_banded")
        return _xla_banded(q, k, v, q_positions, q_segment_ids, kv_segment_ids, int(sliding_window), chunk_size)
    if impl != "xla":
        raise ImplementationUnavailable(
            f"attention implementation {implementation!r} is not one of {'|'.join(IMPLEMENTATIONS)}")
    record_implementation("attention", "xla")
    return _xla_chunked(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, sliding_window,
                        chunk_size)


def _cudnn_packed_applies(q) -> bool:
    """Whether cuDNN's packed attention can run here (``cudnn_packed.check_available``), for ``"auto"``."""
    try:
        cudnn_packed.check_available(q)
    except ImplementationUnavailable:
        return False
    return True


def _flash_applies(q, k, v, q_positions, kv_positions, seg_args) -> bool:
    """Whether the GPU flash kernels accept this call (``flash.check_applicable``), for ``"auto"``."""
    try:
        flash.check_applicable(q, k, v, q_positions, kv_positions, *seg_args, None, "gpu")
    except ImplementationUnavailable:
        return False
    return True


def _attend(q, k, v, q_pos, kv_pos, q_seg, kv_seg, window):
    b, t, h, d = q.shape
    g = k.shape[2]
    qg = q.reshape(b, t, g, h // g, d)
    logits = jnp.einsum("btgjd,bsgd->bgjts", qg, k, preferred_element_type=jnp.float32)
    logits = logits * (1.0 / math.sqrt(d))
    mask = visibility_mask(q_pos, kv_pos, q_seg, kv_seg, window)[:, None, None]
    logits = jnp.where(mask, logits, _NEG)
    m = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(logits - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0, 1.0, denom)
    o = jnp.einsum("bgjts,bsgd->btgjd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(b, t, h, d).astype(q.dtype)


def _xla_chunked(q, k, v, q_pos, kv_pos, q_seg, kv_seg, window, chunk):
    b, t, h, d = q.shape
    if t <= chunk:
        return _attend(q, k, v, q_pos, kv_pos, q_seg, kv_seg, window)
    n = -(-t // chunk)
    pad = n * chunk - t
    qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    pp = jnp.pad(q_pos, ((0, 0), (0, pad)))
    sp = jnp.pad(q_seg, ((0, 0), (0, pad)), constant_values=-2)

    def one(args):
        qc, pc, sc = args
        return _attend(qc, k, v, pc, kv_pos, sc, kv_seg, window)

    qs = qp.reshape(b, n, chunk, h, d).transpose(1, 0, 2, 3, 4)
    ps = pp.reshape(b, n, chunk).transpose(1, 0, 2)
    ss = sp.reshape(b, n, chunk).transpose(1, 0, 2)
    out = jax.lax.map(one, (qs, ps, ss))
    return out.transpose(1, 0, 2, 3, 4).reshape(b, n * chunk, h, d)[:, :t]


def _xla_banded(q, k, v, pos, q_seg, kv_seg, window, chunk):
    """Sliding-window self-attention over the band only (module docstring, ``"xla_banded"``)."""
    b, t, h, d = q.shape
    c = min(chunk, t)
    n = -(-t // c)
    pad_t = n * c - t
    w = window                                  # keys [start - w, start + c) cover every visible one
    qp = jnp.pad(q, ((0, 0), (0, pad_t), (0, 0), (0, 0)))
    pq = jnp.pad(pos, ((0, 0), (0, pad_t)))
    sq = jnp.pad(q_seg, ((0, 0), (0, pad_t)), constant_values=-2)
    kp = jnp.pad(k, ((0, 0), (w, pad_t), (0, 0), (0, 0)))
    vp = jnp.pad(v, ((0, 0), (w, pad_t), (0, 0), (0, 0)))
    pk = jnp.pad(pos, ((0, 0), (w, pad_t)))
    sk = jnp.pad(kv_seg, ((0, 0), (w, pad_t)), constant_values=-1)   # padding keys are never visible

    def one(i):
        start = i * c                            # query start; key slice starts at start - w (+ w pad)
        sl = lambda x, size: jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)
        return _attend(sl(qp, c), sl(kp, c + w), sl(vp, c + w), sl(pq, c), sl(pk, c + w),
                       sl(sq, c), sl(sk, c + w), window)

    out = jax.lax.map(one, jnp.arange(n))       # [n, B, c, H, D]
    return out.transpose(1, 0, 2, 3, 4).reshape(b, n * c, h, d)[:, :t]
