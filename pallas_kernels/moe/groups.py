"""Row ranges of the groups (experts) of a sorted grouped-matmul operand, and the forward kernel's work list of
visits (``make_visits``; layout in ``gpu_gmm``'s module docstring), shared by the MoE kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import searchsorted

__all__ = ["group_bounds", "num_visits", "make_visits"]


def group_bounds(group_sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """``(starts, sizes)``, int32 ``[G]``: group g owns rows ``[starts[g], starts[g] + sizes[g])`` of ``[0, m)``.

    Args: group_sizes: int ``[G]`` rows per group in order; m: rows of the operand.
    Negative sizes count as 0; each size is clipped to m before the int32 running sum (a size near 2**31
    cannot wrap it; G * m < 2**31 is assumed), and the ranges are clipped to ``[0, m)``: groups past row m
    are empty.
    """
    sizes = jnp.clip(group_sizes, 0, m).astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = jnp.minimum(ends - sizes, m)
    ends = jnp.minimum(ends, m)
    return starts, ends - starts


def num_visits(m: int, num_groups: int, bm: int) -> int:
    """Static upper bound of the visits of ``make_visits`` (any fold): ``cdiv(m, bm) + num_groups``."""
    return pl.cdiv(m, bm) + num_groups


def make_visits(group_sizes: jax.Array, m: int, bm: int, fold: int = 0) -> jax.Array:
    """Work list of the gmm kernel (XLA, O((cdiv(m, bm) + G) * log G)).

    Args:
      group_sizes: int ``[G]`` rows per group (rows sorted by group; the sum is clipped to ``m``).
      m: rows of lhs; bm: rows per visit.
      fold: 0, or (tail folding, module docstring) a group of ``q * bm + r`` rows with ``q >= 1`` and
        ``0 < r <= fold`` gets ``q`` visits, the last one of ``bm + r`` rows (``TileConfig.fold``).
    Returns: int32 ``[3, V]``, ``V = num_visits(m, G, bm)``; column v = ``(group, lo, hi)``: the
      visit computes rows ``[lo, hi)`` of ``group`` (``0 < hi - lo <= bm``, or ``bm < hi - lo <= bm +
      fold`` for a folded group's last visit); ``group == G`` is the pseudo-group of the rows past
      ``sum(group_sizes)`` (stored as zeros, never folded); unused visits have ``lo == hi == 0`` and
      ``group == G``. Visits are ordered by row; every row in ``[0, m)`` lies in exactly one visit.
    """
    g = group_sizes.shape[0]
    starts, sizes = group_bounds(group_sizes, m)
    total = jnp.sum(sizes)
    starts_x = jnp.concatenate([starts, total[None]])
    sizes_x = jnp.concatenate([sizes, (m - total)[None]])
    blocks = (sizes_x + bm - 1) // bm
    if fold:
        rem = sizes_x - (blocks - 1) * bm                 # rows of the last block (1..bm if the group is live)
        folded = (blocks >= 2) & (rem <= fold) & (jnp.arange(g + 1) < g)
        blocks = blocks - folded.astype(blocks.dtype)
    vend = jnp.cumsum(blocks)                       # exclusive end of each group's visits
    vstart = vend - blocks
    v = jnp.arange(num_visits(m, g, bm), dtype=jnp.int32)
    grp = searchsorted(vend, v, side="right")                      # in [0, G + 1] (no XLA while loop)
    valid = grp <= g
    gc = jnp.minimum(grp, g)
    lo = starts_x[gc] + (v - vstart[gc]) * bm
    if fold:   # a group's last visit ends at the group's end (bm + r rows if folded), the others after bm rows
        hi = jnp.where(v == vend[gc] - 1, starts_x[gc] + sizes_x[gc], lo + bm)
    else:
        hi = jnp.minimum(lo + bm, starts_x[gc] + sizes_x[gc])
    lo = jnp.where(valid, lo, 0)
    hi = jnp.where(valid, hi, 0)
    return jnp.stack([gc, lo, hi]).astype(jnp.int32)
