"""Layout helpers shared by the MSA Pallas kernels (GPU and TPU): padding, segment bases, checks.

Conventions (MSA_SPEC.md sections 1-3; docs/ARCHITECTURE.md "Ops"):

* Key j is visible to query i iff ``kv_seg[j] == q_seg[i] and kv_seg[j] >= 0 and
  kv_pos[j] <= q_pos[i]``. Block ``n`` of query i is the set of keys of i's segment with
  ``n*B <= kv_pos[j] < (n+1)*B`` (blocks are ``kv_pos // B`` within a segment).
* Storage layout the kernels rely on: every segment's keys are stored as ONE contiguous run with
  positions increasing by one (packed training batches, chunked prefill over a prefix, a gathered
  decode cache with kv_pos = arange(S)). Then key j of a segment sits at storage index
  ``base + kv_pos[j]`` with one ``base`` per segment (``base = j - kv_pos[j]``, possibly negative
  when the stored run does not start at position 0), and block ``n`` of query i starts at
  ``base[seg(i)] + n*B``. Queries may sit anywhere (they need not be the last T keys). Kernels load
  the B keys from that start clamped into the array and re-check every key's segment, position and
  block membership, so a clamped window never adds a wrong key and never misses an existing one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.common import searchsorted

__all__ = ["Prepared", "prepare", "next_pow2", "pad_query_rows", "check_shapes", "check_layout",
           "window_starts", "dedupe_ids", "segment_runs"]


def next_pow2(x: int) -> int:
    """Smallest power of two >= x (x >= 1)."""
    p = 1
    while p < x:
        p *= 2
    return p


class Prepared(tuple):
    """(k, v, kv_pos, kv_seg, q_seg, base, s_pad): arrays padded along S to a multiple of B."""

    __slots__ = ()

    def __new__(cls, *items):
        return super().__new__(cls, items)

    k = property(lambda self: self[0])
    v = property(lambda self: self[1])
    kv_pos = property(lambda self: self[2])
    kv_seg = property(lambda self: self[3])
    q_seg = property(lambda self: self[4])
    base = property(lambda self: self[5])
    s_pad = property(lambda self: self[6])


def check_shapes(q, k, v, block_ids, q_positions, kv_positions, q_segment_ids, kv_segment_ids):
    """Assert the shapes the kernels rely on (the public ops validate them; direct callers too).

    q [B,T,H,D], k/v [B,S,G,D], block_ids [B,G,T,K] int (or None), positions [B,T]/[B,S],
    segment ids None or [B,T]/[B,S] (both or neither), T <= S.
    """
    assert q.ndim == 4 and k.ndim == 4 and v.ndim == 4, (q.shape, k.shape, v.shape)
    bsz, t, h, d = q.shape
    s, g = k.shape[1], k.shape[2]
    assert k.shape[:3] == v.shape[:3] and k.shape[0] == bsz and k.shape[3] == d, (q.shape, k.shape, v.shape)
    assert h % g == 0, f"num heads {h} not a multiple of kv heads {g}"
    assert block_ids is None or (block_ids.ndim == 4 and block_ids.shape[:3] == (bsz, g, t)), block_ids.shape
    assert q_positions.shape == (bsz, t) and kv_positions.shape == (bsz, s), (q_positions.shape, kv_positions.shape)
    assert (q_segment_ids is None) == (kv_segment_ids is None), "pass both segment id arrays or neither"
    assert q_segment_ids is None or (q_segment_ids.shape == (bsz, t) and kv_segment_ids.shape == (bsz, s))
    assert t <= s, f"more queries ({t}) than keys ({s})"


def prepare(k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, block_size,
            min_len: int | None = None):
    """Pad keys to a multiple of block_size (at least ``min_len``) and compute per-query bases.

    Args:
      k, v: [B,S,G,D] (v may be None).
      q_positions [B,T] int, kv_positions [B,S] int; segment ids [B,T]/[B,S] int or None.
      block_size: B (tokens per block).
    Returns:
      Prepared(k, v, kv_pos int32 [B,Sp], kv_seg int32 [B,Sp] (-1 on padding),
               q_seg int32 [B,T], base int32 [B,T] (storage index of position 0 of each query's
               segment, see the module docstring), Sp).
    """
    bsz, s = kv_positions.shape
    t = q_positions.shape[1]
    sp = -(-max(s, 1) // block_size) * block_size
    if min_len is not None:
        sp = max(sp, min_len)
    pad = sp - s
    kv_pos = kv_positions.astype(jnp.int32)
    if q_segment_ids is None:
        q_seg = jnp.zeros((bsz, t), jnp.int32)
        kv_seg = jnp.zeros((bsz, s), jnp.int32)
    else:
        q_seg = q_segment_ids.astype(jnp.int32)
        kv_seg = kv_segment_ids.astype(jnp.int32)
    if pad:
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        k = jnp.pad(k, widths)
        v = None if v is None else jnp.pad(v, widths)
        kv_pos = jnp.pad(kv_pos, ((0, 0), (0, pad)))
        kv_seg = jnp.pad(kv_seg, ((0, 0), (0, pad)), constant_values=-1)
    base = jax.vmap(_segment_base)(kv_pos[:, :s], kv_seg[:, :s], q_seg)
    return Prepared(k, v, kv_pos, kv_seg, q_seg, base, sp)


def _segment_base(kv_pos, kv_seg, q_seg):
    """Per query: j - kv_pos[j] for the first key j of the query's segment (0 when it has none). [S],[S],[T]."""
    j0, j1 = segment_runs(kv_seg, q_seg)
    return jnp.where(j1 >= j0, j0 - kv_pos[jnp.clip(j0, 0, kv_seg.shape[0] - 1)], 0).astype(jnp.int32)


def segment_runs(kv_seg, q_seg):
    """Per query: first and last storage index of its segment's keys (j1 < j0 when it has none).

    One batch row: kv_seg [S] int32 (-1 on empty slots), q_seg [T] int32 -> (j0, j1) int32 [T]. Under the
    storage-layout contract the segment's keys are exactly storage [j0, j1]."""
    order = jnp.argsort(kv_seg, stable=True)
    srt = kv_seg[order]
    n = kv_seg.shape[0]
    a = searchsorted(srt, q_seg, side="left")
    e = searchsorted(srt, q_seg, side="right")
    found = (e > a) & (q_seg >= 0)
    j0 = order[jnp.clip(a, 0, n - 1)]
    j1 = order[jnp.clip(e - 1, 0, n - 1)]
    return jnp.where(found, j0, 1), jnp.where(found, j1, 0)


def window_starts(block_ids, base, block_size, s_pad):
    """Storage start of every selected block, clamped to [0, s_pad - B]: int32 [B,G,T,K]."""
    start = base[:, None, :, None] + block_ids * block_size
    return jnp.clip(start, 0, s_pad - block_size).astype(jnp.int32)


def _concrete(x):
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def check_layout(q_positions, kv_positions, q_segment_ids, kv_segment_ids):
    """Validate the storage layout the kernels rely on (module docstring) when values are concrete.

    Under ``jit`` (tracers) nothing can be checked and the call returns False; callers document the
    contract. Returns True when checked. Raises ValueError naming the first violation: a segment
    stored in more than one run, or positions inside a run not increasing by one.
    """
    qp, kp = _concrete(q_positions), _concrete(kv_positions)
    ks = _concrete(kv_segment_ids) if kv_segment_ids is not None else None
    if qp is None or kp is None or (kv_segment_ids is not None and ks is None):
        return False
    if ks is None:
        ks = np.zeros_like(kp)
    for b in range(kp.shape[0]):
        valid = ks[b] >= 0
        same = (ks[b, 1:] == ks[b, :-1]) & valid[1:]
        step_bad = same & (kp[b, 1:] != kp[b, :-1] + 1)
        if np.any(step_bad):
            bad = int(np.argmax(step_bad)) + 1
            raise ValueError(f"MSA kernels: kv_positions[{b}] must increase by 1 inside a segment "
                             f"(index {bad}: {kp[b, bad - 1]} -> {kp[b, bad]})")
        starts = valid & np.concatenate([[True], ~same])
        seg_ids = ks[b][starts]
        if len(np.unique(seg_ids)) != len(seg_ids):
            raise ValueError(f"MSA kernels: a segment of batch row {b} is stored in several runs")
    return True


def dedupe_ids(block_ids):
    """Sort each row of block ids and blank repeats to -1 (the op counts a duplicate once): int32."""
    ids = jax.lax.sort(block_ids.astype(jnp.int32), dimension=block_ids.ndim - 1)
    dup = jnp.concatenate([jnp.zeros(ids.shape[:-1] + (1,), bool), ids[..., 1:] == ids[..., :-1]],
                          axis=-1)
    return jnp.where(dup | (ids < 0), -1, ids)


def pad_query_rows(qi, q_positions, prep, tq: int):
    """Pad the query axis of the indexer inputs to a multiple of the row tile ``tq``.

    Args:
      qi: ``[B, T, Hi, Di]`` index queries; q_positions: ``[B, T]``; prep: ``prepare(...)`` output.
      tq: query tokens per row tile.
    Returns: ``(qi, qpos, qseg, base, tp)`` padded to ``tp = ceil(T / tq) * tq`` tokens; padded
      queries get segment -2 (never visible) and position/base 0.
    """
    t = qi.shape[1]
    tp = -(-t // tq) * tq
    pad = tp - t
    qpos = q_positions.astype(jnp.int32)
    qseg, base = prep.q_seg, prep.base
    if pad:
        qi = jnp.pad(qi, ((0, 0), (0, pad), (0, 0), (0, 0)))
        qpos = jnp.pad(qpos, ((0, 0), (0, pad)))
        qseg = jnp.pad(qseg, ((0, 0), (0, pad)), constant_values=-2)
        base = jnp.pad(base, ((0, 0), (0, pad)))
    return qi, qpos, qseg, base, tp


def keep(x: jax.Array, valid: jax.Array) -> jax.Array:
    """``x`` where ``valid`` (broadcast against ``x``), +0.0 elsewhere, for partial buffers whose unused
    slots hold whatever memory held (NaN or Inf included).

    Same values as ``jnp.where(valid, x, 0.0)``, computed by masking the bits: inside a ``fori_loop`` XLA
    hoists a ``where``'s full-size zero broadcast out of the loop as a materialised buffer (1-2 GiB at
    64K-token query chunks) and reads it every iteration; a mask derived from ``valid`` is not hoisted.
    Not differentiable (the bit cast has no gradient): for the kernels' forward / backward code only.
    """
    ut = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[jnp.dtype(x.dtype).itemsize]
    mask = jnp.where(valid, jnp.array(-1, jnp.int32), 0).astype(ut)
    return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x, ut) & mask, x.dtype)

