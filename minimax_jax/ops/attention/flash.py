"""Flash attention for packed causal GQA self-attention through JAX's Pallas ops (O(T) memory).

Serves ``attention(implementation="pallas_flash_{gpu,tpu}[_interpret]")``. Forward and backward
keep only O(T) residuals (q, k, v, o and per-row softmax statistics), unlike the XLA chunked path,
whose ``lax.map`` over query chunks stores every chunk's probabilities under ``jax.grad``.

Kernels (called, not copied; both are plain JAX library code):

* GPU: ``jax.experimental.pallas.ops.gpu.attention.mha(q, k, v, segment_ids, sm_scale=, causal=,
  interpret=)`` -- Pallas Triton-lowered flash attention with its own ``custom_vjp`` (Triton
  backward). Layout ``[B, T, H, D]``, ONE segment-id array ``[B, T]`` shared by queries and keys, no
  GQA (k/v heads are repeated to H here), head dim padded to a power of two inside. Same signature
  in jax 0.10.2 and 0.11.x; 0.11 emits a DeprecationWarning on import (successor: tokamax), which
  is silenced here because the deprecation is known and documented.
* TPU: ``jax.experimental.pallas.ops.tpu.flash_attention.flash_attention(q, k, v,
  segment_ids=SegmentIds(q, kv), causal=True, sm_scale=)`` -- Mosaic kernel with ``custom_vjp``.
  Layout ``[B, H, T, D]``; sequence blocks of 128; head dim <= 128 or a multiple of 128. It has no
  ``interpret=`` argument: interpret mode is ``pltpu.force_tpu_interpret_mode`` (a trace-time
  context), so the interpreted variant wraps it in a ``custom_vjp`` that re-enters the context for
  the backward trace (re-running the forward there; test-only cost). The context is given ``True``
  (Pallas' generic interpreter, what ``pallas_call(interpret=True)`` runs) rather than
  ``pltpu.InterpretParams()``: the TPU-simulating interpreter uses ordered IO callbacks, which
  ``jax.checkpoint`` (the trainer's remat) rejects.

Masking. Both kernels mask by *storage index* (key index <= query index) and segment equality. The
op's contract masks by *position* (``kv_pos <= q_pos``, same segment, segment >= 0). The two agree
when (precondition, checked by ``unsupported_reason`` when the inputs are concrete, assumed
under ``jit``):
T == S, the query and key positions / segment ids are the same arrays, and inside every segment of
a row positions strictly increase with the storage index (packed rows whose documents restart at
position 0 satisfy this). Rows with a negative segment id (``-1`` empty slot, padding) see nothing
under the op's contract; the kernels let them see their own segment, so their output is zeroed
afterwards (so is their gradient). Every row with segment >= 0 sees at least
itself, so the kernels never divide by an empty softmax. T is padded to a multiple of
``BLOCK`` (=128) with segment -1 (padding rows come after every real query, so causality alone
already hides them). Sliding windows are not supported by either kernel.

Numerics: scale ``1/sqrt(D)``, float32 logits / softmax statistics / accumulators inside the
kernels, probabilities cast to the value dtype before the PV product (as in the XLA path), output
in ``q.dtype``.
"""

from __future__ import annotations

import functools
import inspect
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["BACKENDS", "BLOCK", "GPU_BLOCKS", "flash_attention", "layout_reason", "run", "supports",
           "unsupported_reason"]

#: "gpu" / "tpu": the compiled kernels; "*_interpret": the same kernels in Pallas interpret mode (CPU).
BACKENDS = ("gpu", "tpu", "gpu_interpret", "tpu_interpret")
#: Sequence padding multiple (the TPU kernel's minimum block; the GPU kernel's default block_q/k).
BLOCK = 128
_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _concrete(x):
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _same_reason(a, b, what: str) -> str | None:
    """None when ``a`` and ``b`` are the same array (identity, or equal when both are concrete)."""
    if a is b:
        return None
    ca, cb = (None, None) if a is None or b is None else (_concrete(a), _concrete(b))
    if ca is not None and cb is not None and ca.shape == cb.shape and np.array_equal(ca, cb):
        return None
    return (f"self-attention only: q_{what} and kv_{what} must be the same array "
            f"(identical object under jit, or equal concrete values)")


def layout_reason(positions, segment_ids) -> str | None:
    """Whether index-causal masking equals position-causal masking (module docstring), checked when
    the values are concrete (under ``jit`` the precondition is assumed, as documented).

    Args:
      positions: ``[B, T]`` int; segment_ids: ``[B, T]`` int or None (one segment).
    Returns: None when it holds or cannot be checked; else the reason, naming the first row/index
      where, inside one segment (>= 0), a position does not exceed the previous position of that segment.
    """
    pos = _concrete(positions)
    seg = np.zeros(pos.shape, np.int32) if segment_ids is None and pos is not None else _concrete(segment_ids)
    if pos is None or seg is None:
        return None
    for b in range(pos.shape[0]):
        idx = np.arange(pos.shape[1])
        order = np.lexsort((idx, seg[b]))          # by segment, then by storage index
        s, p = seg[b][order], pos[b][order]
        bad = (s[1:] == s[:-1]) & (s[1:] >= 0) & (p[1:] <= p[:-1])
        if np.any(bad):
            n = int(np.argmax(bad))
            return (f"positions of segment {int(s[n])} in row {b} do not increase with the storage index "
                    f"(index {int(order[n])}: {int(p[n])}, index {int(order[n + 1])}: {int(p[n + 1])}); "
                    f"index-causal kernels would mask differently")
    return None


def unsupported_reason(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                       sliding_window, backend: str) -> str | None:
    """Why the flash kernels of ``backend`` (one of ``BACKENDS``) cannot serve the call; None when they can.

    Shapes as in ``attention``: q ``[B,T,H,D]``, k/v ``[B,S,G,D]``. Checks: no window, T == S, shared
    positions / segment ids, same floating dtype for q/k/v, a head dim the kernel supports (GPU
    16..256; TPU <= 128 or a multiple of 128), and the layout precondition (``layout_reason``).
    """
    assert backend in BACKENDS, backend
    if sliding_window is not None:
        return "no sliding window (neither flash kernel supports one)"
    t, s, d = q.shape[1], k.shape[1], q.shape[3]
    if t != s:
        return f"self-attention only (T == S), got T={t}, S={s}"
    if not (q.dtype == k.dtype == v.dtype) or not any(q.dtype == x for x in _DTYPES):
        return f"needs q/k/v of one dtype in float32/bfloat16/float16, got {q.dtype}/{k.dtype}/{v.dtype}"
    if backend.startswith("gpu") and not 16 <= d <= 256:
        return f"the GPU mha kernel supports head_dim 16..256, got {d}"
    if backend.startswith("tpu") and d > 128 and d % 128:
        return f"the TPU kernel needs head_dim <= 128 or a multiple of 128, got {d}"
    return (_same_reason(q_positions, kv_positions, "positions")
            or _same_reason(q_segment_ids, kv_segment_ids, "segment_ids")
            or layout_reason(q_positions, q_segment_ids))


def supports(backend: str):
    """The op's ``supports`` check of the ``backend`` kernels (``unsupported_reason``, and for the GPU
    kernel that the installed jax has the ``mha`` API this module calls)."""
    def check(q, k, v, *, q_positions, kv_positions, q_segment_ids, kv_segment_ids, sliding_window, **_):
        return ((_mha_api_reason() if backend.startswith("gpu") else None)
                or unsupported_reason(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                                      sliding_window, backend))
    return check


def run(backend: str):
    """The op's implementation function on the ``backend`` kernels (after ``supports(backend)``)."""
    def fn(q, k, v, *, q_segment_ids, **_):
        seg = jnp.zeros(q.shape[:2], jnp.int32) if q_segment_ids is None else q_segment_ids
        return flash_attention(q, k, v, seg, backend=backend)
    return fn


#: GPU backward tiles ``(block_q_dkv, block_kv_dkv, block_q_dq, block_kv_dq, num_warps)`` used by default
#: for head dims <= 128 (larger heads keep JAX's ``mha`` defaults, 32 x 32 backward tiles, for shared
#: memory); chosen with bench/flash_blocks.py, see BENCHMARKS.md (flash_blocks).
GPU_BLOCKS: tuple[int, int, int, int, int] | None = (128, 128, 128, 128, 8)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                    backend: str, blocks: tuple[int, int, int, int, int] | None | str = "default") -> jax.Array:
    """Causal packed GQA flash attention (no checks: the caller checks ``unsupported_reason``).

    Args:
      q: ``[B, T, H, D]``; k, v: ``[B, T, G, D]`` (H % G == 0; head h uses kv head h // (H/G)).
      segment_ids: ``[B, T]`` int; equal ids attend to each other, negative ids see nothing.
      backend: one of ``BACKENDS``.
      blocks: GPU only: backward tiles ``(block_q_dkv, block_kv_dkv, block_q_dq, block_kv_dq,
        num_warps)`` (``block_q_dq`` must equal ``block_kv_dkv``; all divide 128), ``None`` for the
        library's defaults, ``"default"`` for ``GPU_BLOCKS``.
    Returns: ``[B, T, H, D]`` in ``q.dtype``; rows with a negative segment id are zero.
    Raises: ValueError for backward tiles the GPU kernel cannot use.
    """
    assert backend in BACKENDS, backend
    _, t, h, d = q.shape
    rep = h // k.shape[2]
    if rep > 1:   # the kernels have no GQA: give every query head its kv head (O(T) memory)
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    seg = segment_ids.astype(jnp.int32)
    tp = -(-t // BLOCK) * BLOCK
    if tp != t:
        widths = ((0, 0), (0, tp - t), (0, 0), (0, 0))
        q, k, v = jnp.pad(q, widths), jnp.pad(k, widths), jnp.pad(v, widths)
        seg = jnp.pad(seg, ((0, 0), (0, tp - t)), constant_values=-1)
    scale = 1.0 / math.sqrt(d)
    if backend.startswith("gpu"):
        if blocks == "default":
            blocks = GPU_BLOCKS if d <= 128 else None
        o = _gpu(q, k, v, seg, scale, backend == "gpu_interpret", blocks)
    elif backend == "tpu":
        o = _tpu(q, k, v, seg, scale)
    else:
        o = _tpu_interpret(q, k, v, seg, scale)
    # Zero the rows that see nothing (their kernel output is finite: they see their own segment).
    # A multiply by a [B, T, 1, 1] mask keeps only that mask as a residual (a where would keep a
    # [B, T, H, D] one).
    return o[:, :t] * (segment_ids >= 0).astype(o.dtype)[:, :, None, None]


def _gpu_attention_module():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import attention as gpu_attention
    return gpu_attention


@functools.cache
def _mha_api_reason() -> str | None:
    """None when the installed jax's GPU ``mha`` has the arguments this module passes, else why not."""
    need = ("segment_ids", "sm_scale", "causal", "interpret")
    params = inspect.signature(_gpu_attention_module().mha).parameters
    missing = [n for n in need if n not in params]
    if missing:
        return (f"jax {jax.__version__}: jax.experimental.pallas.ops.gpu.attention.mha lacks {missing} "
                f"(written against jax 0.10.2 / 0.11.x: mha(q, k, v, segment_ids, sm_scale, causal, ..., interpret))")
    return None


def _gpu(q, k, v, seg, scale, interpret, blocks=None):
    gpu_attention = _gpu_attention_module()
    mha = gpu_attention.mha
    if blocks is None:
        return mha(q, k, v, seg, sm_scale=scale, causal=True, interpret=interpret)
    q_dkv, kv_dkv, q_dq, kv_dq, warps = blocks
    if q_dq != kv_dkv or any(BLOCK % b for b in (q_dkv, kv_dkv, kv_dq)):
        raise ValueError(f"flash backward tiles {blocks}: need block_q_dq == block_kv_dkv and every tile "
                         f"dividing {BLOCK}")
    sizes = gpu_attention.BlockSizes(block_q=BLOCK, block_k=BLOCK, block_q_dkv=q_dkv, block_kv_dkv=kv_dkv,
                                     block_q_dq=q_dq, block_kv_dq=kv_dq)
    return mha(q, k, v, seg, sm_scale=scale, causal=True, block_sizes=sizes, num_warps=warps, interpret=interpret)


def _tpu_kernel(q, k, v, seg, scale):
    from jax.experimental.pallas.ops.tpu import flash_attention as tpu_fa
    qt, kt, vt = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    o = tpu_fa.flash_attention(qt, kt, vt, segment_ids=tpu_fa.SegmentIds(q=seg, kv=seg), causal=True,
                               sm_scale=scale)
    return o.transpose(0, 2, 1, 3)


def _tpu(q, k, v, seg, scale):
    return _tpu_kernel(q, k, v, seg, scale)


def _interpret_ctx():
    from jax.experimental.pallas import tpu as pltpu
    return pltpu.force_tpu_interpret_mode(True)   # generic interpreter (module docstring)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _tpu_interpret(q, k, v, seg, scale):
    with _interpret_ctx():
        return _tpu_kernel(q, k, v, seg, scale)


def _tpu_interpret_fwd(q, k, v, seg, scale):
    return _tpu_interpret(q, k, v, seg, scale), (q, k, v, seg)


def _tpu_interpret_bwd(scale, res, do):
    q, k, v, seg = res
    with _interpret_ctx():   # the kernel's backward pallas_calls are traced here, after the forward
        _, pull = jax.vjp(lambda q, k, v: _tpu_kernel(q, k, v, seg, scale), q, k, v)
        dq, dk, dv = pull(do)
    return dq, dk, dv, None


_tpu_interpret.defvjp(_tpu_interpret_fwd, _tpu_interpret_bwd)
