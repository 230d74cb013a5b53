"""Prefix-tree attention (``kv_subtree_end``) through our Pallas kernel ``pallas_kernels.tree.gpu_attention``,
and the same kernels without a tree for queries against other keys (``masked_supports`` / ``run_masked``).

Serves ``attention(implementation="pallas_tree_gpu[_interpret]")`` and, on GPU, ``"auto"`` for calls with
``kv_subtree_end``: self-attention (T == S), no sliding window, the kernel's shapes and dtypes. The kernel
applies the op's whole visibility rule per element (segments, positions, subtree ends), so no layout
precondition is assumed. Forward and backward (``custom_vjp``) keep O(T) residuals.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.tree.gpu_attention import masked_attention_gpu, tree_attention_gpu, unsupported_reason

__all__ = ["run", "supports", "run_masked", "masked_supports"]


def supports(q, k, v, *, sliding_window, kv_subtree_end=None, **_):
    """The op's ``supports`` check (module docstring): None, or the one-line reason."""
    if kv_subtree_end is None:
        return "the tree kernel serves prefix-tree rows only (kv_subtree_end)"
    if sliding_window is not None:
        return "the tree kernel has no sliding window"
    return unsupported_reason(q, k, v)


def run(interpret: bool):
    """The op's implementation function (after ``supports``)."""
    def fn(q, k, v, *, q_positions, kv_positions, q_segment_ids, kv_segment_ids, kv_subtree_end, **_):
        zeros = jnp.zeros(q.shape[:2], jnp.int32)
        return tree_attention_gpu(q, k, v, q_positions=q_positions, kv_positions=kv_positions,
                                  q_segment_ids=zeros if q_segment_ids is None else q_segment_ids,
                                  kv_segment_ids=zeros if kv_segment_ids is None else kv_segment_ids,
                                  subtree_end=kv_subtree_end, interpret=interpret)
    return fn


def masked_supports(q, k, v, *, sliding_window, kv_subtree_end=None, **_):
    """``"pallas_masked_gpu"``: any queries against any keys (T != S allowed: a context-parallel shard's
    local queries against the gathered keys), visibility by segments and positions; no tree, no window."""
    if kv_subtree_end is not None:
        return "prefix-tree rows go to 'pallas_tree_gpu'"
    if sliding_window is not None:
        return "the masked kernel has no sliding window"
    return unsupported_reason(q, k, v, self_attention=False)


def run_masked(interpret: bool):
    """The op's implementation function of ``"pallas_masked_gpu[_interpret]"`` (after ``masked_supports``)."""
    def fn(q, k, v, *, q_positions, kv_positions, q_segment_ids, kv_segment_ids, **_):
        return masked_attention_gpu(
            q, k, v, q_positions=q_positions, kv_positions=kv_positions,
            q_segment_ids=jnp.zeros(q.shape[:2], jnp.int32) if q_segment_ids is None else q_segment_ids,
            kv_segment_ids=jnp.zeros(k.shape[:2], jnp.int32) if kv_segment_ids is None else kv_segment_ids,
            interpret=interpret)
    return fn

