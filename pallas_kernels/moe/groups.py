"""Row ranges of the groups (experts) of a sorted grouped-matmul operand, shared by the MoE kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["group_bounds"]


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
