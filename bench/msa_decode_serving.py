"""The serving sweep of ``bench/msa_decode.py --serving``: MSA decode vs dense paged decode at serving's shapes.

A cell is (batch B, context C, query rows Q, index-key dtype). Request ``b``'s length ``L_b`` is drawn
uniformly from ``[0.75 C, 1.25 C]`` tokens (seeded by ``seed``, B and C; at least 16), its Q rows sit at
positions ``L_b - Q .. L_b - 1`` (Q = 8: 1 main + 7 MTP draft rows). The page table is ``ceil(max L_b / PAGE)``
pages wide (entries past a request's own pages hold page 0), its pages shuffled over the physical cache, with
``msa_decode.case_sizes``' replicas (disjoint tables rotated per step so the L2 never holds the data).
Per (B, C, Q) and attention tiling (``TILINGS``: the run's launch table with other ``tile_rows`` /
``sparse_tile``; ``--serving-tilings``, default "default,legacy": shared 128-row tiles vs the former 64-row /
per-row tiles), timed in one run: dense ``paged_attention`` and ``msa_decode`` (top-K) over bf16 and over fp8
e4m3 index keys, each through ``msa_decode.unrolled`` / ``msa_decode.timeit`` (``--steps`` steps per call;
ms per decode step); a cell's ``tiling`` names its tiling. ``msa_path`` is the op's ``msa_decode.path`` record of
that trace: ``dense`` (table at most K pages wide: no scoring), ``sparse`` (GPU kernels: requests that select
every page unscored, see ``msa_decode``), or ``cond`` (``runtime_dense_check``).
``serving_check`` runs first: MSA == dense where every page is selected, and MSA vs the XLA reference.
Order: the ``first`` cells, then the grid (contexts outer, batches inner); a (B, C, Q) starts only while
``budget_s`` is left (the one running may overrun it); a cell whose cache exceeds ``mem_gib`` is skipped.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import msa_decode as md
from minimax_jax.ops import paged as ops
from minimax_jax.ops.registry import clear_implementation_report, implementation_report

SPREAD = 0.25
#: Issue 34's table cells (batch x context), timed before the grid.
FIRST = "128x1024,64x4096,128x5120,32x10240,8x102400,32x204800"
#: Attention tilings the sweep can time side by side: ``LaunchTable`` fields over the run's table.
TILINGS = {"default": {}, "legacy": dict(tile_rows=64, sparse_tile="per_row"), "rows64": dict(tile_rows=64),
           "per_row": dict(sparse_tile="per_row"), "warps4": dict(attn_warps_wide=4), "stages3": dict(attn_stages=3),
           "stages4": dict(attn_stages=4), "warps4_stages3": dict(attn_warps_wide=4, attn_stages=3),
           "pps8": dict(sparse_pps=8), "pps2": dict(sparse_pps=2), "wgmma": dict(tile_kernel="wgmma"),
           "triton": dict(tile_kernel="triton"),
           "wgmma_nopp": dict(tile_kernel="wgmma", wgmma_pingpong=False), "xla_union": dict(union="xla")}


def tiling_tables(names, table):
    """``{name: LaunchTable}``: each ``TILINGS`` entry over ``table`` (None = ``DEFAULT_TABLE``); raises
    ValueError for an unknown name."""
    from pallas_kernels.decode.gpu_config import DEFAULT_TABLE
    if unknown := [n for n in names if n not in TILINGS]:
        raise ValueError(f"unknown tilings {unknown}; known: {list(TILINGS)}")
    base = DEFAULT_TABLE if table is None else table
    return {n: dataclasses.replace(base, **TILINGS[n]) for n in names}


# ----------------------------------------------------------------------------- cells

def request_lengths(b, ctx, seed):
    """``[b]`` int64 token counts, uniform in ``[0.75 ctx, 1.25 ctx]`` (at least 16), seeded by (seed, b, ctx)."""
    rng = np.random.default_rng([seed, b, ctx])
    lo, hi = max(16, int(ctx * (1 - SPREAD))), max(16, int(ctx * (1 + SPREAD)))
    return rng.integers(lo, hi + 1, size=b)


def layout(b, ctx, min_steps, seed, l2_bytes, min_width=0):
    """Sizes of one (batch, context) cell, nothing allocated: lengths, pages per request, table width
    (at least ``min_width``), replicas / steps per call (``md.case_sizes``), physical pages, cache GiB."""
    lens = request_lengths(b, ctx, seed)
    pages = -(-lens // md.PAGE)
    _, reps, steps, _ = md.case_sizes(b, ctx, min_steps, l2_bytes)
    p = reps * int(pages.sum()) + 1
    return dict(batch=b, context=ctx, lengths=lens, pages=pages, width=max(int(pages.max()), min_width),
                replicas=reps, steps_per_call=steps, phys_pages=p, cache_gib=p * md.PAGE * md.TOKEN_BYTES / md.GIB)


def page_tables(lay, seed):
    """``[replicas, B, width]`` int32: each request's pages a shuffled, disjoint set of physical pages
    ``1..P-1`` over all replicas; entries past a request's pages hold 0."""
    reps, b, w = lay["replicas"], lay["batch"], lay["width"]
    rng = np.random.default_rng([seed, b, lay["context"], 1])
    used = np.broadcast_to(np.arange(w)[None, None, :] < lay["pages"][None, :, None], (reps, b, w))
    t = np.zeros((reps, b, w), np.int32)
    t[used] = rng.permutation(np.arange(1, lay["phys_pages"]))
    return t


def positions(lens, nq):
    """``[B, nq]`` int32: request b's rows at ``lens[b] - nq .. lens[b] - 1``."""
    return (np.asarray(lens)[:, None] - nq + np.arange(nq)[None]).astype(np.int32)


def queries(key, lead, b, nq, row_corr=0.0):
    """bf16 queries ``[*lead, B, nq, H, D]`` and index queries ``[*lead, B, nq, G, DI]``. ``row_corr``: the
    correlation of a request's Q rows' index queries (0 = independent rows; MTP draft rows are consecutive
    tokens, whose index queries and selections overlap), ``c * shared + sqrt(1 - c^2) * own``."""
    k1, k2, k3 = jax.random.split(key, 3)
    qi = jax.random.normal(k2, (*lead, b, nq, md.G, md.DI), jnp.float32)
    if row_corr:
        shared = jax.random.normal(k3, (*lead, b, 1, md.G, md.DI), jnp.float32)
        qi = row_corr * shared + (1.0 - row_corr ** 2) ** 0.5 * qi
    return jax.random.normal(k1, (*lead, b, nq, md.H, md.D), jnp.bfloat16), qi.astype(jnp.bfloat16)


# ----------------------------------------------------------------------------- correctness

def _path():
    """The ``msa_decode`` path(s) traced since the report was last cleared (callers clear it before the call)."""
    return implementation_report().get("msa_decode.path")


def serving_check(impl, table=None, seed=0):
    """``impl``'s ``msa_decode`` on ragged Q = 8 batches (3 requests, shuffled pages); returns a dict with ``ok``.

    ``all_pages_*``: contexts of 1200-2000 tokens (every row's page < K, so every page is selected) with a
    K + 4 pages wide table: jitted MSA (the sparse path) vs dense ``paged_attention``, each row's ids
    ``0..local``; eager MSA must take the dense path. ``{bf16,fp8}_*``: contexts of 2250-3750 tokens vs
    ``implementation="xla"``: id-set mismatch rows (b, g, q) (at most 1: near ties), o / lse max errors
    over the (b, q) rows whose ids match in every group."""
    res = {}
    msa = jax.jit(lambda im, q, qi, kp, vp, ki, ks, pt, pos: ops.msa_decode(
        q, qi, kp, vp, ki, pt, pos, ki_scale=ks, topk=md.K, implementation=im, launch_table=table),
        static_argnums=0)
    for name, ctx, min_width in (("all_pages", 1600, md.K + 4), ("select", 3000, 0)):
        lay = layout(3, ctx, 1, seed, 1, min_width)
        kp, vp, kib, ki8, ks8 = md.make_cache(lay["phys_pages"])
        pt = jnp.asarray(page_tables(lay, seed)[0])
        pos = jnp.asarray(positions(lay["lengths"], 8))
        q, qi = queries(jax.random.PRNGKey(seed + ctx), (), 3, 8)
        if name == "all_pages":
            o_d, l_d = jax.jit(lambda q, kp, vp, pt, pos: ops.paged_attention(
                q, kp, vp, pt, pos, implementation=impl, launch_table=table))(q, kp, vp, pt, pos)
            clear_implementation_report()
            o, lse, ids = msa(impl, q, qi, kp, vp, kib, None, pt, pos)
            res["all_pages_jit_path"] = _path()
            clear_implementation_report()
            ops.msa_decode(q, qi, kp, vp, kib, pt, pos, topk=md.K, implementation=impl, launch_table=table)
            res["all_pages_eager_path"] = _path()
            local = np.asarray(pos)[:, None, :, None] // md.PAGE
            want = np.where(np.arange(md.K) <= local, np.arange(md.K), -1)
            res["all_pages_ids_ok"] = bool(np.array_equal(np.sort(np.asarray(ids), -1),
                                                          np.sort(np.broadcast_to(want, ids.shape), -1)))
            res.update(_errors("all_pages", o, lse, o_d, l_d, np.ones(pos.shape, bool)))
            continue
        for label, ki, ks in (("bf16", kib, None), ("fp8", ki8, ks8)):
            o_r, l_r, ids_r = msa("xla", q, qi, kp, vp, ki, ks, pt, pos)
            clear_implementation_report()
            o, lse, ids = msa(impl, q, qi, kp, vp, ki, ks, pt, pos)
            res[f"{label}_path"] = _path()
            same = np.all(np.sort(np.asarray(ids), -1) == np.sort(np.asarray(ids_r), -1), -1)   # [B, G, Q]
            res[f"{label}_set_mismatch_rows"] = int(np.sum(~same))
            res.update(_errors(label, o, lse, o_r, l_r, np.all(same, 1)))
    ok = (res["all_pages_jit_path"] == "sparse" and res["all_pages_eager_path"] == "dense"
          and res["all_pages_ids_ok"]
          and all(res[f"{x}_set_mismatch_rows"] <= 1 for x in ("bf16", "fp8"))
          and all(res[f"{x}_o_maxerr"] < 3e-2 and res[f"{x}_lse_maxerr"] < 1e-2 and res[f"{x}_finite"]
                  for x in ("all_pages", "bf16", "fp8")))
    res["ok"] = bool(ok)
    return res


def _errors(label, o, lse, o_ref, lse_ref, rows):
    """Max |o - o_ref| and |lse - lse_ref| over the (b, q) ``rows`` [B, Q] bool; o finite everywhere."""
    o, o_ref = (np.asarray(x, np.float32) for x in (o, o_ref))
    lse, lse_ref = np.asarray(lse), np.asarray(lse_ref)
    return {f"{label}_o_maxerr": float(np.max(np.abs(o - o_ref)[rows], initial=0.0)),
            f"{label}_lse_maxerr": float(np.max(np.abs(lse - lse_ref)[rows], initial=0.0)),
            f"{label}_finite": bool(np.all(np.isfinite(o)))}


# ----------------------------------------------------------------------------- timing

def time_unit(lay, cache, tables, nq, impl, table, seed, runtime_dense_check=False, tilings=None, profile_dir=None,
              row_corr=0.0, unroll=None):
    """Dense and MSA (bf16, fp8 index keys) at one (B, C, Q) under each tiling of ``tilings`` (``{name:
    LaunchTable}``; None = ``{"default": table}``): one cell per (tiling, index dtype). ``profile_dir``:
    then one more call of dense and MSA bf16 (first tiling) under ``jax.profiler``, the device ms per step
    of their busiest ops under the cells' ``"profile"``. ``unroll``: steps per loop iteration of a timed call
    (``md.unrolled``; None = ``md.STEP_UNROLL``)."""
    b, steps, reps = lay["batch"], lay["steps_per_call"], lay["replicas"]
    kp, vp, kib, ki8, ks8 = cache
    q, qi = queries(jax.random.PRNGKey(seed * 1000003 + b * 131 + lay["context"] + nq), (steps,), b, nq, row_corr)
    pos = jnp.asarray(positions(lay["lengths"], nq))
    lens = lay["lengths"]
    cells = []
    for name, tt in (tilings or {"default": table}).items():
        fns = md.step_fns(impl, tt, runtime_dense_check)
        t_d, n_d = md.timeit(md.unrolled(fns["dense"], steps, reps, unroll), q, qi, kp, vp, kib, None, pos, tables)
        common = dict(batch=b, context=lay["context"], q_rows=nq, tiling=name, len_min=int(lens.min()),
                      len_mean=float(lens.mean()), len_max=int(lens.max()), table_pages=lay["width"], replicas=reps,
                      steps_per_call=steps, cache_gib=lay["cache_gib"], dense_ms=t_d / steps * 1e3, dense_calls=n_d,
                      row_corr=row_corr)
        for label, ki, ks in (("bf16", kib, None), ("fp8", ki8, ks8)):
            clear_implementation_report()
            t, n = md.timeit(md.unrolled(fns["msa"], steps, reps, unroll), q, qi, kp, vp, ki, ks, pos, tables)
            cells.append(dict(common, index_dtype=label, msa_ms=t / steps * 1e3, msa_calls=n,
                              speedup=t_d / t, msa_path=_path()))
        if profile_dir and name == next(iter(tilings or {"default": None})):
            runs = {n: (md.unrolled(fns[n], steps, reps, unroll), (q, qi, kp, vp, kib, None, pos, tables))
                    for n in ("dense", "msa")}
            rows = md.profile_cases(runs, steps, os.path.join(profile_dir, f"b{b}_c{lay['context']}_q{nq}"))
            for c in cells:
                c["profile"] = {n: r[:6] for n, r in rows.items()}
    return cells


def cell_order(batches, contexts, first):
    """The ``first`` (batch, context) cells, then the grid (contexts outer, batches inner), each once."""
    order = []
    for c in list(first) + [(b, ctx) for ctx in contexts for b in batches]:
        if c not in order:
            order.append(c)
    return order


def run_sweep(order, qs, min_steps, impl, table, mem_gib, budget_s=None, seed=0, runtime_dense_check=False,
              l2_bytes=200 * 1024 * 1024, on_unit=None, tilings=None, profile_dir=None, row_corr=0.0, unroll=None):
    """Time ``order``'s (batch, context) cells at each Q of ``qs`` under each of ``tilings`` (see ``time_unit``).
    Returns ``(cells, skipped, wall_s)``;
    skipped: dicts (batch, context, q_rows or None = every Q, reason): cache over ``mem_gib``, budget
    spent, or the error of a unit that failed (e.g. out of memory). ``on_unit(cells, skipped)`` after each
    (B, C, Q)."""
    t0 = time.perf_counter()
    cells, skipped = [], []

    def skip(b, ctx, nq, reason):
        skipped.append(dict(batch=b, context=ctx, q_rows=nq, reason=reason))
        print("serving skip", json.dumps(skipped[-1]), flush=True)

    def spent():
        return budget_s is not None and time.perf_counter() - t0 >= budget_s

    for b, ctx in order:
        lay = layout(b, ctx, min_steps, seed, l2_bytes)
        if lay["cache_gib"] > mem_gib:
            skip(b, ctx, None, f"cache {lay['cache_gib']:.1f} GiB > --mem-gib {mem_gib}")
            continue
        if spent():
            skip(b, ctx, None, f"--serving-budget-s {budget_s} spent")
            continue
        try:
            cache = md.make_cache(lay["phys_pages"])
            tables = jnp.asarray(page_tables(lay, seed))
        except Exception as e:  # e.g. out of memory: record and go on
            skip(b, ctx, None, _reason(e))
            continue
        for nq in qs:
            if spent():
                skip(b, ctx, nq, f"--serving-budget-s {budget_s} spent")
                continue
            t_unit = time.perf_counter()
            try:
                new = time_unit(lay, cache, tables, nq, impl, table, seed, runtime_dense_check, tilings,
                                profile_dir, row_corr, unroll)
            except Exception as e:
                skip(b, ctx, nq, _reason(e))
                continue
            for c in new:
                c["wall_s"] = time.perf_counter() - t_unit
                print("serving", json.dumps(c), flush=True)
            cells += new
            if on_unit:
                on_unit(cells, skipped)
        del cache, tables
    return cells, skipped, time.perf_counter() - t0


def _reason(e):
    return f"{type(e).__name__}: " + "".join(ch for ch in str(e) if 32 <= ord(ch) < 127)[:600]


def format_table(cells, skipped, check_ok):
    """The sweep's table, one line per (B, C, Q, tiling) (bf16 and fp8 index keys side by side; ``/ Q=1`` = dense
    ms over the same cell's and tiling's dense ms at Q = 1), then per tiling after the first the geometric mean
    of its dense and MSA ms over the first tiling's in the cells both have, then the skipped cells."""
    lines = [f"serving sweep (check ok={check_ok}; ms per decode step; x = dense ms / MSA ms; path = msa_decode.path)",
             f"{'B':>4} {'ctx':>7} {'Q':>2} {'tiling':>8} {'lens':>13} {'dense ms':>9} {'/ Q=1':>6} {'msa16 ms':>9} "
             f"{'x bf16':>7} {'msa8 ms':>8} {'x fp8':>7} {'path':>6}"]
    by = {}
    for c in cells:
        by.setdefault((c["batch"], c["context"], c["q_rows"], c.get("tiling", "default")), {})[c["index_dtype"]] = c
    nan = dict(msa_ms=float("nan"), speedup=float("nan"), msa_path="-")
    for (b, ctx, nq, tl), d in by.items():
        c16, c8 = d.get("bf16", nan), d.get("fp8", nan)
        any_c = d.get("bf16") or d["fp8"]
        q1 = next(iter(by.get((b, ctx, 1, tl), {}).values()), None)    # dense ms at Q = 1 of the same cell
        vs_q1 = any_c["dense_ms"] / q1["dense_ms"] if q1 else float("nan")
        lens = f"{any_c['len_min']}-{any_c['len_max']}"
        lines.append(f"{b:>4} {ctx:>7} {nq:>2} {tl:>8} {lens:>13} {any_c['dense_ms']:>9.3f} {vs_q1:>6.2f} "
                     f"{c16['msa_ms']:>9.3f} {c16['speedup']:>7.2f} {c8['msa_ms']:>8.3f} {c8['speedup']:>7.2f} "
                     f"{any_c['msa_path']:>6}")
    lines += tiling_summary(cells)
    for s in skipped:
        q = "all Q" if s["q_rows"] is None else f"Q={s['q_rows']}"
        lines.append(f"serving skipped: {s['batch']}x{s['context']} {q}: {s['reason']}")
    return "\n".join(lines)


def tiling_summary(cells):
    """Lines ``tiling T vs F: dense x.xx, msa x.xx (n cells)``: geometric means of T's ms over the first
    tiling F's ms (below 1 = T faster) over the (B, C, Q, index dtype) cells both timed."""
    names = list(dict.fromkeys(c.get("tiling", "default") for c in cells))
    key = lambda c: (c["batch"], c["context"], c["q_rows"], c["index_dtype"])
    first = {key(c): c for c in cells if c.get("tiling", "default") == names[0]} if names else {}
    lines = []
    for name in names[1:]:
        pairs = [(c, first[key(c)]) for c in cells if c.get("tiling", "default") == name and key(c) in first]
        if pairs:
            gm = lambda f: float(np.exp(np.mean([np.log(f(a) / f(b)) for a, b in pairs])))
            lines.append(f"tiling {name} vs {names[0]}: dense {gm(lambda c: c['dense_ms']):.3f}, "
                         f"msa {gm(lambda c: c['msa_ms']):.3f} ({len(pairs)} cells; < 1 = {name} faster)")
    return lines
