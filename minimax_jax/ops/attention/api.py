"""Dense (and sliding-window) GQA attention op with an ``implementation=`` choice.

Masking is defined by positions and segment ids (docs/ARCHITECTURE.md): key j is visible to
query i iff ``kv_seg[j] == q_seg[i]``, ``kv_seg[j] >= 0``, ``kv_pos[j] <= q_pos[i]`` and, with a
window W, ``q_pos[i] - kv_pos[j] < W``. Prefix-tree rows (``minimax_jax.data.prefix_tree``) add
``kv_subtree_end`` ``[B, S]``: key slot j is visible only to query slots ``j <= i < kv_subtree_end[j]``
(self-attention, T == S; positions are those of each token in its own trajectory). Tree visibility is
served by ``"xla"`` and ``"pallas_tree_gpu"`` (below); every other implementation refuses it. Scale
``1/sqrt(D)``; softmax in float32.

Implementations (registered under the op ``"attention"`` of ``minimax_jax.ops.registry``):
- ``"xla"``: reference in plain JAX, queries processed in chunks so memory is O(chunk * S) (xla.py).
- ``"xla_banded"``: sliding-window self-attention in plain JAX that computes only the band: query
  chunk ``[c, c + C)`` attends to the key slice ``[c - W, c + C)`` (memory and FLOPs O(T * (C + W))
  instead of O(T * S)). Needs a window, T == S, ONE positions array for queries and keys (the same
  object) whose values increase by at least 1 per storage step inside each segment (packed training
  rows, whole-sequence forward), so that every key within W positions of a query lies within W
  storage slots of it; the visibility mask is still applied exactly inside the slice.
- ``"cudnn"``: ``jax.nn.dot_product_attention(implementation="cudnn")`` (GPU only; only for the
  plain causal case T == S with default positions, no segments) (cudnn.py).
- ``"cudnn_packed"``: cuDNN's fused flash attention in its packed (ragged) layout for packed causal
  self-attention with segment ids (cudnn.py; GPU, Hopper or newer, bf16/fp16). The same contract as
  the flash kernels (below); a call with a row of more segment runs than the largest of
  ``cudnn.DEFAULT_MAX_SEGMENTS`` runs the GPU flash kernel instead and prints so.
- ``"pallas_flash_gpu"`` / ``"pallas_flash_tpu"``: flash attention with O(T) memory in forward AND
  backward for packed causal self-attention (flash.py): JAX's Pallas Triton ``mha`` on GPU, the
  Pallas TPU ``flash_attention`` on TPU. Self-attention only (T == S, the same positions /
  segment-id arrays for queries and keys, positions strictly increasing inside each segment), no
  sliding window.
- ``"pallas_flash_gpu_interpret"`` / ``"pallas_flash_tpu_interpret"``: the same kernels in Pallas
  interpret mode (any backend; CPU tests).
- ``"pallas_tree_gpu"`` (``"pallas_tree_gpu_interpret"``): prefix-tree rows only (``kv_subtree_end``),
  our Triton-lowered kernel that walks only the key tiles a query's trajectory reaches, forward and
  backward (tree.py); no sliding window.
- ``"pallas_masked_gpu"`` (``"pallas_masked_gpu_interpret"``): the same kernels without a tree, for any
  queries against any keys (T != S allowed, e.g. a context-parallel shard's local queries against the
  gathered keys), walking only the key tiles that segments and positions allow; forward and backward; no
  sliding window, no tree.
- ``"auto"``: on GPU, ``"cudnn"`` for plain causal self-attention (T == S, no segment ids, no
  window) and, for packed self-attention (segment ids; one positions array and one segment-id array
  for queries and keys) that the flash kernels accept, ``"cudnn_packed"`` where cuDNN's packed
  layout runs (Hopper or newer, bf16/fp16) and ``"pallas_flash_gpu"`` otherwise (see BENCHMARKS.md);
  ``"xla_banded"`` for a sliding window when its conditions hold; else ``"xla"``. Queries against a
  different key count (T != S) on GPU: ``"pallas_masked_gpu"``, else ``"xla"``. On TPU ``"auto"``
  does not pick the flash kernel. Prefix-tree rows: ``"pallas_tree_gpu"`` on GPU where it serves the
  call, else ``"xla"``. Sliding-window layers of the model use
  ``ModelConfig.sliding_attention_impl`` (no flash kernel here has a window).
What ran is recorded under ``"attention"`` (``registry.implementation_report``).
"""

from __future__ import annotations

import jax

from minimax_jax.ops import registry
from minimax_jax.ops.attention import cudnn, flash, tree, xla
from minimax_jax.ops.registry import Implementation

__all__ = ["IMPLEMENTATIONS", "attention"]


def _auto(backend, q, k, v, *, q_segment_ids, kv_segment_ids, sliding_window, kv_subtree_end=None, **_):
    """The ``"auto"`` preference list (module docstring); each candidate's ``supports`` decides."""
    if kv_subtree_end is not None:
        return ("pallas_tree_gpu", "xla") if backend == "gpu" else ("xla",)
    segments = q_segment_ids is not None or kv_segment_ids is not None
    names = []
    if backend == "gpu" and q.shape[1] != k.shape[1]:
        names.append("pallas_masked_gpu")      # local queries against other keys (context parallelism)
    elif backend == "gpu":
        names += ["cudnn_packed", "pallas_flash_gpu"] if segments else ["cudnn"]
    if sliding_window is not None:
        names.append("xla_banded")
    return (*names, "xla")


def _no_tree(check):
    """``check`` that also refuses prefix-tree visibility (``kv_subtree_end``)."""
    def supports(*args, kv_subtree_end=None, **kw):
        if kv_subtree_end is not None:
            return "prefix-tree visibility (kv_subtree_end) is served only by 'xla' and 'pallas_tree_gpu'"
        return check(*args, **kw)
    return supports


registry.register("attention", [
    Implementation("xla", xla.xla),
    Implementation("xla_banded", xla.xla_banded, supports=_no_tree(xla.banded_unsupported)),
    Implementation("cudnn", cudnn.cudnn, platforms=("gpu",), supports=_no_tree(cudnn.cudnn_unsupported)),
    Implementation("cudnn_packed", cudnn.cudnn_packed, platforms=("gpu",),
                   supports=_no_tree(cudnn.cudnn_packed_unsupported)),
    *(Implementation(f"pallas_flash_{b}", flash.run(b), platforms=None if b.endswith("_interpret") else (b,),
                     supports=_no_tree(flash.supports(b))) for b in flash.BACKENDS),
    Implementation("pallas_tree_gpu", tree.run(False), platforms=("gpu",), supports=tree.supports),
    Implementation("pallas_tree_gpu_interpret", tree.run(True), supports=tree.supports),
    Implementation("pallas_masked_gpu", tree.run_masked(False), platforms=("gpu",), supports=tree.masked_supports),
    Implementation("pallas_masked_gpu_interpret", tree.run_masked(True), supports=tree.masked_supports),
], auto=_auto)

#: Every ``implementation=`` name, ``"auto"`` first.
IMPLEMENTATIONS = registry.implementation_names("attention")


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
    kv_subtree_end: jax.Array | None = None,
) -> jax.Array:
    """Causal GQA attention.

    Args:
      q: ``[B, T, H, D]``; k, v: ``[B, S, G, D]`` with ``H % G == 0`` (head h uses kv head h // (H/G)).
      q_positions: ``[B, T]`` int32; kv_positions: ``[B, S]`` int32.
      q_segment_ids / kv_segment_ids: ``[B, T]`` / ``[B, S]`` int32 or None (all zero); -1 marks an
        empty key slot.
      sliding_window: None or window W in tokens (query included).
      implementation: one of ``IMPLEMENTATIONS`` (module docstring).
      chunk_size: query chunk of the XLA paths (memory O(chunk * S)).
      kv_subtree_end: ``[B, S]`` int32 or None: prefix-tree visibility (module docstring); needs T == S.
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
    if kv_subtree_end is not None and (t != s or kv_subtree_end.shape != (b, s)):
        raise ValueError(f"attention: kv_subtree_end {kv_subtree_end.shape} needs self-attention T == S and "
                         f"shape [B, S] = {(b, s)} (q {q.shape}, k {k.shape})")
    tree = {} if kv_subtree_end is None else {"kv_subtree_end": kv_subtree_end}
    # Segment ids go on as passed (None = one segment): the kernels' checks tell "not given" from given.
    return registry.dispatch("attention", implementation, q, k, v, q_positions=q_positions,
                             kv_positions=kv_positions, q_segment_ids=q_segment_ids,
                             kv_segment_ids=kv_segment_ids, sliding_window=sliding_window,
                             chunk_size=chunk_size, **tree)
