"""Dense causal GQA attention for chunked prefill on GPU (Pallas, Triton lowering), forward only.

Problem: a prefill chunk's T queries are the causal suffix of the S keys of a contiguous key view
(``minimax_jax.decode.cache.gather_pages``: key ``j`` of the view is absolute position ``j``), so
query ``i`` at position ``p_i`` sees keys ``j <= p_i``. cuDNN and the Pallas flash kernels of
``minimax_jax.ops.attention`` need T == S (index-causal self-attention), and the XLA reference
materialises ``[chunk, S]`` logits, whose cost and memory grow with S (BENCHMARKS.md, issue 8).
Here every program walks only the key tiles its rows can see, so a chunk costs
``O(T * max position)``, independent of the view's width S.

Math: scale ``1/sqrt(D)``, exact softmax with float32 statistics (online softmax in the exp2
domain, FlashAttention-2 style), probabilities cast to the value dtype before the PV product (as
the XLA reference does), output in ``q.dtype``. Rows with position ``-1`` (padding) see nothing
and return zeros.

Kernel layout: one program per (row tile, kv group, batch row). The ``H/G`` query heads of a group
share its keys, so the rows of a tile are (token, head) pairs, token-major (``rows`` = 128 rows =
32 tokens x 4 heads for the demo model), stacked as the M dimension of ``[rows, D] @ [D, block_k]``.
Key tiles ``[0, n_full)`` are visible to every valid row of the tile (no mask); tiles
``[n_full, n_all)`` (the diagonal) are masked by ``key index <= row position``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import gqa_triton_reason

__all__ = ["suffix_attention_gpu", "unsupported_reason", "BLOCK_K"]

#: Keys per tile (the view is zero-padded to a multiple of it).
BLOCK_K = 64
_LOG2E = math.log2(math.e)
_BIG = 1 << 30


def _dot(a, b, trans_b=False):
    """2-D matmul with fp32 accumulation; lowers to a Triton tensor-core dot (tl.dot)."""
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _kernel(q_ref, k_ref, v_ref, qpos_ref, o_ref, *, rows, block_k, n_tiles, scale):
    rt = pl.program_id(0)
    g = pl.program_id(1)
    b = pl.program_id(2)
    rs = pl.ds(rt * rows, rows)
    q = q_ref[b, g, rs, :]                              # [R, D]
    qpos = qpos_ref[b, rs]                              # [R] int32, -1 = padding row
    valid = qpos >= 0
    hi = jnp.maximum(jnp.max(qpos), -1)
    lo = jnp.min(jnp.where(valid, qpos, _BIG))
    n_all = jnp.minimum(jax.lax.div(hi + block_k, block_k), n_tiles)   # tiles holding a key <= hi (0 if hi = -1)
    n_full = jnp.minimum(jax.lax.div(lo + 1, block_k), n_all)   # tiles wholly <= every valid position
    qk_scale = scale * _LOG2E
    dv = v_ref.shape[-1]

    def step(tile, carry, masked):
        acc, m_prev, l_prev = carry
        sl = pl.ds(tile * block_k, block_k)
        kb = k_ref[b, sl, g, :]                         # [block_k, D]
        vb = v_ref[b, sl, g, :]
        s = _dot(q, kb, trans_b=True) * qk_scale        # [R, block_k], log2 domain
        if masked:
            kidx = tile * block_k + jnp.arange(block_k, dtype=jnp.int32)
            s = jnp.where(kidx[None, :] <= qpos[:, None], s, -jnp.inf)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next) if masked else m_next
        corr = jnp.exp2(m_prev - m_safe)
        p = jnp.exp2(s - m_safe[:, None])
        l_next = l_prev * corr + jnp.sum(p, axis=1)
        acc = acc * corr[:, None] + _dot(p.astype(vb.dtype), vb)
        return acc, m_next, l_next

    init = (jnp.zeros((rows, dv), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    carry = jax.lax.fori_loop(0, n_full, functools.partial(step, masked=False), init)
    acc, _, l_i = jax.lax.fori_loop(n_full, n_all, functools.partial(step, masked=True), carry)
    l_safe = jnp.where(l_i == 0.0, 1.0, l_i)
    o = jnp.where(valid[:, None], acc / l_safe[:, None], 0.0)
    o_ref[b, g, rs, :] = o.astype(o_ref.dtype)


def _pow2(x: int) -> bool:
    return x >= 16 and not (x & (x - 1))


def unsupported_reason(q, k, v, sliding_window=None) -> str | None:
    """None when ``suffix_attention_gpu`` can serve these inputs, else why not (a string).

    Args: q ``[B, T, H, D]``, k / v ``[B, S, G, D]`` (arrays or ShapeDtypeStructs);
      sliding_window: the layer's window (the kernel has none).
    """
    if sliding_window is not None:
        return "the suffix attention kernel has no sliding window"
    return gqa_triton_reason(q, k, v)


def suffix_attention_gpu(q, k, v, q_positions, *, rows: int | None = None, block_k: int = BLOCK_K,
                         num_warps: int | None = None, num_stages: int = 2, interpret: bool = False):
    """Causal GQA attention of queries at ``q_positions`` over a contiguous key view (module docstring).

    Args:
      q: ``[B, T, H, D]``; k, v: ``[B, S, G, D]`` (one float dtype; head h uses kv head
        ``h // (H / G)``); key ``j`` of row ``b`` is position ``j``.
      q_positions: ``[B, T]`` int, ``-1`` = padding (that row returns zeros); valid positions must
        be ``< S`` (keys past S do not exist; not checked under jit) and every key ``j <= p`` must
        hold real data (stale slots past the filled length are never visible to a valid row).
      rows: query rows (token x head) per program, a power of two >= 16 (default 128 for
        ``D <= 64``, else 64). block_k: keys per tile (power of two >= 16).
      num_warps (default 4 for ``D <= 64``, else 8), num_stages: Triton launch parameters.
      interpret: run the kernel in Pallas interpret mode (CPU tests).
    Returns: ``[B, T, H, D]`` in ``q.dtype``.
    Preconditions (asserted; ``minimax_jax.ops.prefill`` checks them for users): ``unsupported_reason``
    is None, ``q_positions`` is ``[B, T]``, rows and block_k are powers of two >= 16.
    """
    bsz, t, h, d = q.shape
    s, g = k.shape[1], k.shape[2]
    assert tuple(q_positions.shape) == (bsz, t), f"q_positions must be [B={bsz}, T={t}], got {q_positions.shape}"
    rows = rows or (128 if d <= 64 else 64)
    assert _pow2(rows) and _pow2(block_k), f"rows ({rows}) and block_k ({block_k}) must be powers of two >= 16"
    num_warps = num_warps or (4 if d <= 64 else 8)
    rep = h // g
    r = t * rep
    rp = -(-r // rows) * rows
    sp = -(-s // block_k) * block_k
    qg = q.reshape(bsz, t, g, rep, d).transpose(0, 2, 1, 3, 4).reshape(bsz, g, r, d)
    qpos = jnp.repeat(q_positions.astype(jnp.int32), rep, axis=1)            # [B, T*rep] token-major
    if rp != r:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rp - r), (0, 0)))
        qpos = jnp.pad(qpos, ((0, 0), (0, rp - r)), constant_values=-1)
    if sp != s:                                                               # never visible: index >= S
        widths = ((0, 0), (0, sp - s), (0, 0), (0, 0))
        k, v = jnp.pad(k, widths), jnp.pad(v, widths)
    kernel = functools.partial(_kernel, rows=rows, block_k=block_k, n_tiles=sp // block_k,
                               scale=1.0 / math.sqrt(d))
    out = pl.pallas_call(
        kernel,
        grid=(rp // rows, g, bsz),
        out_shape=jax.ShapeDtypeStruct((bsz, g, rp, d), q.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="prefill_suffix_attention_gpu",
    )(qg, k, v, qpos)
    return out[:, :, :r].reshape(bsz, g, t, rep, d).transpose(0, 2, 1, 3, 4).reshape(bsz, t, h, d)
