"""The page union of shared sparse decode tiles on GPU (Pallas, Triton lowering): one launch per step.

Computes exactly ``common.union_pages`` (its docstring has the contract: per row block of ``qpb`` query
rows, the distinct selected pages ordered by ``(page % nsplit, page)``, a bitmap of the rows that selected
each, and the first slot of each split) in one program per (request, kv group, row block). The XLA form
of the same construction compiles to about seven small fusions, each a kernel launch of its own on a GPU;
at decode sizes (a few KiB of ids) the launches, not the work, are its cost.

The program holds its ``U = qpb x K`` candidate ids as one vector and compares them pairwise (``[U, U]``);
it serves ``U <= MAX_SLOTS`` (``supports_union_kernel``: one row of top-16), where it beats the XLA form;
wider row blocks (MTP verification rows) keep the XLA form.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.decode.common import next_pow2, pad_rows

__all__ = ["MAX_SLOTS", "supports_union_kernel", "union_pages_gpu"]

#: Most candidate slots (query rows of a row block x K, each padded to a power of two) of one program:
#: one row of top-16 (Q = 1), where it was measured to win. At 128 slots (8 rows, MTP verification) it lost
#: to the XLA form, in one [U, U] pass and in column chunks alike (BENCHMARKS.md, MSA decode); 32 slots
#: (Q = 2) were not measured.
MAX_SLOTS = 16


def supports_union_kernel(qpb: int, k: int, max_slots: int = MAX_SLOTS) -> bool:
    """Whether ``union_pages_gpu`` serves row blocks of ``qpb`` rows of ``k`` ids each (within ``max_slots``)."""
    return 1 <= qpb <= 31 and next_pow2(qpb) * next_pow2(k) <= max_slots


def _union_kernel(ids_ref, uid_ref, bits_ref, st_ref, *, qpb, kp, nq, nsplit):
    b = pl.program_id(0)
    g = pl.program_id(1)
    r = pl.program_id(2)
    up = uid_ref.shape[-1]
    u = jax.lax.broadcasted_iota(jnp.int32, (up,), 0)
    row = u // kp                                                  # query row within the block
    flat = ids_ref[b, g, pl.ds(r * qpb * kp, up)]                  # [U] (rows past the block masked below)
    valid = (flat >= 0) & (row < qpb) & (r * qpb + row < nq)
    flat = jnp.where(valid, flat, -1)
    res = jnp.where(valid, flat % nsplit, nsplit)
    uu, vv = u[:, None], u[None, :]                                # [U, U]: (u, v)
    same = (flat[:, None] == flat[None, :]) & valid[None, :] & (vv < uu)
    first = valid & (jnp.max(same.astype(jnp.int32), axis=1) == 0)          # no equal id before it
    row_first = valid & (jnp.max((same & (row[:, None] == row[None, :])).astype(jnp.int32), axis=1) == 0)
    # slot of a first occurrence: the first occurrences ordered before it by (page % nsplit, page)
    ahead = (res[None, :] < res[:, None]) | ((res[None, :] == res[:, None]) & (flat[None, :] < flat[:, None]))
    dest = jnp.sum((first[None, :] & ahead).astype(jnp.int32), axis=1)      # [U]
    put = first[None, :] & (dest[None, :] == uu)                    # [U (slot), U (candidate)]
    uid = jnp.sum(jnp.where(put, flat[None, :] + 1, 0), axis=1) - 1
    # bit j of a slot: row j selected its page (each row's first occurrence counted once)
    bit = jnp.where(row_first, jnp.left_shift(jnp.int32(1), row), 0)
    bits = jnp.sum(jnp.where((flat[None, :] == uid[:, None]) & (uid[:, None] >= 0), bit[None, :], 0), axis=1)
    sp = st_ref.shape[-1]
    s = jax.lax.broadcasted_iota(jnp.int32, (sp, up), 0)
    starts = jnp.sum((first[None, :] & (res[None, :] < jnp.minimum(s, nsplit))).astype(jnp.int32), axis=1)
    uid_ref[b, g, r, :] = uid
    bits_ref[b, g, r, :] = bits
    st_ref[b, g, r, :] = starts


@functools.partial(jax.jit, static_argnames=("qpb", "nsplit", "interpret", "num_warps", "max_slots"))
def union_pages_gpu(block_ids, qpb: int, nsplit: int = 1, *, interpret: bool = False, num_warps: int = 4,
                    max_slots: int = MAX_SLOTS):
    """``common.union_pages(block_ids, qpb, nsplit)`` as one Triton launch.

    Args: block_ids ``[B, G, Q, K]`` int32 logical page ids (``-1`` = empty; repeats allowed); qpb query
      rows per row block (``supports_union_kernel(qpb, K)``); nsplit >= 1; interpret: Pallas interpret mode;
      num_warps: of each program; max_slots: the most padded slots served (``MAX_SLOTS``; bench/decode_union.py
      raises it to time wider row blocks).
    Returns: ``(ids [B, G, R, UP], bits [B, G, R, UP], starts [B, G, R, SP])`` int32, ``R = ceil(Q / qpb)``:
      ``union_pages``' values in the first ``qpb * K`` / ``nsplit + 1`` entries; the padding after them
      (``UP = next_pow2(qpb) * next_pow2(K)`` slots, ``SP = next_pow2(nsplit + 1)``) holds ``-1`` ids, 0
      bits and the total count as starts, which the attention kernels never read.
    Raises ValueError when the kernel does not serve ``qpb`` and K.
    """
    b, g, nq, k = block_ids.shape
    if not supports_union_kernel(qpb, k, max_slots) or nsplit < 1:
        raise ValueError(f"union_pages_gpu serves qpb * K <= {max_slots} (powers of two) and nsplit >= 1; "
                         f"got qpb={qpb}, K={k}, nsplit={nsplit}")
    kp, qp = next_pow2(k), next_pow2(qpb)
    nblk = -(-nq // qpb)
    ids = block_ids.astype(jnp.int32)
    if kp != k:
        ids = pad_rows(ids, 3, kp, -1)
    rows = (nblk - 1) * qpb + qp                     # the last block's loads stay inside the array
    if rows > nq:
        ids = pad_rows(ids, 2, rows, -1)
    up, sp = qp * kp, next_pow2(nsplit + 1)
    kernel = functools.partial(_union_kernel, qpb=qpb, kp=kp, nq=nq, nsplit=nsplit)
    shape = lambda n: jax.ShapeDtypeStruct((b, g, nblk, n), jnp.int32)
    return pl.pallas_call(
        kernel, grid=(b, g, nblk), out_shape=[shape(up), shape(up), shape(sp)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="paged_decode_union",
    )(ids.reshape(b, g, ids.shape[2] * kp))
