"""Shared pieces of the MSA Mosaic TPU kernels: the SMEM table budget, chunk loops, slot / entry tables.

SMEM bound (by construction, any B, T, S, G, K): every pallas_call of tpu_attention.py, tpu_kl.py
and tpu_indexer.py gets its scalar-prefetch tables as 1-D int32 arrays (no 2-D tile padding) holding
at most ``TABLE_WORDS`` = 61,440 words (240 KiB) of data; with up to 2 KiB of alignment per table
(at most 8 tables) a call stays under 256 KiB, a quarter of the 1 MiB SMEM of TPU v4 and later.
Query-outer calls (attention fwd / dq, KL fwd / d qi) take ``query_chunk`` tokens of one batch row;
KV-outer calls (dk / dv, d ki) take ``entry_window`` entries of the tile-sorted selection list; the
indexer takes ``TABLE_WORDS // 2`` row tiles. The calls run inside one ``lax.fori_loop`` per op,
so the lowered program does not grow with T; outputs are full-size buffers threaded through the
loop and aliased in place (``input_output_aliases``), every call writing only its own blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.msa import layout

__all__ = ["TABLE_WORDS", "query_chunk", "chunk_origin", "group_heads", "dot", "dot_t",
           "slot_index", "query_tables", "query_loop", "entry_window", "sorted_entries", "window",
           "aliased"]

TABLE_WORDS = 60 * 1024


def dot_t(a, b):
    """a [M, K] @ b[N, K]^T -> [M, N] f32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def dot(a, b):
    """a [M, K] @ b[K, N] -> [M, N] f32."""
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def aliased():
    """BlockSpec of an output buffer passed in only to be aliased to the output (never read)."""
    return pl.BlockSpec(memory_space=pl.ANY)


def group_heads(x, g, m):
    """[B, T, H, ...] -> [B, T, G, m, ...] (the H/G heads of each group, zero-padded to m rows)."""
    bsz, t, h = x.shape[:3]
    hg = h // g
    x = x.reshape(bsz, t, g, hg, *x.shape[3:])
    if m != hg:
        widths = [(0, 0)] * x.ndim
        widths[3] = (0, m - hg)
        x = jnp.pad(x, widths)
    return x


# ----------------------------------------------------------------------------- query-outer chunks

def query_chunk(t: int, g: int, k: int) -> int:
    """Tokens per query-outer call: tables hold 2 + tc * (5 * G * K + 2) words <= TABLE_WORDS."""
    per_token = 5 * g * k + 2
    tc = (TABLE_WORDS - 2) // per_token
    assert tc >= 1, f"G * K = {g * k} too large for the SMEM table budget"
    return min(t, tc)


def chunk_origin(i, n_chunks: int, chunk: int, total: int):
    """(batch row, first index) of chunk i of a loop over B * n_chunks chunks of ``chunk`` items.

    The last chunk of a row starts at total - chunk (it overlaps its predecessor and recomputes
    identical values) so no input needs padding."""
    b = i // n_chunks
    start = jnp.minimum((i % n_chunks) * chunk, total - chunk)
    return b.astype(jnp.int32), start.astype(jnp.int32)


def slot_index(tc: int, nslots: int):
    """Flat index of grid step (g, t, slot) in the chunk tables of ``query_tables``, and of the
    block id of that slot."""
    return (lambda g, t, j: (g * tc + t) * nslots + j,
            lambda g, t, j: (g * tc + t) * (nslots // 2) + jax.lax.div(j, 2))


def query_tables(ids, base, qpos, qseg, b, t0, tc: int, blk: int, s_pad: int):
    """Scalar-prefetch tables of one query chunk (tokens [t0, t0 + tc) of batch row b), 1-D int32.

    ids [B,G,T,K] (deduplicated block ids), base / qpos / qseg [B,T]. Returns (scal [2] = (b, t0),
    tiles [G*tc*2K], act [G*tc*2K], ids [G*tc*K], qpos [tc], qseg [tc]): per (group, token) the 2K
    tile slots (a block covers one aligned tile, or two when its start is not tile aligned); an
    inactive slot repeats the slot before it, so the pipeline skips its copy.
    """
    g, k = ids.shape[1], ids.shape[3]
    ids_c = jax.lax.dynamic_slice(ids, (b, 0, t0, 0), (1, g, tc, k))
    base_c = jax.lax.dynamic_slice(base, (b, t0), (1, tc))
    starts = layout.window_starts(ids_c, base_c, blk, s_pad)[0]
    ids_c = ids_c[0]
    tile_a = starts // blk
    mis = (starts % blk) != 0
    valid = ids_c >= 0
    tiles = jnp.stack([tile_a, jnp.where(mis, tile_a + 1, tile_a)], axis=-1)
    act = jnp.stack([valid, valid & mis], axis=-1).astype(jnp.int32)
    one = lambda x: jax.lax.dynamic_slice(x, (b, t0), (1, tc)).reshape(tc).astype(jnp.int32)  # noqa: E731
    return (jnp.stack([b, t0]).astype(jnp.int32), tiles.reshape(-1).astype(jnp.int32),
            act.reshape(-1), ids_c.reshape(-1), one(qpos), one(qseg))


def query_loop(ids, prep, qpos, blk: int, call, bufs):
    """Run ``call(tables, bufs, tc=) -> bufs`` on every query chunk of every batch row, in one
    ``lax.fori_loop``. ids [B,G,T,K] deduplicated; prep: layout.prepare output; qpos [B,T]."""
    bsz, g, t, k = ids.shape
    tc = query_chunk(t, g, k)
    nc = -(-t // tc)

    def body(i, bufs):
        b, t0 = chunk_origin(i, nc, tc, t)
        tabs = query_tables(ids, prep.base, qpos, prep.q_seg, b, t0, tc, blk, prep.s_pad)
        return call(tabs, bufs, tc=tc)
    return jax.lax.fori_loop(0, bsz * nc, body, bufs)


# ----------------------------------------------------------------------------- KV-outer entries

def entry_window(words_per_entry: int) -> int:
    """Entries per KV-outer call: words_per_entry * window <= TABLE_WORDS (a multiple of 8)."""
    w = TABLE_WORDS // words_per_entry // 8 * 8
    assert w >= 8, "SMEM table budget too small"
    return w


def sorted_entries(ids, starts, qpos, qseg, blk: int, n_tiles: int, *, per_group: bool,
                   words_per_entry: int = 6):
    """The selections sorted by storage tile, cut into fixed-size windows for KV-outer kernels.

    ids / starts [B,G,T,K] (deduplicated ids, window starts), qpos / qseg [B,T]. A "run" is one
    output tile: (b, g, tile) when per_group (attention dk / dv), (b, tile) otherwise (KL d ki,
    over all groups). Every selection adds one entry per tile it covers (two when unaligned); every
    run gets one inactive entry first, so every output tile is written. A stable sort keeps a fixed
    order (dummy, then first tiles by (g,) t, k, then second tiles): the summation order is a pure
    function of the inputs. Unused entries (ids -1, aligned second tiles) sort to the end.

    Returns (tables, n_windows): tables is a tuple of int32 [NW, W] arrays, W = entry_window(...)
    or less for a short list (n_windows <= NW windows hold every used entry; the rest are never
    visited):
      tile   global run index (b * G + g) * n_tiles + tile, or b * n_tiles + tile
      qrow   query row (b * T + t) * G + g of the entry
      lo, hi positions [lo, hi] of the selected block that the query may see (lo > hi: inactive)
      qseg   the query's segment
      flags  bit0 first entry of its run, bit1 last, bit2 active
    """
    bsz, g, t, k = ids.shape
    nrows = bsz * g if per_group else bsz
    big = nrows * n_tiles
    n_sel = bsz * g * t * k
    assert big + 2 * n_sel < 2 ** 31, "entry list too long for int32 indices"
    total = big + 2 * n_sel
    w = min(entry_window(words_per_entry), -(-total // 8) * 8)
    valid = ids >= 0
    tile_a = starts // blk
    mis = (starts % blk) != 0
    row = jnp.arange(bsz, dtype=jnp.int32)[:, None, None, None] * (g if per_group else 1)
    if per_group:
        row = row + jnp.arange(g, dtype=jnp.int32)[None, :, None, None]
    first = jnp.where(valid, row * n_tiles + tile_a, big).reshape(-1)
    second = jnp.where(valid & mis, row * n_tiles + tile_a + 1, big).reshape(-1)
    nw = -(-total // w)
    pad = nw * w - total
    keys = jnp.concatenate([jnp.arange(big, dtype=jnp.int32), first.astype(jnp.int32),
                            second.astype(jnp.int32), jnp.full((pad,), big, jnp.int32)])
    sel = jnp.arange(n_sel, dtype=jnp.int32)
    pay = jnp.concatenate([jnp.full((big,), -1, jnp.int32), sel, sel, jnp.full((pad,), -1, jnp.int32)])
    keys, pay = jax.lax.sort((keys, pay), num_keys=1, is_stable=True)
    active = (keys < big) & (pay >= 0)
    tile = jnp.minimum(keys, big - 1)
    s = jnp.maximum(pay, 0)
    eb, eg, et = s // (g * t * k), (s // (t * k)) % g, (s // k) % t
    n = ids.reshape(-1)[s]
    qp = qpos.astype(jnp.int32).reshape(-1)[eb * t + et]
    lo = jnp.where(active, n * blk, 1)
    hi = jnp.where(active, jnp.minimum(qp, n * blk + blk - 1), 0)
    qs = qseg.astype(jnp.int32).reshape(-1)[eb * t + et]
    qrow = jnp.where(active, (eb * t + et) * g + eg, 0)
    prev = jnp.concatenate([jnp.full((1,), -1, jnp.int32), tile[:-1]])
    nxt = jnp.concatenate([tile[1:], jnp.full((1,), -1, jnp.int32)])
    flags = ((tile != prev).astype(jnp.int32) + 2 * (tile != nxt).astype(jnp.int32)
             + 4 * active.astype(jnp.int32))
    used = big + jnp.sum(valid.astype(jnp.int32)) + jnp.sum((valid & mis).astype(jnp.int32))
    n_windows = (used + w - 1) // w
    tables = tuple(x.astype(jnp.int32).reshape(nw, w) for x in (tile, qrow, lo, hi, qs, flags))
    return tables, n_windows


def window(tables, i):
    """The 1-D tables of window i (dynamic index)."""
    return tuple(jax.lax.dynamic_index_in_dim(x, i, axis=0, keepdims=False) for x in tables)
