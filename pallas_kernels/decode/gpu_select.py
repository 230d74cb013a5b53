"""MSA decode page selection on GPU (Pallas, Triton lowering): page scoring, then in-kernel top-k.

Math: MSA_SPEC.md section 5 (inputs validated by ``minimax_jax.ops.paged``). Caches are flattened so
a physical page ``p`` is the row range ``[p*page, (p+1)*page)`` and is gathered with a
data-dependent ``pl.ds(page_id * page, page)`` load.

``page_scores_gpu``: one program per (request, chunk of ``ppp`` logical pages), or with
``programs`` N >= 1 the persistent variant: N programs, each walking one contiguous range of the
flattened (request, page) work list. The index queries of all rows and groups of the request
(``Q * Hi`` rows, padded to >= 16 for the tensor cores) share the single index key, so one
``[R, Di] x [Di, page]`` product per page gives every row's token scores; the program keeps the max
over the page's tokens. Pages past the last row's local page are skipped (never read). fp8 index
keys are dequantised by a per-token scale applied to the scores. Launch defaults come from a table
keyed by the key dtype and a size class of the work (``gpu_config.LaunchTable.score``, ``SCORE_CLASSES``).

``select_pages_gpu``: the scoring kernel, then one selection program per (request, row x group)
that holds the row's page scores in registers and extracts the best page ``K - 1`` times (ties to
the lower id; forced pages first; the local page in the last valid slot): no sort, no XLA top-k.
A row whose local page is ``< K`` selects every page ``0..local`` (MSA == dense): its program writes
them without loading a score, and a request whose rows all do is not scored, so in a ragged batch
only the long requests pay for scoring and ranking.
With ``select_splits`` S > 1 the selection runs in two stages: S programs per row each take the
top-(K-1) of one slice of the row's pages, then one program per row takes the top-(K-1) of the S
candidate lists (exact: same ids as S = 1).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.common import from_byte_pairs, needs_byte_pairs, to_byte_pairs
from pallas_kernels.decode.common import compute_dtype, dot_nt, next_pow2, pad_positions, pad_rows
from pallas_kernels.decode.gpu_config import (DEFAULT_TABLE, EVICT, SCORE_STATIC, LaunchTable, pages_per_program,
                                              score_launch)

__all__ = ["page_scores_gpu", "select_pages_gpu"]


# ----------------------------------------------------------------------------- page scores

def _score_page(qi, pt_ref, ki_ref, ks_ref, b, p, *, page, scale, cdt, evict, byte_dtype=None):
    """Scores of logical page ``p`` of request ``b`` for every row: ``[R]`` f32, the max over the page's
    tokens of ``<qi, ki>`` (times the token's key scale when ``ks_ref`` is not None), times ``scale``.
    Both scoring kernels call this, so they compute the same products. ``byte_dtype``: ki_ref holds the
    1-byte keys as uint16 byte pairs (``common.to_byte_pairs``) of that dtype."""
    start = pt_ref[b, p] * page
    rows = pl.ds(start, page)
    if evict == "evict_normal":
        kb = ki_ref[rows, :]
    else:
        kb = pltriton.load(ki_ref.at[rows, :], eviction_policy=evict)
    if byte_dtype is not None:
        kb = from_byte_pairs(kb, byte_dtype)
    s = dot_nt(qi, kb.astype(cdt))                           # [R, page]
    if ks_ref is not None:
        s = s * ks_ref[rows][None, :]
    return jnp.max(s, axis=1) * scale


def _load_queries(qi_ref, b, rows, nqp, cdt):
    """Request b's index queries as score rows ``[rows, Di]`` (row ``h * nqp + q`` = ``qi[b, q, h]``; rows
    of padding queries or heads are 0), gathered by the kernel: ``qi_ref`` ``[B, Q, Hi, Di]``."""
    _, nq, hi, di = qi_ref.shape
    row = jax.lax.broadcasted_iota(jnp.int32, (rows, di), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (rows, di), 1)
    q, h = row % nqp, row // nqp
    ok = (q < nq) & (h < hi)
    x = pltriton.load(qi_ref.at[b, jnp.where(ok, q, 0), jnp.where(ok, h, 0), col], mask=ok, other=0)
    return x.astype(cdt)


def _pages_to_score(qpos_ref, b, *, page, n_pages, topk):
    """Pages request b scores: ``clip(max_q pos // page, 0, n_pages)``, 0 when ``topk`` is given and that is
    below it (its selection keeps every page); ``qpos_ref`` ``[B, Qp]`` int32 (padding rows -1)."""
    n = jnp.clip(jnp.max(qpos_ref[b, :]) // page, 0, n_pages)
    return n if topk is None else jnp.where(n < topk, 0, n)


def _score_kernel(pt_ref, qpos_ref, qi_ref, ki_ref, *rest, ppp, unroll, loop, rows, nqp, topk, **page_kw):
    """Chunked scoring: program (b, c) scores logical pages ``[c * ppp, (c + 1) * ppp)`` of request b (its
    page count and query rows from the positions and queries as given: no XLA work before the launch)."""
    ks_ref, o_ref = rest if len(rest) == 2 else (None, *rest)
    b = pl.program_id(0)
    c = pl.program_id(1)
    qi = _load_queries(qi_ref, b, rows, nqp, page_kw["cdt"])                  # [R, Di]
    n_pages = _pages_to_score(qpos_ref, b, page=page_kw["page"], n_pages=pt_ref.shape[1], topk=topk)
    last = jnp.maximum(n_pages - 1, 0)

    def body(j, carry):
        # ``unroll`` pages per iteration (more independent loads per iteration; the sweeps put it within
        # the run-to-run spread of unroll 1, the default). Slots past n_pages re-read the last needed
        # page (never an unallocated page id); their scores are junk.
        for u in range(unroll):
            p = c * ppp + j * unroll + u
            pc = jnp.minimum(p, last) if (unroll > 1 or loop != "dynamic") else p
            o_ref[b, :, p] = _score_page(qi, pt_ref, ki_ref, ks_ref, b, pc, **page_kw)
        return carry

    # Dynamic trip count (lowered to scf.for, software-pipelined): pages past n_pages are never read
    # (up to unroll - 1 clamped slots in the last iteration).
    # ("static": a fixed ppp-step loop re-reading the last needed page; outputs past n_pages are junk.)
    steps = ppp // unroll
    n_iter = (jnp.clip(n_pages - c * ppp, 0, ppp) + unroll - 1) // unroll if loop == "dynamic" else steps
    jax.lax.fori_loop(jnp.int32(0), jnp.asarray(n_iter, jnp.int32), body, 0)


def _score_persistent_kernel(pt_ref, n_ref, st_ref, qi_ref, ki_ref, *rest, programs, rows, nqp, **page_kw):
    """Persistent scoring: program i of ``programs`` scores the items ``[lo, hi)`` of the flattened work
    list of (request b, logical page j < n[b]) in request-major order (item ``st[b] + j``), in equal
    contiguous ranges of ``ceil(total / programs)`` items. One dynamic-trip-count (software-pipelined)
    loop per request the range touches, usually one: the pipeline prologue and epilogue are paid about
    once per program, and the request's index queries are loaded once per request, not once per chunk.
    ``n_ref`` / ``st_ref`` ``[Bp]`` int32 (Bp = B padded to a power of two with n = 0, st = total)."""
    ks_ref, o_ref = rest if len(rest) == 2 else (None, *rest)
    n_all, st_all = n_ref[...], st_ref[...]
    total = jnp.sum(n_all)
    chunk = (total + programs - 1) // programs
    lo = jnp.minimum(pl.program_id(0) * chunk, total)
    hi = jnp.minimum(lo + chunk, total)
    b_lo = jnp.sum((st_all + n_all <= lo).astype(jnp.int32))   # the first request ending after lo
    b_hi = jnp.sum((st_all < hi).astype(jnp.int32))            # one past the last starting before hi

    def request(b, carry):
        j_lo = jnp.maximum(lo - st_ref[b], 0)
        j_hi = jnp.minimum(hi - st_ref[b], n_ref[b])
        qi = _load_queries(qi_ref, b, rows, nqp, page_kw["cdt"])             # [R, Di]

        def body(i, c):
            j = j_lo + i
            o_ref[b, :, j] = _score_page(qi, pt_ref, ki_ref, ks_ref, b, j, **page_kw)
            return c

        jax.lax.fori_loop(jnp.int32(0), jnp.maximum(j_hi - j_lo, 0), body, 0)
        return carry

    jax.lax.fori_loop(b_lo, jnp.maximum(b_hi, b_lo), request, 0)


def _check_score_options(unroll, programs, evict):
    """Raises ValueError for a bad ``unroll`` / ``programs`` / ``evict`` of the scoring kernel."""
    if isinstance(unroll, bool) or not isinstance(unroll, int) or unroll < 1 or unroll & (unroll - 1):
        raise ValueError(f"unroll must be a power of two >= 1, got {unroll!r}")
    if isinstance(programs, bool) or not isinstance(programs, int) or programs < 0:
        raise ValueError(f"programs must be an int >= 0 (0 = chunked grid, N = persistent), got {programs!r}")
    if programs and unroll != 1:
        raise ValueError(f"the persistent scorer (programs={programs}) takes unroll 1, got {unroll}")
    if evict not in EVICT:
        raise ValueError(f"evict must be one of {EVICT}, got {evict!r}")


def _score_width(b: int, npg: int, ppp, unroll: int, programs: int) -> int:
    """Padded page width W of the raw scores: a power of two >= the pages the launch can write."""
    if programs:
        return next_pow2(npg)
    ppp = _resolve_ppp(ppp, b, npg, unroll)
    return next_pow2(-(-npg // ppp) * ppp)


def _page_scores_raw(qi, ki_pages, page_table, q_positions, ki_scale, *, interpret, ppp, num_warps, num_stages,
                     loop, unroll=1, f16=False, programs=0, evict="evict_normal", topk=None):
    """Raw page scores ``[B, R, W]`` float32, row ``h * nqp + q`` with ``nqp = next_pow2(Q)`` (group-major, so a
    group's rows are contiguous and the ids need no transpose; rows of q >= Q are padding), the max over each
    page's tokens of ``<qi, ki>/sqrt(Di)``.

    Only pages ``< max_i(pos_i // page)`` of each request are computed; the others hold garbage and
    must be masked by the caller (``select_from_page_scores`` does). With ``topk`` (an int), a request
    whose rows all have ``pos_i // page < topk`` (its selection keeps every page) is not scored at all.
    Args: qi ``[B, Q, Hi, Di]``; ki_pages ``[P, page, Di]``; page_table ``[B, NP]`` int32;
      q_positions ``[B, Q]`` int32; ki_scale ``[P, page]`` f32 or None; ppp: pages per program;
      num_warps / num_stages / loop ("dynamic" | "static"): launch variant;
      unroll: pages scored per loop iteration (a power of two; ppp is raised to at least unroll);
      f16: with fp8 index keys, convert them to float16 (exact for e4m3; sm_89+ has a paired
      e4m3 -> f16 convert instruction) instead of bf16 and run the product in f16 (index queries are
      rounded to f16: more mantissa than bf16, overflow past 65504); ignored for other key dtypes;
      programs: 0 = grid (B, ceil(NP / ppp)) of ``_score_kernel``; N >= 1 = grid (N,) of
      ``_score_persistent_kernel`` (ppp and loop unused, unroll must be 1; the work list's ranges are
      computed in the kernel from the per-request page counts and their prefix sums, B values);
      evict: L2 eviction policy of the key loads ("evict_normal" = plain loads).
    The per-page scores of both kernels are the same products (``_score_page``), bit for bit.
    Raises ValueError for a bad unroll / programs / evict (``_check_score_options``) or a ppp that is
    not a multiple of unroll.
    """
    _check_score_options(unroll, programs, evict)
    b, nq, hi, di = qi.shape
    n_phys, page, _ = ki_pages.shape
    npg = page_table.shape[1]
    cdt = compute_dtype(ki_pages.dtype)
    if f16 and jnp.dtype(ki_pages.dtype).itemsize == 1:
        cdt = jnp.dtype(jnp.float16)
    nqp = next_pow2(nq)
    r = max(16, next_pow2(hi * nqp))
    width = _score_width(b, npg, ppp, unroll, programs)
    keys = [qi, ki_pages.reshape(n_phys * page, di)]         # queries gathered into score rows in the kernel
    byte_dtype = None
    if needs_byte_pairs(ki_pages):      # int32 Triton offsets would overflow (common.needs_byte_pairs)
        keys[1], byte_dtype = to_byte_pairs(keys[1]), ki_pages.dtype
    if ki_scale is not None:
        keys.append(ki_scale.reshape(n_phys * page).astype(jnp.float32))
    page_kw = dict(page=page, scale=1.0 / math.sqrt(di), cdt=cdt, evict=evict, byte_dtype=byte_dtype, rows=r,
                   nqp=nqp)
    if programs:
        n_score = jnp.clip(jnp.max(q_positions, axis=1) // page, 0, npg).astype(jnp.int32)
        if topk is not None:
            n_score = jnp.where(n_score < topk, 0, n_score)  # every page selected: nothing to rank
        bp = next_pow2(b)
        starts = jnp.cumsum(n_score) - n_score               # first work-list item of each request
        total = jnp.sum(n_score)
        n_pad = jnp.zeros((bp,), jnp.int32).at[:b].set(n_score)
        st_pad = jnp.full((bp,), total, jnp.int32).at[:b].set(starts)
        kernel = functools.partial(_score_persistent_kernel, programs=programs, **page_kw)
        grid, args = (programs,), [page_table.astype(jnp.int32), n_pad, st_pad, *keys]
    else:
        ppp = _resolve_ppp(ppp, b, npg, unroll)
        kernel = functools.partial(_score_kernel, ppp=ppp, unroll=unroll, loop=loop, topk=topk, **page_kw)
        grid, args = (b, -(-npg // ppp)), [page_table.astype(jnp.int32), pad_positions(q_positions), *keys]
    return pl.pallas_call(
        kernel, grid=grid,
        out_shape=jax.ShapeDtypeStruct((b, r, width), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="msa_decode_page_scores",
    )(*args)


def _resolve_ppp(ppp, b: int, npg: int, unroll: int) -> int:
    """Pages per scoring program: ``ppp`` (None = enough programs to fill the GPU), at least ``unroll``;
    raises ValueError when it is not a multiple of ``unroll``."""
    if ppp is None:
        ppp = pages_per_program(b * npg, 264, 32)
    ppp = max(ppp, unroll)
    if ppp % unroll:
        raise ValueError(f"ppp ({ppp}) must be a multiple of unroll ({unroll})")
    return ppp


def _unpack_scores(raw, nq, hi, npg):
    """``[B, Hi, Q, NP]`` from raw scores ``[B, R, W]`` (row ``h * nqp + q``, ``_page_scores_raw``)."""
    b, nqp = raw.shape[0], next_pow2(nq)
    return raw[:, : hi * nqp, :npg].reshape(b, hi, nqp, npg)[:, :, :nq]


@functools.partial(jax.jit, static_argnames=("interpret", *SCORE_STATIC))
def _page_scores(qi, ki_pages, page_table, q_positions, ki_scale, *, interpret, **launch):
    """Raw page scores ``[B, Hi, Q, NP]`` float32 (see ``_page_scores_raw``)."""
    raw = _page_scores_raw(qi, ki_pages, page_table, q_positions, ki_scale, interpret=interpret, **launch)
    return _unpack_scores(raw, qi.shape[1], qi.shape[2], page_table.shape[1])


# ----------------------------------------------------------------------------- selection

_NO_ID = 1 << 30     # id of an unused candidate slot (above every page id)

#: Narrowest padded score row (pages) that the default ``select_splits`` applies to; narrower rows: S = 1.
SPLIT_MIN_WIDTH = 1024


def _extract_topk(x, ids, local, topk):
    """``[topk]`` int32: the ids of the best ``topk - 1`` finite-or-+inf entries of ``x`` (value desc,
    ties to the lower id; ``-inf`` entries are never taken), then ``local`` (when >= 0) in the first
    slot after them, ``-1`` after. ``x`` f32 and ``ids`` int32 have one shape (ids distinct, below
    ``_NO_ID``). Repeated max extraction in registers: no sort."""
    slot = jax.lax.broadcasted_iota(jnp.int32, (topk,), 0)
    out = jnp.full((topk,), -1, jnp.int32)
    n_valid = jnp.int32(0)
    for k in range(topk - 1):                                # best remaining, ties -> lowest id
        m = jnp.max(x)
        am = jnp.min(jnp.where(x == m, ids, jnp.int32(_NO_ID)))
        take = m > -jnp.inf
        out = jnp.where((slot == k) & take, am, out)
        n_valid = n_valid + take.astype(jnp.int32)
        x = jnp.where(ids == am, -jnp.inf, x)
    return jnp.where((slot == n_valid) & (local >= 0), local, out)


def _all_or_ranked(local, topk, ranked):
    """``[topk]`` int32 ids of one row: pages ``0..local`` ascending then ``-1`` when ``local < topk`` (the
    selection keeps every page: nothing is loaded or ranked; padding rows, ``local = -1``, get all ``-1``),
    else ``ranked()``."""
    def every_page():
        slot = jax.lax.broadcasted_iota(jnp.int32, (topk,), 0)
        return jnp.where(slot <= local, slot, -1)
    return jax.lax.cond(local < topk, every_page, ranked)


def _select_kernel(sc_ref, pos_ref, o_ref, *, page, topk, init_blocks, local_blocks, nqp):
    b = pl.program_id(0)
    r = pl.program_id(1)
    pos = pos_ref[b, r if nqp is None else r % nqp]
    local = jnp.where(pos >= 0, pos // page, -1)

    def ranked():
        x = sc_ref[b, r, :]                                  # [W] f32 (junk at and after local)
        ids = jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
        before = ids < local
        forced = before & ((ids < init_blocks) | (ids > local - local_blocks))
        x = jnp.where(forced, jnp.inf, jnp.where(before, x, -jnp.inf))
        return _extract_topk(x, ids, local, topk)

    o_ref[b, r, :] = _all_or_ranked(local, topk, ranked)


def _select_slice_kernel(sc_ref, pos_ref, v_ref, i_ref, *, page, n_ranked, kp, width, init_blocks, local_blocks,
                         nqp):
    """Stage A of the split top-k: program (b, r, s) ranks pages ``[s * width, (s + 1) * width)``.

    Same masks as ``_select_kernel`` on the global page ids (the local page and later pages are not
    "before", hence -inf and never taken); writes the slice's best ``n_ranked`` (value desc, id asc)
    as values ``v_ref[b, r, s] [kp]`` f32 and ids ``i_ref[b, r, s] [kp]`` int32, unused slots
    ``-inf`` / ``_NO_ID``. A slice starting at or after the local page, or a row whose selection keeps
    every page (``local <= n_ranked``), loads and ranks nothing (all slots unused).
    """
    b = pl.program_id(0)
    r = pl.program_id(1)
    s = pl.program_id(2)
    pos = pos_ref[b, r if nqp is None else r % nqp]
    local = jnp.where(pos >= 0, pos // page, -1)
    slot = jax.lax.broadcasted_iota(jnp.int32, (kp,), 0)

    def unused():
        return jnp.full((kp,), -jnp.inf, jnp.float32), jnp.full((kp,), _NO_ID, jnp.int32)

    def ranked():
        x = sc_ref[b, r, pl.ds(s * width, width)]            # [width] f32
        ids = s * width + jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
        before = ids < local
        forced = before & ((ids < init_blocks) | (ids > local - local_blocks))
        x = jnp.where(forced, jnp.inf, jnp.where(before, x, -jnp.inf))
        vals, out = unused()
        for k in range(n_ranked):                            # best remaining, ties -> lowest id
            m = jnp.max(x)
            am = jnp.min(jnp.where(x == m, ids, jnp.int32(_NO_ID)))
            put = (slot == k) & (m > -jnp.inf)
            vals = jnp.where(put, m, vals)
            out = jnp.where(put, am, out)
            x = jnp.where(ids == am, -jnp.inf, x)
        return vals, out

    vals, out = jax.lax.cond((local <= n_ranked) | (s * width >= local), unused, ranked)
    v_ref[b, r, s, :] = vals
    i_ref[b, r, s, :] = out


def _select_merge_kernel(v_ref, i_ref, pos_ref, o_ref, *, page, topk, nqp):
    """Stage B of the split top-k: program (b, r) extracts the best ``topk - 1`` of the row's
    ``S * kp`` candidates (value desc, id asc: forced ``+inf`` pages first in ascending id) and puts
    the local page after the last valid one, exactly as ``_select_kernel``."""
    b = pl.program_id(0)
    r = pl.program_id(1)
    pos = pos_ref[b, r if nqp is None else r % nqp]
    local = jnp.where(pos >= 0, pos // page, -1)

    def ranked():
        x = v_ref[b, r, :]                                   # [S * kp] f32
        ids = i_ref[b, r, :]                                 # [S * kp] int32 (global page ids)
        return _extract_topk(x, ids, local, topk)

    o_ref[b, r, :] = _all_or_ranked(local, topk, ranked)


def _select_warps(width: int) -> int:
    """Warps of a selection program over ``width`` scores: one up to 512 (each of the ``K - 1`` extractions
    reduces with warp shuffles alone, no shared-memory round trip), 8 from 4,096, else 4."""
    return 1 if width <= 512 else 8 if width >= 4096 else 4


def _auto_select_splits(b: int, rows: int, width: int) -> int:
    """``select_splits="auto"``: the largest power of two S with ``width / S >= 512`` pages per slice
    and ``b * rows * S <= 4096`` stage-A programs (1 when ``width < 1024``)."""
    s = 1
    while width // (2 * s) >= 512 and b * rows * 2 * s <= 4096:
        s *= 2
    return s


def _resolve_select_splits(splits, b: int, rows: int, width: int) -> int:
    """Slices per score row for ``_select_rows``; raises ValueError for a bad value."""
    if splits == "auto":
        return _auto_select_splits(b, rows, width)
    if isinstance(splits, bool) or not isinstance(splits, int) or splits < 1 or splits & (splits - 1):
        raise ValueError(f"select_splits must be a power of two >= 1 or 'auto', got {splits!r}")
    if splits > width:
        raise ValueError(f"select_splits ({splits}) exceeds the padded score width ({width} pages): "
                         f"at most {width} slices of one page each")
    return splits


def _select_rows(raw, pos, *, n_rows, page, topk, init_blocks, local_blocks, interpret, splits=1, nqp=None):
    """Top-(K-1) selection plus the local page from raw page scores.

    Args: raw ``[B, R, W]`` f32 page scores (only pages before each row's local page are read:
      the rest may hold junk); pos ``[B, R]`` int32 row positions (-1 = padding row), or with ``nqp``
      ``[B, nqp]`` query positions, row ``r`` at ``pos[b, r % nqp]`` (rows ``h * nqp + q``); n_rows: rows
      ``< n_rows`` are selected (the rest are padding); splits: ``select_splits`` (a power of two
      ``<= W``, or "auto", see ``_auto_select_splits``). S = 1: one program per row holds the whole
      row (``_select_kernel``). S > 1: stage A, grid (B, n_rows, S), takes each slice's top-(K-1)
      as ``[B, n_rows, S, KP]`` f32 values / int32 ids (KP = next power of two >= K - 1); stage B,
      grid (B, n_rows), takes the top-(K-1) of the ``S * KP`` candidates. Exact: under the strict
      total order (value desc, id asc) every member of the row's top-(K-1) has fewer than K - 1
      better pages in its own slice, so it is among that slice's candidates, and the top-(K-1) of
      a subset holding the global top-(K-1) is the global top-(K-1) (in the same order; valid
      counts equal too, so the local page lands in the same slot).
    Returns: ``[B, n_rows, K]`` int32 logical page ids (forced pages first in ascending id, then by
      score, the local page in the last valid slot, -1 after).
    Raises ValueError for a bad ``splits``.
    """
    b, _, width = raw.shape
    s = _resolve_select_splits(splits, b, n_rows, width)
    if s == 1:
        kernel = functools.partial(_select_kernel, page=page, topk=topk, init_blocks=init_blocks,
                                   local_blocks=local_blocks, nqp=nqp)
        ids = pl.pallas_call(
            kernel, grid=(b, n_rows),
            out_shape=jax.ShapeDtypeStruct((b, n_rows, topk), jnp.int32),
            compiler_params=pltriton.CompilerParams(num_warps=_select_warps(width), num_stages=1),
            interpret=interpret, name="msa_decode_select_topk",
        )(raw, pos)
        return ids
    wp = next_pow2(width)                                    # W is a power of two today; pad otherwise
    if wp != width:
        raw = pad_rows(raw, 2, wp, -jnp.inf)
    ws = wp // s
    kp = next_pow2(topk - 1)
    kernel = functools.partial(_select_slice_kernel, page=page, n_ranked=topk - 1, kp=kp, width=ws,
                               init_blocks=init_blocks, local_blocks=local_blocks, nqp=nqp)
    vals, cids = pl.pallas_call(
        kernel, grid=(b, n_rows, s),
        out_shape=[jax.ShapeDtypeStruct((b, n_rows, s, kp), jnp.float32),
                   jax.ShapeDtypeStruct((b, n_rows, s, kp), jnp.int32)],
        compiler_params=pltriton.CompilerParams(num_warps=_select_warps(ws), num_stages=1),
        interpret=interpret, name="msa_decode_select_topk_slices",
    )(raw, pos)
    kernel = functools.partial(_select_merge_kernel, page=page, topk=topk, nqp=nqp)
    return pl.pallas_call(
        kernel, grid=(b, n_rows),
        out_shape=jax.ShapeDtypeStruct((b, n_rows, topk), jnp.int32),
        compiler_params=pltriton.CompilerParams(num_warps=_select_warps(s * kp), num_stages=1),
        interpret=interpret, name="msa_decode_select_topk_merge",
    )(vals.reshape(b, n_rows, s * kp), cids.reshape(b, n_rows, s * kp), pos)


@functools.partial(jax.jit, static_argnames=("page", "topk", "init_blocks", "local_blocks", "interpret",
                                             "select_splits", *SCORE_STATIC))
def _select(qi, ki_pages, page_table, q_positions, ki_scale, *, page, topk, init_blocks, local_blocks,
            interpret, select_splits=1, **launch):
    """Page scores (``_page_scores_raw`` with the ``launch`` options; requests whose selection keeps every
    page are not scored) then ``_select_rows``: ids ``[B, Hi, Q, K]`` int32."""
    b, nq, hi, _ = qi.shape
    raw = _page_scores_raw(qi, ki_pages, page_table, q_positions, ki_scale, interpret=interpret, topk=topk,
                           **launch)   # [B, R, W]
    nqp = next_pow2(nq)
    ids = _select_rows(raw, pad_positions(q_positions), n_rows=hi * nqp, page=page, topk=topk,   # row h * nqp + q
                       init_blocks=init_blocks, local_blocks=local_blocks, interpret=interpret,
                       splits=select_splits, nqp=nqp)
    return ids.reshape(b, hi, nqp, topk)[:, :, :nq]       # no transpose: the rows are group-major


def page_scores_gpu(qi, ki_pages, page_table, q_positions, ki_scale=None, *, interpret=False, ppp=None,
                    num_warps=None, num_stages=None, loop=None, unroll=None, f16=None, programs=None, evict=None,
                    size_class=None, table: LaunchTable | None = None):
    """See ``_page_scores_raw``: raw page scores ``[B, Hi, Q, NP]`` f32. Launch parameters left as None
    come from ``table.score`` (None = ``gpu_config.DEFAULT_TABLE``) for the key dtype and ``size_class``
    (None = the size class of B * NP; see ``score_launch``)."""
    launch = score_launch(ki_pages.dtype, ppp, num_warps, num_stages, loop, unroll, f16,
                           total_pages=qi.shape[0] * page_table.shape[1], size_class=size_class,
                           programs=programs, evict=evict, table=table)
    return _page_scores(qi, ki_pages, page_table, q_positions, ki_scale, interpret=interpret, **launch)


def select_pages_gpu(qi, ki_pages, page_table, q_positions, ki_scale=None, *, topk, init_blocks=0, local_blocks=1,
                     interpret=False, ppp=None, num_warps=None, num_stages=None, loop=None, unroll=None,
                     f16=None, programs=None, evict=None, size_class=None, select_splits=None,
                     table: LaunchTable | None = None):
    """Page scoring plus in-kernel top-(K-1) selection: logical page ids ``[B, Hi, Q, K]`` int32.

    Args: qi ``[B, Q, Hi, Di]``; ki_pages ``[P, page, Di]``; page_table ``[B, NP]`` int32;
      q_positions ``[B, Q]`` int32 (-1 = padding row); ki_scale ``[P, page]`` f32 or None; topk,
      init_blocks, local_blocks: as ``minimax_jax.ops.paged.msa_decode_select``; ppp ... evict: the
      scoring kernel's launch (``_page_scores_raw``; None = the ``table.score`` entry of the key
      dtype and ``size_class``, itself None = the size class of B * NP; see ``score_launch``);
      select_splits: slices per score row of the selection, a power of two S (at most the padded page
      width W) or "auto"; None = ``table.select_splits`` where W >= ``SPLIT_MIN_WIDTH``, else 1. S = 1:
      one program per (request, row x group) keeps the row's page scores in registers and extracts the
      maximum ``K - 1`` times (no sort). S > 1: S programs per row each select from ``W / S`` pages,
      then one program per row merges the ``S`` candidate lists (``_select_rows``); the ids are
      exactly those of S = 1 for every input (ties included);
      table: the launch defaults (``gpu_config.LaunchTable``; None = ``gpu_config.DEFAULT_TABLE``).
    Returns the same sets as ``minimax_jax.ops.paged.select_from_page_scores``. A row whose local page
    is ``< topk`` keeps every page: ids ``0..local`` ascending, no score computed or ranked (and a
    request whose rows all do is not scored). Other rows: that function's order (forced pages first in
    ascending id, then by score descending with ties to the lower id, the local page in the last valid
    slot, ``-1`` after).
    Raises ValueError for a bad ``select_splits`` (not a power of two >= 1 / "auto", or above W), a bad
    scoring launch (``_check_score_options``) or an unknown ``size_class``.
    """
    table = DEFAULT_TABLE if table is None else table
    npg = page_table.shape[1]
    launch = score_launch(ki_pages.dtype, ppp, num_warps, num_stages, loop, unroll, f16,
                           total_pages=qi.shape[0] * npg, size_class=size_class, programs=programs, evict=evict,
                           table=table)
    _check_score_options(launch["unroll"], launch["programs"], launch["evict"])
    if select_splits is None:
        # The default applies to rows of at least SPLIT_MIN_WIDTH pages; narrower rows are ranked by one
        # program each (the two-stage form's second launch costs more than it saves there).
        select_splits = table.select_splits
        width = _score_width(qi.shape[0], npg, launch["ppp"], launch["unroll"], launch["programs"])
        if width < SPLIT_MIN_WIDTH:
            select_splits = 1
        elif isinstance(select_splits, int) and not isinstance(select_splits, bool):
            select_splits = min(select_splits, width)         # at most one slice per page
    return _select(qi, ki_pages, page_table, q_positions, ki_scale, page=ki_pages.shape[1], topk=topk,
                   init_blocks=init_blocks, local_blocks=local_blocks, interpret=interpret,
                   select_splits=select_splits, **launch)
