"""Turn the kernels' unordered per-row top lists into MSA block ids (shared by GPU and TPU paths).

MSA_SPEC.md section 2: ranked blocks by score descending, ties by lower block id; then the forced
blocks (init/sink blocks 0..init-1, local blocks local-L+1..local), all clipped to [0, local];
unused slots -1 at the end.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["assemble_ids", "rank_width"]


def rank_width(topk: int, init_blocks: int, local_blocks: int) -> int:
    """Number of ranked (non-forced) slots: K - init - L (>= 0)."""
    n = topk - init_blocks - local_blocks
    assert n >= 0 and local_blocks >= 1 and init_blocks >= 0, (topk, init_blocks, local_blocks)
    return n


def assemble_ids(top_v, top_i, q_pos, local_ok, *, block_size, topk, init_blocks, local_blocks):
    """Order ranked candidates and add the forced blocks, in the order of the XLA reference.

    Args:
      top_v f32 [..., n_rank]: candidate scores (-inf = empty); top_i int32 [..., n_rank].
      q_pos int32 [...]: the row's query position (local block = q_pos // block_size).
      local_ok bool [...]: the row sees at least one key of its local block (else no block is
        forced: a row that sees nothing selects nothing).
    Returns: int32 [..., topk]: forced non-local blocks (ascending), ranked blocks (score
      descending, ties to the lower id), the local block, then -1 padding.
    """
    valid = top_v > -jnp.inf
    key_v = jnp.where(valid, -top_v, jnp.inf)
    key_i = jnp.where(valid, top_i, jnp.iinfo(jnp.int32).max)
    _, _, ranked = jax.lax.sort((key_v, key_i, jnp.where(valid, top_i, -1)),
                                dimension=top_v.ndim - 1, num_keys=2)
    lead = ranked.shape[:-1]
    local = (q_pos // block_size)[..., None]
    ok = local_ok[..., None]
    parts = []
    if init_blocks:
        f = jnp.arange(init_blocks, dtype=jnp.int32)
        parts.append(jnp.where(ok & (f < local), f, -1))
    if local_blocks > 1:
        f = local - local_blocks + 1 + jnp.arange(local_blocks - 1, dtype=jnp.int32)
        parts.append(jnp.where(ok & (f >= init_blocks) & (f >= 0), f, -1))
    parts.append(ranked.astype(jnp.int32))
    parts.append(jnp.where(ok, local, -1))
    ids = jnp.concatenate([jnp.broadcast_to(x, lead + x.shape[-1:]) for x in parts], axis=-1)
    order = jnp.argsort(ids < 0, axis=-1, stable=True)
    return jnp.take_along_axis(ids, order, axis=-1)[..., :topk]
