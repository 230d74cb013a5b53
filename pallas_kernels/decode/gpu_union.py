"""The page union of shared sparse decode tiles on GPU (Pallas, Triton lowering): one launch per step.

Computes exactly ``common.union_pages`` (its docstring has the contract: per row block of ``qpb`` query
rows, the distinct selected pages ordered by ``(page % nsplit, page)``, a bitmap of the rows that selected
each, and the first slot of each split) in one program per (request, kv group, row block). The XLA form
of the same construction compiles to about seven small fusions, each a kernel launch of its own on a GPU;
at decode sizes (a few KiB of ids) the launches, not the work, are its cost.

Two algorithms, by the row block's width (``union_algorithm``):
- "pairwise": the ``U = qpb x K`` candidate ids as one vector compared pairwise (``[U, U]``); for
  ``U <= MAX_SLOTS`` (one row of top-16, Q = 1), where it beats the XLA form.
- "bitmap": a word per logical page of the page table (``n_pages``, static), in the union's order (page
  ``p`` at ``(p % nsplit)``'s class start plus ``p // nsplit``), OR-ed from each row's ids; an exclusive
  prefix count over the words gives each page its slot. Work ``O(UP x NPp)`` (padded slots x padded pages);
  for wider row blocks (MTP verification rows, Q >= 2) while ``UP x NPp <= BITMAP_MAX``. The pairwise form at
  ``U = 128`` ran a chain of ``[U, U]`` reductions per program (7,347 PTX lines, 255 registers and spills at
  4 warps, compiled on the CPU) and lost to XLA on the GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.decode.common import next_pow2, pad_rows

__all__ = ["MAX_SLOTS", "BITMAP_MAX", "union_algorithm", "default_warps", "supports_union_kernel", "union_pages_gpu"]

#: Most candidate slots (query rows of a row block x K, each padded to a power of two) of one program:
#: one row of top-16 (Q = 1), where it was measured to win. At 128 slots (8 rows, MTP verification) it lost
#: to the XLA form, in one [U, U] pass and in column chunks alike (BENCHMARKS.md, MSA decode); 32 slots
#: (Q = 2) were not measured.
MAX_SLOTS = 16
#: Most padded slots x padded pages of one "bitmap" program (its [UP, NPp] selection step): 128 slots (Q = 8
#: at top-16) over a page table of up to 128 pages (16K tokens at 128-token pages).
BITMAP_MAX = 128 * 128


def union_algorithm(qpb: int, k: int, n_pages: int | None = None, max_slots: int = MAX_SLOTS) -> str | None:
    """The algorithm ``union_pages_gpu`` runs for row blocks of ``qpb`` rows of ``k`` ids over a page table of
    ``n_pages`` logical pages (None: unknown): "pairwise" when the padded slots fit ``max_slots``, else
    "bitmap" when ``n_pages`` is given and slots x padded pages fit ``BITMAP_MAX``, else None (not served)."""
    if not 1 <= qpb <= 31 or k < 1:
        return None
    up = next_pow2(qpb) * next_pow2(k)
    if up <= max_slots:
        return "pairwise"
    if n_pages is not None and n_pages >= 1 and up * next_pow2(n_pages) <= BITMAP_MAX:
        return "bitmap"
    return None


def default_warps(algorithm: str, up: int, n_pages: int | None) -> int:
    """Warps of a union program: 4 for "pairwise" (measured at 16 slots); for "bitmap" by its [UP, NPp] work,
    4 up to 2,048 elements, 8 up to 8,192, else 16 (fewer PTX instructions per thread without spills,
    compiled on the CPU; to be re-timed on the GPU with bench/decode_union.py)."""
    if algorithm != "bitmap":
        return 4
    work = up * next_pow2(n_pages or 1)
    return 4 if work <= 2048 else 8 if work <= 8192 else 16


def supports_union_kernel(qpb: int, k: int, max_slots: int = MAX_SLOTS, n_pages: int | None = None) -> bool:
    """Whether ``union_pages_gpu`` serves row blocks of ``qpb`` rows of ``k`` ids each (``union_algorithm``)."""
    return union_algorithm(qpb, k, n_pages, max_slots) is not None


def _item_grid(nsplit):
    """``(s, c)`` int32 index grids ``[SP, 4]`` of a row block's work items (SP = next_pow2(nsplit)): split s,
    column c of ``(first slot, slots, slots seen whole)``."""
    sp = next_pow2(nsplit)
    return (jax.lax.broadcasted_iota(jnp.int32, (sp, 4), 0), jax.lax.broadcasted_iota(jnp.int32, (sp, 4), 1))


def _write_items(it_ref, b, g, r, nsplit, val):
    """Row block (b, g, r)'s work items ``it_ref[b, g, r] [nsplit, 3]`` from ``val [SP, 4]`` (``_item_grid``):
    ``gpu_attention_wgmma.schedule_items``' meta."""
    s, c = _item_grid(nsplit)
    pltriton.store(it_ref.at[b, g, r, s, c], val, mask=(s < nsplit) & (c < 3))


def _union_kernel(ids_ref, *refs, qpb, kp, nq, nsplit, items, page):
    pos_ref, uid_ref, bits_ref, st_ref, it_ref = refs if items else (None, *refs, None)
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
    if items:
        free = (jnp.min(pos_ref[b, r, :]) + 1) // page       # pages every row of the block sees whole
        cs, cc = _item_grid(nsplit)
        cls = res[None, None, :]
        take = jnp.where(cc[:, :, None] == 0, cls < cs[:, :, None],
                         (cls == cs[:, :, None]) & ((cc[:, :, None] == 1) | (flat[None, None, :] < free)))
        _write_items(it_ref, b, g, r, nsplit, jnp.sum((first[None, None, :] & take).astype(jnp.int32), axis=2))


def _bitmap_kernel(ids_ref, *refs, qpb, qp, nq, nsplit, n_pages, items, page):
    pos_ref, uid_ref, bits_ref, st_ref, it_ref = refs if items else (None, *refs, None)
    b = pl.program_id(0)
    g = pl.program_id(1)
    r = pl.program_id(2)
    npp = next_pow2(n_pages)
    up = uid_ref.shape[-1]
    kp = ids_ref.shape[-1]
    base, extra = n_pages // nsplit, n_pages % nsplit        # class s holds base + (s < extra) pages
    start_of = lambda cls: jnp.where(cls < nsplit, cls * base + jnp.minimum(cls, extra), npp)   # class starts
    # Few cross-warp reductions (each a shared-memory round trip with barriers, the kernel's latency): the
    # rows' words in two, the work items in one.
    p = ids_ref[b, g, pl.ds(r * qpb, qp), :]                 # [QP, KP] candidate ids of the block's rows
    row = jax.lax.broadcasted_iota(jnp.int32, (qp, kp), 0)
    ok = (p >= 0) & (p < n_pages) & (row < qpb) & (r * qpb + row < nq)
    p = jnp.where(ok, p, 0)
    res = p % nsplit
    j = jnp.where(ok, res * base + jnp.minimum(res, extra) + p // nsplit, -1)      # bitmap position
    jj3 = jax.lax.broadcasted_iota(jnp.int32, (npp, qp, kp), 0)
    hit = jnp.max((j[None, :, :] == jj3).astype(jnp.int32), axis=2)               # [NPp, QP]: a repeat once
    word = jnp.sum(jnp.left_shift(hit, jax.lax.broadcasted_iota(jnp.int32, (npp, qp), 1)), axis=1)   # bit i: row i
    jj = jax.lax.broadcasted_iota(jnp.int32, (npp,), 0)      # bitmap position, in the union's order
    nz = (word != 0).astype(jnp.int32)
    dest = jnp.cumsum(nz) - nz                               # slot of an occupied position
    # logical page at position j: class s = which run of (base + 1) / base positions j falls in
    big = extra * (base + 1)
    if base > 0:
        s = jnp.where(jj < big, jj // (base + 1), extra + (jj - big) // base)
    else:
        s = jj // (base + 1)
    page_j = (jj - s * base - jnp.minimum(s, extra)) * nsplit + s
    # Occupied positions scatter to their slots (a bijection onto [0, count)) after the slots from count on
    # got -1 / 0. Masked lanes (empty positions) write nothing on the GPU; Pallas interpret mode writes their
    # old value back, so they point past count, each at its own slot (or past the end: dropped).
    count = jnp.sum(nz)
    uu = jax.lax.broadcasted_iota(jnp.int32, (up,), 0)
    pltriton.store(uid_ref.at[b, g, r, uu], jnp.full((up,), -1, jnp.int32), mask=uu >= count)
    pltriton.store(bits_ref.at[b, g, r, uu], jnp.zeros((up,), jnp.int32), mask=uu >= count)
    at = jnp.where(nz == 1, dest, count + jj - dest)
    pltriton.store(uid_ref.at[b, g, r, at], page_j, mask=nz == 1)
    pltriton.store(bits_ref.at[b, g, r, at], word, mask=nz == 1)
    cs = jax.lax.broadcasted_iota(jnp.int32, (st_ref.shape[-1], npp), 0)
    st_ref[b, g, r, :] = jnp.sum(((nz[None, :] == 1) & (jj[None, :] < start_of(cs))).astype(jnp.int32), axis=1)
    if items:
        free = (jnp.min(pos_ref[b, r, :]) + 1) // page       # pages every row of the block sees whole
        cs, cc = (x[:, :, None] for x in _item_grid(nsplit))
        j3 = jj[None, None, :]
        inside = (j3 >= start_of(cs)) & (j3 < start_of(cs + 1))
        take = jnp.where(cc == 0, j3 < start_of(cs), inside & ((cc == 1) | (page_j[None, None, :] < free)))
        _write_items(it_ref, b, g, r, nsplit, jnp.sum(((nz[None, None, :] == 1) & take).astype(jnp.int32), axis=2))


@functools.partial(jax.jit, static_argnames=("qpb", "nsplit", "n_pages", "interpret", "num_warps", "max_slots",
                                             "algorithm", "page"))
def union_pages_gpu(block_ids, qpb: int, nsplit: int = 1, n_pages: int | None = None, positions=None,
                    page: int | None = None, *, interpret: bool = False,
                    num_warps: int | None = None, max_slots: int = MAX_SLOTS, algorithm: str | None = None):
    """``common.union_pages(block_ids, qpb, nsplit, n_pages)`` as one Triton launch.

    Args: block_ids ``[B, G, Q, K]`` int32 logical page ids (``-1`` = empty; repeats allowed; ``< n_pages``
      when given: the "bitmap" algorithm drops larger ids); qpb query rows per row block; nsplit >= 1;
      n_pages: static bound on the ids (the page table's width), which the "bitmap" algorithm needs;
      interpret: Pallas interpret mode; num_warps: of each program (None: ``default_warps``); max_slots:
      the most padded slots of the "pairwise" algorithm (``MAX_SLOTS``; bench/decode_union.py raises it to
      time wider row blocks);
      algorithm: "pairwise" | "bitmap" | None (``union_algorithm``); positions: optional ``[B, R, M]`` int32,
      the positions of each row block's tile rows (``common.pack_rows``; -1 = padding row), with ``page``
      (tokens per page): a row block's rows all see its pages below ``(min position + 1) // page`` whole.
    Returns: ``(ids [B, G, R, UP], bits [B, G, R, UP], starts [B, G, R, SP])`` int32, ``R = ceil(Q / qpb)``:
      ``union_pages``' values in the first ``qpb * K`` / ``nsplit + 1`` entries; the padding after them
      (``UP = next_pow2(qpb) * next_pow2(K)`` slots, ``SP = next_pow2(nsplit + 1)``) holds ``-1`` ids, 0
      bits and the total count as starts, which the attention kernels never read. With ``positions`` also
      ``items [B, G, R, nsplit, 3]`` int32: per split ``(first slot, slots, slots whose page every row sees
      whole)``, the wgmma decode kernel's work items (``gpu_attention_wgmma.schedule_items``).
    Raises ValueError when the kernel does not serve ``qpb``, K and ``n_pages``, for an unknown algorithm, or
    for ``positions`` without ``page``.
    """
    b, g, nq, k = block_ids.shape
    if algorithm is None:
        algorithm = union_algorithm(qpb, k, n_pages, max_slots)
    if algorithm not in ("pairwise", "bitmap") or nsplit < 1 or not 1 <= qpb <= 31 or (
            algorithm == "bitmap" and (n_pages is None or n_pages < 1)):
        raise ValueError(f"union_pages_gpu serves qpb * K <= {max_slots} (powers of two), or with n_pages "
                         f"qpb * K * n_pages <= {BITMAP_MAX}, and nsplit >= 1; got qpb={qpb}, K={k}, "
                         f"n_pages={n_pages}, nsplit={nsplit}, algorithm={algorithm}")
    kp, qp = next_pow2(k), next_pow2(qpb)
    nblk = -(-nq // qpb)
    ids = block_ids.astype(jnp.int32)
    if kp != k:
        ids = pad_rows(ids, 3, kp, -1)
    rows = (nblk - 1) * qpb + qp                     # the last block's loads stay inside the array
    if rows > nq:
        ids = pad_rows(ids, 2, rows, -1)
    up, sp = qp * kp, next_pow2(nsplit + 1)
    if num_warps is None:
        num_warps = default_warps(algorithm, up, n_pages)
    items = positions is not None
    if items and (page is None or page < 1):
        raise ValueError(f"union_pages_gpu: positions need page (tokens per page >= 1), got page={page}")
    if algorithm == "bitmap":
        kernel = functools.partial(_bitmap_kernel, qpb=qpb, qp=qp, nq=nq, nsplit=nsplit, n_pages=n_pages,
                                   items=items, page=page)
    else:
        kernel = functools.partial(_union_kernel, qpb=qpb, kp=kp, nq=nq, nsplit=nsplit, items=items, page=page)
        ids = ids.reshape(b, g, ids.shape[2] * kp)
    shape = lambda *n: jax.ShapeDtypeStruct((b, g, nblk, *n), jnp.int32)
    out_shape = [shape(up), shape(up), shape(sp)] + ([shape(nsplit, 3)] if items else [])
    return pl.pallas_call(
        kernel, grid=(b, g, nblk), out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="paged_decode_union",
    )(ids, *([positions.astype(jnp.int32)] if items else []))
