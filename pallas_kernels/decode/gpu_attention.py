"""Split-KV paged decode attention on GPU (Pallas, Triton lowering): dense, or sparse over selected pages.

Math: MSA_SPEC.md section 5 (inputs validated by ``minimax_jax.ops.paged``). Caches are flattened so
a physical page ``p`` is the row range ``[p*page, (p+1)*page)`` and is gathered with a
data-dependent ``pl.ds(page_id * page, page)`` load.

``paged_attention_gpu``: split-KV flash decoding. One program per (request x kv group, row block,
split); a split walks ``pps`` pages with an online softmax and writes a normalised partial output and
its log-sum-exp; ``combine_splits`` merges them. A tile stacks all H/G heads of the group and up to
``LaunchTable.tile_rows`` rows' worth of query rows (Q x H/G rows, padded to a power of two >= 16,
the MMA minimum) as the matmul M dimension, so each page is read once per (request, kv group, row
block); each row sees the cache up to its own position. Dense mode walks logical pages in order (pages
past the request's last row are skipped). Sparse (MSA) mode, ``sparse_tile="shared"``: the tile walks
the union of its rows' selected pages and row ``r`` sees a page only if it selected it; split ``s``
takes the union's pages with ``page % nsplit == s`` in ascending order (``common.union_pages``), so a
row rounds alike whatever the other rows of its tile selected. ``"per_row"``: one tile per query row
over its own ``block_ids`` (``-1`` slots skipped).
``sparse_pps`` slots per split (default ``LaunchTable.sparse_pps``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.decode.common import (combine_splits, compute_dtype, dot_nn, dot_nt, pack_rows, pad_positions,
                                          pad_rows, row_block, union_pages, unpack_rows)
from pallas_kernels.decode.gpu_attention_wgmma import default_ctas, paged_decode_wgmma, wgmma_decode_reason
from pallas_kernels.common import from_byte_pairs, gpu_compute_capability, needs_byte_pairs, to_byte_pairs
from pallas_kernels.decode.gpu_config import DEFAULT_TABLE, TILE_KERNELS, LaunchTable, pages_per_program
from pallas_kernels.decode.gpu_union import supports_union_kernel, union_algorithm, union_pages_gpu

__all__ = ["paged_attention_gpu", "tile_kernel_choice", "resolve_tile_kernel", "union_choice"]

_NEG = -1e30


def _row_positions(qp_ref, b, r, *, m_rows, qpb, hg, nq):
    """``[M]`` int32 positions of tile rows of row block r of request b (``common.pack_rows``' layout: row i is
    query row ``r * qpb + i // hg``; padding rows -1), gathered from ``qp_ref`` ``[B, Qp]`` (``pad_positions``)."""
    i = jax.lax.broadcasted_iota(jnp.int32, (m_rows,), 0)
    row = r * qpb + i // hg
    ok = (i < qpb * hg) & (row < nq)
    return pltriton.load(qp_ref.at[b, jnp.where(ok, row, 0)], mask=ok, other=-1)


def _attn_kernel(pt_ref, qp_ref, lim_ref, ids_ref, bits_ref, q_ref, k_ref, v_ref, *rest, page, pps, scale, g_count,
                 mode, nsplit, hg, qpb, nq, has_scale, cdt, loop, byte_dtype=None):
    if has_scale:
        ks_ref, vs_ref, o_ref, l_ref = rest
    else:
        o_ref, l_ref = rest
    bg = pl.program_id(0)
    r = pl.program_id(1)
    sp = pl.program_id(2)
    b = bg // g_count
    g = bg % g_count
    q = q_ref[b, g, r].astype(cdt)                           # [M, D]
    m_rows, d = q.shape
    # Row positions and the dense page count from the query positions (no XLA op before the launch when Q
    # is a power of two; else one pad). lim_ref is not read in dense mode.
    qpos = _row_positions(qp_ref, b, r, m_rows=m_rows, qpb=qpb, hg=hg, nq=nq)                 # [M]
    if mode == "dense":      # pages up to the request's last row: clip(max pos // page + 1, 0, NP)
        n_dense = jnp.clip(jnp.max(qp_ref[b, :]) // page + 1, 0, pt_ref.shape[1])
    kidx = jax.lax.broadcasted_iota(jnp.int32, (1, page), 1)
    if mode == "shared":
        # This split's slots of the union (``common.union_pages``: the pages with page % nsplit == sp).
        n_slots = ids_ref.shape[-1]
        lo = lim_ref[b, g, r, sp]
        hi = lim_ref[b, g, r, sp + 1]
        row_q = jnp.minimum(jax.lax.broadcasted_iota(jnp.int32, (m_rows,), 0) // hg, 31)   # tile row -> query row

    def slot(j):
        """(logical page, ok, [M] row mask or None) of the split's j-th step."""
        if mode == "dense":
            idx = sp * pps + j
            logical = idx if loop == "dynamic" else jnp.clip(idx, 0, jnp.maximum(n_dense - 1, 0))
            return logical, idx < n_dense, None
        if mode == "per_row":
            logical = ids_ref[b, g, r, sp * pps + j]
            return jnp.maximum(logical, 0), logical >= 0, None
        idx = lo + j
        i = idx if loop == "dynamic" else jnp.minimum(idx, n_slots - 1)
        logical = ids_ref[b, g, r, i]
        rows = ((bits_ref[b, g, r, i] >> row_q) & 1) == 1    # only the rows that selected the page
        return jnp.maximum(logical, 0), (idx < hi) & (logical >= 0), rows

    def body(j, carry):
        acc, m_prev, l_prev = carry
        logical, ok, rows = slot(j)
        start = pt_ref[b, logical] * page
        kb, vb = k_ref[g, pl.ds(start, page), :], v_ref[g, pl.ds(start, page), :]     # [page, D]
        if byte_dtype is not None:      # 1-byte pages read as uint16 byte pairs (common.to_byte_pairs)
            kb, vb = from_byte_pairs(kb, byte_dtype), from_byte_pairs(vb, byte_dtype)
        kb, vb = kb.astype(cdt), vb.astype(cdt)
        s = dot_nt(q, kb) * scale                              # [M, page]
        if has_scale:
            s = s * ks_ref[g, pl.ds(start, page)][None, :]
        vis = ((logical * page + kidx) <= qpos[:, None]) & ok
        if rows is not None:
            vis = vis & rows[:, None]
        s = jnp.where(vis, s, _NEG)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        corr = jnp.exp(m_prev - m_next)
        p = jnp.where(vis, jnp.exp(s - m_next[:, None]), 0.0)
        l_next = l_prev * corr + jnp.sum(p, axis=1)
        if has_scale:
            p = p * vs_ref[g, pl.ds(start, page)][None, :]
        acc = acc * corr[:, None] + dot_nn(p.astype(cdt), vb)
        return acc, m_next, l_next

    # Dynamic trip counts (scf.for): dense splits stop at the last needed page; a per-row sparse split
    # visits its one slot only when it holds a page (-1 = empty), or with pps > 1 its slots up to
    # the last one holding a page (-1 slots before it are masked); a shared split walks its chunk of
    # the union's valid slots.
    # ("static": a fixed-step loop; slots past the end are masked.)
    if mode == "shared":
        n_iter = jnp.maximum(hi - lo, 0) if loop == "dynamic" else min(n_slots, -(-pt_ref.shape[1] // nsplit))
    elif loop != "dynamic":
        n_iter = pps
    elif mode == "dense":
        n_iter = jnp.clip(n_dense - sp * pps, 0, pps)
    elif pps == 1:
        n_iter = jnp.where(ids_ref[b, g, r, sp] >= 0, jnp.int32(1), jnp.int32(0))
    else:
        slots = ids_ref[b, g, r, pl.ds(sp * pps, pps)]     # [pps]
        n_iter = jnp.max(jnp.where(slots >= 0, jax.lax.broadcasted_iota(jnp.int32, (pps,), 0) + 1, 0))
    acc0 = jnp.zeros((m_rows, d), jnp.float32)
    m0 = jnp.full((m_rows,), _NEG, jnp.float32)
    l0 = jnp.zeros((m_rows,), jnp.float32)
    # Both loop bounds int32: Triton's scf.for needs equal bound types.
    acc, m_i, l_i = jax.lax.fori_loop(jnp.int32(0), jnp.asarray(n_iter, jnp.int32), body, (acc0, m0, l0))
    l_safe = jnp.where(l_i == 0.0, 1.0, l_i)
    o_ref[b, g, r, sp] = acc / l_safe[:, None]
    l_ref[b, g, r, sp] = jnp.where(l_i == 0.0, -jnp.inf, m_i + jnp.log(l_safe))


def _shared_splits(k: int, pps: int, programs: int, ctas: int | None = None) -> int:
    """Splits per (request, kv group, row block) of shared sparse tiles: ``ceil(K / pps)``, doubled while
    below ``K`` and ``programs`` (= B * G * row blocks) times it is under 528 (enough to fill the GPU, the
    Triton tiles); with ``ctas`` (the persistent wgmma launch) doubled only while ``programs`` times the
    doubled count is at most ``ctas``: each split its own CTA, no work-list balancing in XLA (faster
    than filling there: BENCHMARKS.md, MSA decode)."""
    n = -(-k // pps)
    while n * 2 <= k and (programs * n < 528 if ctas is None else programs * n * 2 <= ctas):
        n *= 2
    return n


def resolve_tile_kernel(tile_kernel: str, interpret: bool) -> str:
    """``LaunchTable.tile_kernel`` as it runs here: "auto" is "wgmma" when compiled for a visible GPU of
    compute capability 9.x (Hopper), else "triton"; "triton" / "wgmma" as given. Raises ValueError for
    other values (``gpu_config.TILE_KERNELS``)."""
    if tile_kernel not in TILE_KERNELS:
        raise ValueError(f"tile_kernel must be one of {TILE_KERNELS}, got {tile_kernel!r}")
    if tile_kernel != "auto":
        return tile_kernel
    cc = None if interpret else gpu_compute_capability()
    return "wgmma" if cc is not None and str(cc).startswith("9.") else "triton"


def _tile_kernel(m, d, cache_dtype, q_dtype, page, has_scale, shared_rows, tile_kernel, stages, interpret):
    """``(kernel, why)``: the kernel of an attention tile of ``m`` rows ("wgmma" or "triton") and, when
    "wgmma" was asked for (or chosen by "auto") but the Triton kernel runs, why (else None)."""
    if resolve_tile_kernel(tile_kernel, interpret) != "wgmma":
        return "triton", None
    if not shared_rows:
        return "triton", "per-row sparse tiles"
    why = wgmma_decode_reason(m, d, cache_dtype, q_dtype, page, has_scale, stages)
    return ("triton", why) if why else ("wgmma", None)


def _union_from(union: str, qpb: int, k: int, n_pages: int) -> str:
    """"kernel" (``gpu_union``) when ``union`` asks for it and the kernel serves row blocks of ``qpb`` rows
    of ``k`` ids over ``n_pages`` logical pages, else "xla" (``common.union_pages``)."""
    return "kernel" if union == "kernel" and supports_union_kernel(qpb, k, n_pages=n_pages) else "xla"


def union_choice(nq, h, g, k, n_pages, *, table: LaunchTable | None = None) -> str | None:
    """Where ``paged_attention_gpu``'s shared sparse tiles get their page union: "kernel (pairwise)" /
    "kernel (bitmap)" (``gpu_union``, the algorithm it runs) or "xla" (``common.union_pages``); None when
    the call has no shared tiles (``table.sparse_tile`` "per_row").

    Args: nq query rows per request, h q heads, g kv heads, k selected pages per row (block_ids' last
      dim), n_pages: the page table's width; table: None = ``DEFAULT_TABLE`` (its ``union`` and
      ``tile_rows``).
    """
    table = DEFAULT_TABLE if table is None else table
    if table.sparse_tile != "shared":
        return None
    qpb, _ = row_block(nq, h // g, True, 16, table.tile_rows)      # as _paged_attention packs them
    if _union_from(table.union, qpb, k, n_pages) == "xla":
        return "xla"
    return f"kernel ({union_algorithm(qpb, k, n_pages)})"


def tile_kernel_choice(nq, h, g, d, cache_dtype, q_dtype, page, *, has_scale, sparse,
                       table: LaunchTable | None = None, interpret: bool = False) -> str:
    """Which kernel ``paged_attention_gpu`` runs a call's attention tiles on: ``"triton"``, ``"wgmma"``, or
    ``"triton (wgmma refused: <why>)"`` when ``table`` asks for wgmma (or "auto" picks it on a Hopper GPU)
    and the tiles do not fit it (e.g. Q = 1: 16 rows per tile).

    Args: nq query rows per request, h q heads, g kv heads, d head dim; cache_dtype / q_dtype; page: tokens
      per page; has_scale: scaled (fp8) caches; sparse: block ids given (MSA); table: None = ``DEFAULT_TABLE``;
      interpret: the kernels run interpreted ("auto" is then "triton").
    """
    table = DEFAULT_TABLE if table is None else table
    shared_rows = not sparse or table.sparse_tile == "shared"
    _, m = row_block(nq, h // g, shared_rows, 16, table.tile_rows)          # as _paged_attention packs them
    kernel, why = _tile_kernel(m, d, cache_dtype, q_dtype, page, has_scale, shared_rows, table.tile_kernel,
                               table.wgmma_stages, interpret)
    return kernel if why is None else f"{kernel} (wgmma refused: {why})"


@functools.partial(jax.jit, static_argnames=("interpret", "pages_per_split", "num_warps", "num_stages", "loop",
                                             "sparse_pages_per_split", "tile_rows", "sparse_tile", "wide_warps",
                                             "tile_kernel", "wgmma_stages", "wgmma_pingpong", "union"))
def _paged_attention(q, k_pages, v_pages, page_table, q_positions, k_scale, v_scale, block_ids, *, interpret,
                     pages_per_split, num_warps, num_stages, loop, sparse_pages_per_split=1, tile_rows=64,
                     sparse_tile="per_row", wide_warps=None, tile_kernel="auto", wgmma_stages=2,
                     wgmma_pingpong=True, union="kernel"):
    """Split-KV paged decode attention (dense, or sparse over ``block_ids``).

    Args: as ``minimax_jax.ops.paged.paged_attention`` (q ``[B,Q,H,D]``, pages ``[G,P,page,D]``,
      page_table ``[B,NP]``, q_positions ``[B,Q]``, scales ``[G,P,page]`` or None, block_ids
      ``[B,G,Q,K]`` or None); pages_per_split: dense-mode pages per program;
      num_warps / num_stages / loop: launch variant;
      sparse_pages_per_split: sparse-mode slots per program (pps, a power of two >= 1). Shared tiles:
      ``ceil(K / pps)`` splits per (request, group, row block), doubled up to K while the grid is
      small (``_shared_splits``: on the wgmma kernel only while each split keeps a CTA), the union's pages
      interleaved over them by page id (loop "static":
      a fixed ``min(U, ceil(NP / splits))``-step loop, masked). Per-row tiles: ``block_ids`` slots per program,
      ``ceil(K / pps)`` splits, block_ids padded with -1 to a multiple of pps. pps = 1: one slot per
      split (the page is read only when the slot holds one). pps > 1: with loop "dynamic" a split
      walks its slots up to its last valid one (selections put valid slots first), skipping none
      before it but masking -1 slots; "static" walks all pps slots, masked. Same result as pps = 1
      up to float rounding (another split / log-sum-exp grouping).
      tile_rows: most rows of a tile (a power of two >= 16; see the module docstring); sparse_tile:
      "shared" (the tile's rows walk the union of their pages) or "per_row"; num_warps: warps of a
      tile of at most 64 rows, wide_warps (None = num_warps) of a wider one. tile_kernel: "triton",
      "auto" (``resolve_tile_kernel``: "wgmma" on a Hopper GPU) or "wgmma": dense and shared sparse tiles
      that ``gpu_attention_wgmma.wgmma_decode_reason`` accepts (64 or 128 rows, bf16 / f16 caches) run the
      Mosaic GPU kernel with ``wgmma_stages`` K/V slots, the others
      (per-row sparse tiles, fp8 caches, narrower tiles) the Triton one. union: "kernel" = shared tiles'
      page union from ``gpu_union.union_pages_gpu`` where it serves the row block (``_union_from``), else
      (and with "xla") from ``common.union_pages``.
    Returns: ``(o [B,Q,H,D] q.dtype, lse [B,Q,H] f32)``.
    Raises ValueError for a sparse_pages_per_split that is not a power of two >= 1.
    """
    b, nq, h, d = q.shape
    g, n_phys, page, _ = k_pages.shape
    npg = page_table.shape[1]
    dense = block_ids is None
    cdt = compute_dtype(k_pages.dtype)
    shared = not dense and sparse_tile == "shared"
    assert sparse_tile in ("shared", "per_row") and tile_rows >= 16 and not tile_rows & (tile_rows - 1)
    qr, pos, hg, m, qpb = pack_rows(q, q_positions, g, dense or shared, 16, max_m=tile_rows)
    rows = qr.shape[2]
    bits = jnp.zeros((1, 1, 1, 1), jnp.int32)
    ids = jnp.zeros((1, 1, 1, 1), jnp.int32)
    items = None
    pps = sparse_pages_per_split
    if not dense and (isinstance(pps, bool) or not isinstance(pps, int) or pps < 1 or pps & (pps - 1)):
        raise ValueError(f"sparse_pages_per_split must be a power of two >= 1, got {pps!r}")
    wgmma = _tile_kernel(m, d, k_pages.dtype, q.dtype, page, k_scale is not None, dense or shared, tile_kernel,
                         wgmma_stages, interpret)[0] == "wgmma"
    if dense:
        if pages_per_split is None:     # the persistent wgmma kernel: ~8 splits per CTA, for balance
            pages_per_split = pages_per_program(b * g * npg, default_ctas(interpret) * 8 if wgmma else 528, 64)
        pps = pages_per_split
        nsplit = -(-npg // pps)
        # pages to walk per request; the Triton kernel computes its own from the positions (no XLA op)
        lim = (jnp.clip(jnp.max(q_positions, axis=1) // page + 1, 0, npg).astype(jnp.int32) if wgmma
               else jnp.zeros((1,), jnp.int32))
    elif shared:
        nsplit = _shared_splits(block_ids.shape[-1], pps, b * g * rows,
                                default_ctas(interpret) if wgmma else None)
        if _union_from(union, qpb, block_ids.shape[-1], npg) == "kernel":   # slots / starts padded (never read)
            if wgmma:       # the wgmma kernel's work items too
                ids, bits, lim, items = union_pages_gpu(block_ids, qpb, nsplit, npg, pos, page, interpret=interpret)
                lim = lim[..., : nsplit + 1]
            else:
                ids, bits, lim = union_pages_gpu(block_ids, qpb, nsplit, npg, interpret=interpret)
        else:
            ids, bits, lim = union_pages(block_ids, qpb, nsplit, npg)  # [B, G, rows, qpb * K], starts [.., nsplit + 1]
    else:
        nsplit = -(-block_ids.shape[-1] // pps)
        lim = jnp.zeros((b,), jnp.int32)
        ids = block_ids.astype(jnp.int32)
        if nsplit * pps != ids.shape[-1]:
            ids = pad_rows(ids, 3, nsplit * pps, -1)
    args = [page_table.astype(jnp.int32), pad_positions(q_positions), lim, ids, bits, qr,
            k_pages.reshape(g, n_phys * page, d), v_pages.reshape(g, n_phys * page, d)]
    if k_scale is not None:
        args += [k_scale.reshape(g, n_phys * page).astype(jnp.float32),
                 v_scale.reshape(g, n_phys * page).astype(jnp.float32)]
    pairs = not wgmma and needs_byte_pairs(k_pages)    # int32 Triton offsets would overflow (common.needs_byte_pairs)
    kernel = functools.partial(_attn_kernel, page=page, pps=pps, scale=1.0 / math.sqrt(d), g_count=g,
                               mode="dense" if dense else sparse_tile, nsplit=nsplit, hg=hg, qpb=qpb, nq=nq,
                               has_scale=k_scale is not None, cdt=cdt, loop=loop,
                               byte_dtype=k_pages.dtype if pairs else None)
    if wgmma:
        o_part, l_part = paged_decode_wgmma(qr, pos, lim, page_table, args[6], args[7], page=page, pps=pps,
                                            nsplit=nsplit, stages=wgmma_stages, interpret=interpret,
                                            ids=ids if shared else None, bits=bits, hg=hg, pingpong=wgmma_pingpong,
                                            items=items)
        o, lse = combine_splits(o_part.astype(jnp.float32), l_part, axis=3)
        o, lse = unpack_rows(o, lse, nq, hg, qpb)
        return o.astype(q.dtype), lse
    if pairs:
        args[6], args[7] = to_byte_pairs(args[6]), to_byte_pairs(args[7])
    if m > 64 and wide_warps is not None:
        num_warps = wide_warps
    o_part, l_part = pl.pallas_call(
        kernel, grid=(b * g, rows, nsplit),
        out_shape=[jax.ShapeDtypeStruct((b, g, rows, nsplit, m, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, g, rows, nsplit, m), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="paged_decode_attention",
    )(*args)
    o, lse = combine_splits(o_part, l_part, axis=3)
    o, lse = unpack_rows(o, lse, nq, hg, qpb)
    return o.astype(q.dtype), lse


def paged_attention_gpu(q, k_pages, v_pages, page_table, q_positions, k_scale=None, v_scale=None, block_ids=None,
                        *, interpret=False, pages_per_split=None, num_warps=None, num_stages=None, loop=None,
                        sparse_pages_per_split=None, table: LaunchTable | None = None):
    """See ``_paged_attention``; launch parameters left as None come from ``table`` (None =
    ``gpu_config.DEFAULT_TABLE``): ``attn_warps`` / ``attn_warps_wide`` (an explicit ``num_warps``
    applies to every tile), ``attn_stages``, ``loop``, ``sparse_pps``, ``tile_rows``, ``sparse_tile``,
    ``tile_kernel``, ``wgmma_stages``, ``wgmma_pingpong``, ``union``."""
    table = DEFAULT_TABLE if table is None else table
    return _paged_attention(q, k_pages, v_pages, page_table, q_positions, k_scale, v_scale, block_ids,
                            interpret=interpret, pages_per_split=pages_per_split,
                            num_warps=num_warps or table.attn_warps,
                            wide_warps=None if num_warps else table.attn_warps_wide,
                            num_stages=num_stages or table.attn_stages, loop=loop or table.loop,
                            sparse_pages_per_split=(table.sparse_pps if sparse_pages_per_split is None
                                                    else sparse_pages_per_split),
                            tile_rows=table.tile_rows, sparse_tile=table.sparse_tile,
                            tile_kernel=table.tile_kernel, wgmma_stages=table.wgmma_stages,
                            wgmma_pingpong=table.wgmma_pingpong, union=table.union)
