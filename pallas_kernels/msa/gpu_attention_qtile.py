"""MSA block-sparse attention forward on GPU, query-tiled (Pallas, Triton lowering).

Same contract and math as ``gpu_attention.py`` (MSA_SPEC.md section 3; storage layout: layout.py):
outputs o [B,T,H,Dv] (q.dtype) and lse [B,T,H] f32 (natural log, -inf where a query sees no key,
whose o is 0); fp32 online softmax in the exp2 domain. Only the forward differs; the backward is
the default one (``gpu_attention._bwd``), so gradients are those of the default kernels given the
(o, lse) this forward produces (equal to the default forward's within rounding).

Why: the default forward runs one program per (token, kv group) with M = H/G rows (M3: 16, M2: 6
padded to 16) and loads its own K selected K/V blocks, so neighbouring tokens that select the same
blocks load them again. Here one program handles QT consecutive tokens of one kv group:
M = QT * hgp rows (hgp = H/G rounded up to a power of two, and up so that M >= 16; M3 with QT=4:
64 rows, M2 with QT=8: 64 rows), and it loops over the UNION of the storage windows those QT tokens
selected, loading each window's K/V once. A row (token, head) keeps a key only if its token
selected that window AND the usual visibility rule holds (segment, causal, block membership) —
exactly ``gpu_attention._mask`` with the row's own block id.

Union (computed in XLA before the kernel, per (batch row, group, tile of QT tokens)):
every valid selection (token, id n) names the storage window with raw start
``c = base[token] + n*B`` (``base``: layout.py; tokens of one segment share it, so equal ids of the
same segment give equal c; tokens of different segments that name the same storage window share it
too, each keeping its own n = (c - base)/B through the row mask). The QT*K raw starts are sorted and
deduplicated: ``keys`` [.., U] ascending (U = QT*K static worst case; entries past ``count`` are
unused), ``bits`` [.., U] int32 with bit j set iff token j of the tile selected that window, and
``count`` (the dynamic trip count of the kernel loop). The kernel loads the window at
``clip(c, 0, Sp-B)`` (as the default kernel does) and re-checks every key. For one token the blocks
are visited in ascending storage order, the same order as the default kernel (which visits its
sorted, deduplicated ids), and windows a row did not select are exact no-ops for that row
(p = 0, correction 1), so each row's result equals the default kernel's up to matmul rounding.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels.msa import gpu_attention as _ga
from pallas_kernels.msa import layout

__all__ = ["msa_attention_gpu_qtile", "tile_union", "union_counts", "row_pad", "QUERY_TILES"]

QUERY_TILES = (1, 2, 4, 8, 16)
_SENTINEL = np.iinfo(np.int32).max


def row_pad(heads_per_group: int, query_tile: int) -> int:
    """Rows per token in a tile (hgp): H/G rounded up to a power of two and so that QT*hgp >= 16."""
    return max(layout.next_pow2(heads_per_group), -(-16 // query_tile))


def tile_union(ids, base, block_size: int, query_tile: int):
    """Per (batch row, group, tile of QT tokens): sorted unique storage windows and token masks.

    Args:
      ids: int32 [B,G,T,K] selected block ids (-1 = empty; no duplicates within a row, e.g. the
        output of ``layout.dedupe_ids``).
      base: int32 [B,T] storage index of position 0 of each query's segment (``layout.prepare``).
      block_size: B. query_tile: QT (tokens per tile); T is padded to NT*QT with empty tokens.
    Returns:
      keys int32 [B,G,NT,U] (U = QT*K): raw window starts ``base[token] + n*B`` ascending in
        [0, count), int32 max after;
      bits int32 [B,G,NT,U]: bit j set iff token j of the tile selected that window (0 after count);
      count int32 [B,G,NT]: number of distinct windows of the tile (<= U).
    """
    bsz, g, t, k = ids.shape
    qt = query_tile
    tp = -(-t // qt) * qt
    nt = tp // qt
    u = qt * k
    raw = jnp.where(ids >= 0, base[:, None, :, None] + ids * block_size, _SENTINEL)
    raw = raw.astype(jnp.int32)
    if tp != t:
        raw = jnp.pad(raw, ((0, 0), (0, 0), (0, tp - t), (0, 0)), constant_values=_SENTINEL)
    raw = raw.reshape(bsz, g, nt, u)
    tok = jnp.arange(u, dtype=jnp.int32) // k                       # token of each flat entry
    tb = jnp.where(raw != _SENTINEL, jnp.left_shift(jnp.int32(1), tok), 0).astype(jnp.int32)
    key, tb = jax.lax.sort((raw, tb), dimension=3, num_keys=1)
    first = jnp.concatenate([jnp.ones(key.shape[:3] + (1,), bool),
                             key[..., 1:] != key[..., :-1]], axis=-1) & (key != _SENTINEL)
    csx = jnp.cumsum(tb, axis=-1, dtype=jnp.int32) - tb            # exclusive prefix sum
    total = jnp.sum(tb, axis=-1, dtype=jnp.int32)
    count = jnp.sum(first, axis=-1, dtype=jnp.int32)
    # compact the run starts to the front (stable: keeps ascending key order)
    _, ukey, ucsx = jax.lax.sort((jnp.where(first, 0, 1).astype(jnp.int32), key, csx),
                                 dimension=3, num_keys=1, is_stable=True)
    idx = jnp.arange(u, dtype=jnp.int32)
    used = idx < count[..., None]
    nxt = jnp.concatenate([ucsx[..., 1:], total[..., None]], axis=-1)
    nxt = jnp.where(idx + 1 < count[..., None], nxt, total[..., None])
    # tokens' bits in a run are distinct powers of two (one entry per token and window): sum == or
    bits = jnp.where(used, nxt - ucsx, 0).astype(jnp.int32)
    keys = jnp.where(used, ukey, _SENTINEL).astype(jnp.int32)
    return keys, bits, count


def union_counts(block_ids, *, q_positions, kv_positions, q_segment_ids=None, kv_segment_ids=None,
                 block_size, query_tile):
    """Distinct storage windows per tile of ``query_tile`` tokens: int32 [B,G,ceil(T/QT)].

    Same arguments as ``msa_attention_gpu`` (block_ids int [B,G,T,K]). For statistics (the kernel
    loads count windows per tile instead of QT*K); jit-able.
    """
    prep = layout.prepare(jnp.zeros(kv_positions.shape + (1, 1), jnp.float32), None, q_positions,
                          kv_positions, q_segment_ids, kv_segment_ids, block_size)
    ids = layout.dedupe_ids(block_ids)
    return tile_union(ids, prep.base, block_size, query_tile)[2]


def _rows(x, hgp):
    """[QT] per-token values -> [QT*hgp] per-row values (row r belongs to token r // hgp)."""
    qt = x.shape[0]
    return jnp.broadcast_to(x[:, None], (qt, hgp)).reshape(qt * hgp)


def _fwd_qtile_kernel(q_ref, k_ref, v_ref, keys_ref, bits_ref, cnt_ref, qpos_ref, qseg_ref,
                      base_ref, kvpos_ref, kvseg_ref, o_ref, lse_ref, *, blk, qt, hgp, scale,
                      s_pad):
    i = pl.program_id(0)
    g = pl.program_id(1)
    b = pl.program_id(2)
    m_rows = qt * hgp
    d = q_ref.shape[-1]
    dv = v_ref.shape[-1]
    toks = pl.ds(i * qt, qt)
    q = q_ref[b, toks, g].reshape(m_rows, d)                  # [M, D], row = (token, head)
    r_pos = _rows(qpos_ref[b, toks], hgp)                     # [M]
    r_seg = _rows(qseg_ref[b, toks], hgp)
    r_base = _rows(base_ref[b, toks], hgp)
    r_bit = _rows(jnp.left_shift(jnp.int32(1), jnp.arange(qt, dtype=jnp.int32)), hgp)
    n_win = cnt_ref[b, g, i]
    qk_scale = scale * _ga._LOG2E

    def body(u, carry):
        acc, m_prev, l_prev = carry
        c = keys_ref[b, g, i, u]                  # raw window start base + n*B
        bits = bits_ref[b, g, i, u]
        start = jnp.minimum(jnp.maximum(c, 0), s_pad - blk)
        sl = pl.ds(start, blk)
        kb = k_ref[b, sl, g, :]                   # [B, D]
        vb = v_ref[b, sl, g, :]
        kvp = kvpos_ref[b, sl]
        kvs = kvseg_ref[b, sl]
        lo = c - r_base                           # n*B of this window for each row's token
        vis = (((bits & r_bit) != 0)[:, None] & (kvs[None, :] == r_seg[:, None])
               & (kvs >= 0)[None, :] & (kvp[None, :] <= r_pos[:, None])
               & (kvp[None, :] >= lo[:, None]) & (kvp[None, :] < lo[:, None] + blk))
        s = _ga._dot(q, kb, trans_b=True) * qk_scale              # [M, B] log2 domain
        s = jnp.where(vis, s, -jnp.inf)
        return _ga._online_softmax_step(s, vb, acc, m_prev, l_prev)

    acc, m_i, l_i = jax.lax.fori_loop(0, n_win, body, _ga._online_softmax_init(m_rows, dv))
    o, lse = _ga._online_softmax_finish(acc, m_i, l_i, o_ref.dtype)
    o_ref[b, toks, g] = o.reshape(qt, hgp, dv)
    lse_ref[b, toks, g] = lse.reshape(qt, hgp)


def _default_warps(m_rows):
    return 4 if m_rows <= 64 else 8


def _fwd_qtile(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids, *,
               block_size, query_tile, interpret, num_warps, num_stages):
    bsz, t, h, d = q.shape
    g = k.shape[2]
    dv = v.shape[-1]
    hg = h // g
    qt = query_tile
    hgp = row_pad(hg, qt)
    tp = -(-t // qt) * qt
    nt = tp // qt
    prep = layout.prepare(k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                          block_size)
    ids = layout.dedupe_ids(block_ids)
    keys, bits, count = tile_union(ids, prep.base, block_size, qt)
    q5 = _ga._group_q(q, g, hgp)                                   # [B,T,G,hgp,D]
    qpos = q_positions.astype(jnp.int32)
    qseg, base = prep.q_seg, prep.base
    if tp != t:                   # padded tokens: segment -2 (never visible), no selections
        q5 = jnp.pad(q5, ((0, 0), (0, tp - t), (0, 0), (0, 0), (0, 0)))
        qpos = jnp.pad(qpos, ((0, 0), (0, tp - t)))
        qseg = jnp.pad(qseg, ((0, 0), (0, tp - t)), constant_values=-2)
        base = jnp.pad(base, ((0, 0), (0, tp - t)))
    kernel = functools.partial(_fwd_qtile_kernel, blk=block_size, qt=qt, hgp=hgp,
                               scale=1.0 / math.sqrt(d), s_pad=prep.s_pad)
    warps = _default_warps(qt * hgp) if num_warps is None else num_warps
    o5, lse4 = pl.pallas_call(
        kernel,
        grid=(nt, g, bsz),
        out_shape=[jax.ShapeDtypeStruct((bsz, tp, g, hgp, dv), q.dtype),
                   jax.ShapeDtypeStruct((bsz, tp, g, hgp), jnp.float32)],
        compiler_params=_ga._params(warps, num_stages),
        interpret=interpret,
        name=f"msa_fwd_qtile{qt}_gpu",
    )(q5, prep.k, prep.v, keys, bits, count, qpos, qseg, base, prep.kv_pos, prep.kv_seg)
    if tp != t:
        o5, lse4 = o5[:, :t], lse4[:, :t]
    return _ga._ungroup(o5, hg), _ga._ungroup(lse4, hg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11, 12))
def _attn_qtile(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                block_size, query_tile, interpret, num_warps, num_stages):
    return _fwd_qtile(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids,
                      kv_segment_ids, block_size=block_size, query_tile=query_tile,
                      interpret=interpret, num_warps=num_warps, num_stages=num_stages)


def _attn_qtile_fwd(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids,
                    block_size, query_tile, interpret, num_warps, num_stages):
    o, lse = _attn_qtile(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids,
                         kv_segment_ids, block_size, query_tile, interpret, num_warps, num_stages)
    return (o, lse), (q, k, v, block_ids, q_positions, kv_positions, q_segment_ids,
                      kv_segment_ids, o, lse)


def _attn_qtile_bwd(block_size, query_tile, interpret, num_warps, num_stages, res, cot):
    # the default backward kernels (their own launch parameters: 4 warps, 2 stages)
    del query_tile, num_warps, num_stages
    return _ga._attn_bwd(block_size, interpret, 4, 2, res, cot)


_attn_qtile.defvjp(_attn_qtile_fwd, _attn_qtile_bwd)


def msa_attention_gpu_qtile(q, k, v, block_ids, *, q_positions, kv_positions, q_segment_ids=None,
                            kv_segment_ids=None, block_size, query_tile, interpret=False,
                            num_warps=None, num_stages=2):
    """Block-sparse MSA attention with the query-tiled forward; differentiable in q, k, v.

    Args: as ``gpu_attention.msa_attention_gpu`` (q [B,T,H,D] bf16/f32; k [B,S,G,D]; v [B,S,G,Dv];
      block_ids int [B,G,T,K], -1 = empty; positions [B,T]/[B,S]; segment ids or None;
      block_size a power of two >= 16), plus
      query_tile: QT in QUERY_TILES, consecutive query tokens per program (T need not be a
        multiple: the last tile is padded with empty tokens).
      num_warps: Triton warps of the forward (None: 4 for M = QT*hgp <= 64 rows, else 8);
      num_stages: Triton pipeline stages of the forward. The backward is the default one with
        its default launch parameters.
    Returns: (o [B,T,H,Dv] q.dtype, lse [B,T,H] f32 natural log, -inf where a query sees no key).
      The gradient of lse is not propagated (as in the default kernel).
    Raises: ValueError on inconsistent shapes, a block size / head dim that is not a power of two
      >= 16, or a query_tile not in QUERY_TILES.
    """
    _ga.check_args(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids, block_size)
    if query_tile not in QUERY_TILES:
        raise ValueError(f"query_tile must be one of {QUERY_TILES}, got {query_tile!r}")
    return _attn_qtile(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids,
                       kv_segment_ids, block_size, int(query_tile), interpret, num_warps,
                       num_stages)
