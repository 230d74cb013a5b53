"""MSA block-sparse attention on GPU (Pallas, Triton lowering): the differentiable op.

Math (MSA_SPEC.md section 3): query head h of group r = h // (H/G) attends over the union of the
keys of its selected blocks (block_ids[b, r, i, :], -1 = unused slot), keeping only visible keys;
scale 1/sqrt(D); exact softmax with fp32 statistics. Outputs o [B,T,H,D] (q.dtype) and
lse [B,T,H] f32 (natural log; -inf for a query that sees no key, whose o is 0).

The forward is KV-outer (each selected K/V block loaded once for all the queries that chose it):
gpu_sparse_fwd.py (Triton) or gpu_sparse_fwd_wgmma.py (Hopper, Mosaic GPU; partial outputs merged by LSE), or
on Hopper query-tiled where neighbouring tokens' selections overlap (gpu_sparse_fwd_qtile.py, which also holds
the per-call choice between the two Hopper forwards, ``forward="hopper"``). The backward is KV-outer:
gpu_sparse_bwd.py (Triton) or gpu_sparse_bwd_wgmma.py (Hopper; dq partials summed over slots, dk / dv per
window). This module holds the ``custom_vjp``.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from pallas_kernels.msa import layout
from pallas_kernels.msa.gpu_sparse_bwd import sparse_bwd_kv_outer
from pallas_kernels.msa.gpu_sparse_bwd_wgmma import sparse_bwd_wgmma
from pallas_kernels.msa.gpu_sparse_fwd import sparse_fwd_kv_outer
from pallas_kernels.msa.gpu_sparse_fwd_qtile import sparse_fwd_hopper
from pallas_kernels.msa.gpu_sparse_fwd_wgmma import sparse_fwd_wgmma

__all__ = ["msa_attention_gpu", "FORWARDS", "BACKWARDS"]


FORWARDS = {"triton": sparse_fwd_kv_outer, "wgmma": sparse_fwd_wgmma, "hopper": sparse_fwd_hopper}
BACKWARDS = {"triton": sparse_bwd_kv_outer, "wgmma": sparse_bwd_wgmma}


def _fwd(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids, *,
         block_size, interpret, num_warps, num_stages, forward, backward):
    del num_warps, num_stages, backward          # the backward kernel's choice and launch parameters
    return FORWARDS[forward](q, k, v, block_ids, q_positions, kv_positions, q_segment_ids,
                             kv_segment_ids, block_size=block_size, interpret=interpret)


def _bwd(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids, o, lse,
         do, *, block_size, interpret, num_warps, num_stages, backward):
    return BACKWARDS[backward](q, k, v, block_ids, q_positions, kv_positions, q_segment_ids,
                               kv_segment_ids, o, lse, do, block_size=block_size, interpret=interpret,
                               num_warps=num_warps, num_stages=num_stages)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11, 12, 13))
def _attn(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
          block_size, interpret, num_warps, num_stages, forward, backward):
    return _fwd(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                block_size=block_size, interpret=interpret, num_warps=num_warps,
                num_stages=num_stages, forward=forward, backward=backward)


def _attn_fwd(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
              block_size, interpret, num_warps, num_stages, forward, backward):
    o, lse = _attn(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids,
                   kv_segment_ids, block_size, interpret, num_warps, num_stages, forward, backward)
    return (o, lse), (q, k, v, block_ids, q_positions, kv_positions, q_segment_ids,
                      kv_segment_ids, o, lse)


def _zero_cot(x):
    if x is None:
        return None
    return np.zeros(x.shape, jax.dtypes.float0)


def _attn_bwd(block_size, interpret, num_warps, num_stages, forward, backward, res, cot):
    del forward
    q, k, v, block_ids, q_positions, kv_positions, q_seg, kv_seg, o, lse = res
    do, _dlse = cot   # lse is an auxiliary output; its cotangent is not propagated (documented)
    dq, dk, dv = _bwd(q, k, v, block_ids, q_positions, kv_positions, q_seg, kv_seg, o, lse, do,
                      block_size=block_size, interpret=interpret, num_warps=num_warps,
                      num_stages=num_stages, backward=backward)
    return (dq, dk, dv, _zero_cot(block_ids), _zero_cot(q_positions), _zero_cot(kv_positions),
            _zero_cot(q_seg), _zero_cot(kv_seg))


_attn.defvjp(_attn_fwd, _attn_bwd)


def _pow2_tile(x: int) -> bool:
    """A Triton tile size: a power of two >= 16."""
    return x >= 16 and not x & (x - 1)


def msa_attention_gpu(q, k, v, block_ids, *, q_positions, kv_positions, q_segment_ids=None,
                      kv_segment_ids=None, block_size, interpret=False, num_warps=8,
                      num_stages=2, forward="triton", backward="triton"):
    """Block-sparse MSA attention, Pallas/Triton GPU kernels, differentiable in q, k, v.

    Args:
      q: [B,T,H,D] bf16/f32. k: [B,S,G,D], v: [B,S,G,Dv], same dtype. T <= S.
      block_ids: int [B,G,T,K], selected block ids per (group, query), -1 = unused slot, any order;
        duplicates count once. Block n of query i = keys of i's segment with n*B <= kv_pos < (n+1)*B.
      q_positions [B,T], kv_positions [B,S] int; segment ids [B,T]/[B,S] or None (both or neither);
        the storage layout of layout.py (a precondition, not checked here).
      block_size: B (power of two >= 16); D and Dv powers of two >= 16 (Triton tiles).
      interpret: run the same kernels in Pallas interpret mode (CPU tests).
      num_warps, num_stages: Triton launch parameters of the backward kernel (the forward has
        its own tuned launch).
      forward: "triton" (``gpu_sparse_fwd``, any CUDA GPU with Triton), "wgmma" (the Hopper KV-outer kernel of
        ``gpu_sparse_fwd_wgmma``: bf16 / f16, shapes of its ``wgmma_supported``; ``interpret`` then runs the
        Mosaic GPU interpreter) or "hopper" (``gpu_sparse_fwd_qtile.sparse_fwd_hopper``: query tiles or the
        KV-outer kernel, chosen per call on the device; same shapes).
      backward: "triton" (``gpu_sparse_bwd``) or "wgmma" (``gpu_sparse_bwd_wgmma``: bf16 / f16, shapes of its
        ``wgmma_bwd_supported``; a query pass with a window off an 8-row boundary runs the Triton kernel).
    Returns:
      (o [B,T,H,Dv] q.dtype, lse [B,T,H] f32 natural log, -inf where a query sees no key).
    Preconditions are asserted (AssertionError); the ops layer checks them for its callers.
    The gradient of lse is not propagated (it is an auxiliary output for combining partial
    attentions; using it in a loss raises nothing but contributes zero gradient).
    Math: MSA_SPEC.md section 3 (arXiv 2606.13392).
    """
    layout.check_shapes(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids)
    assert _pow2_tile(block_size), f"block_size must be a power of two >= 16, got {block_size}"
    assert _pow2_tile(q.shape[-1]) and _pow2_tile(v.shape[-1]), \
        f"head dims {q.shape[-1]}, {v.shape[-1]} must be powers of two >= 16 (Triton tiles)"
    assert forward in FORWARDS, f"forward must be one of {sorted(FORWARDS)}, got {forward!r}"
    assert backward in BACKWARDS, f"backward must be one of {sorted(BACKWARDS)}, got {backward!r}"
    return _attn(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                 block_size, interpret, num_warps, num_stages, forward, backward)
