"""Token permutation for dropless MoE: sort assignments by expert, gather, un-gather, combine.

Every op here is a gather in the forward AND in the backward (custom VJPs): the inverse of a row
permutation is the gather by the inverse index, so no scatter-add appears in either pass. The
index arrays are computed once by ``sort_by_expert`` and carried.

Notation: ``n`` tokens, ``k`` experts per token, ``M = n * k`` assignments (token-major: assignment
``a = t * k + j`` is token ``t``'s ``j``-th choice). ``order[i]`` is the assignment at sorted row
``i`` (sorted by expert id, stable); ``inv`` is its inverse (``inv[order[i]] == i``).

Inside ``shard_map`` (expert parallelism) every backward rule casts its cotangents to the varying
type of the primal inputs (``pallas_kernels.common.match_cotangent``): JAX checks that a custom
VJP's cotangents are typed exactly like its primals, and an output cotangent can vary over axes a
primal input does not (e.g. an input that came out of a kernel typed invariant).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common import match_cotangent, searchsorted, vma_type

__all__ = ["sort_by_expert", "permute_rows", "unpermute_combine", "gather_rows", "group_starts"]


def sort_by_expert(experts: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sort the ``[n, k]`` int32 expert choices by expert id (stable: ties keep token order).

    Returns ``(order [M] int32, inv [M] int32, group_sizes [num_experts] int32)``; ids outside
    ``[0, num_experts)`` are not counted in ``group_sizes`` (they sort by value).
    """
    flat = experts.reshape(-1).astype(jnp.int32)
    m = flat.shape[0]
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    inv = jnp.zeros((m,), jnp.int32).at[order].set(jnp.arange(m, dtype=jnp.int32))
    sorted_ids = jnp.take(flat, order)
    ids = jnp.arange(num_experts, dtype=jnp.int32)
    group_sizes = searchsorted(sorted_ids, ids, side="right") - searchsorted(sorted_ids, ids, side="left")
    return order, inv, group_sizes


def group_starts(group_sizes: jax.Array) -> jax.Array:
    """Exclusive cumulative sum: the first sorted row of each group, ``[G]`` int32."""
    return (jnp.cumsum(group_sizes) - group_sizes).astype(jnp.int32)


# ----------------------------------------------------------------------------- x -> sorted rows
@jax.custom_vjp
def permute_rows(x: jax.Array, order: jax.Array, inv: jax.Array) -> jax.Array:
    """``out[i] = x[order[i] // k]``: ``[n, H]`` -> ``[n*k, H]`` rows sorted by expert.

    ``k = len(order) // n``. Backward: ``dx[t] = sum_j g[inv[t*k + j]]`` (a gather and a sum over
    k, no scatter).
    """
    return _permute_fwd(x, order, inv)[0]


def _permute_fwd(x, order, inv):
    kk = order.shape[0] // x.shape[0]
    return jnp.take(x, order // kk, axis=0), (inv, x.shape[0], vma_type(x))


def _permute_bwd(res, g):
    inv, n, x_type = res
    dx = jnp.take(g, inv, axis=0).reshape(n, -1, g.shape[-1]).sum(axis=1)
    return match_cotangent(dx, x_type), None, None


permute_rows.defvjp(_permute_fwd, _permute_bwd)


# ----------------------------------------------------------------------------- sorted rows -> tokens
@jax.custom_vjp
def unpermute_combine(ys: jax.Array, weights: jax.Array, order: jax.Array, inv: jax.Array) -> jax.Array:
    """``out[t] = sum_j weights[t, j] * ys[inv[t*k + j]]`` accumulated in float32.

    Args: ys ``[n*k, H]`` expert outputs in sorted order; weights ``[n, k]`` float32.
    Returns ``[n, H]`` float32. Backward: ``dys[i] = w[order[i]] * g[order[i] // k]`` and
    ``dw[t, j] = <g[t], ys[inv[t*k+j]]>`` (gathers only).
    """
    return _unpermute_fwd(ys, weights, order, inv)[0]


def _unpermute_fwd(ys, weights, order, inv):
    n, k = weights.shape
    rows = jnp.take(ys, inv, axis=0).reshape(n, k, -1).astype(jnp.float32)
    out = jnp.einsum("nkh,nk->nh", rows, weights.astype(jnp.float32))
    return out, (ys, weights, order, inv)


def _unpermute_bwd(res, g):
    ys, weights, order, inv = res
    n, k = weights.shape
    g = g.astype(jnp.float32)
    w_sorted = jnp.take(weights.reshape(-1), order).astype(jnp.float32)
    dys = (jnp.take(g, order // k, axis=0) * w_sorted[:, None]).astype(ys.dtype)
    rows = jnp.take(ys, inv, axis=0).reshape(n, k, -1).astype(jnp.float32)
    dw = jnp.einsum("nkh,nh->nk", rows, g).astype(weights.dtype)
    return match_cotangent(dys, ys), match_cotangent(dw, weights), None, None


unpermute_combine.defvjp(_unpermute_fwd, _unpermute_bwd)


# ----------------------------------------------------------------------------- partial bijections
@jax.custom_vjp
def gather_rows(x: jax.Array, idx: jax.Array, valid: jax.Array, inv_idx: jax.Array, inv_valid: jax.Array) -> jax.Array:
    """``out[j] = x[idx[j]] if valid[j] else 0`` for a partial bijection between rows.

    ``(inv_idx, inv_valid)`` must be its inverse: for every valid ``j``, ``inv_idx[idx[j]] == j``
    and ``inv_valid[idx[j]]``; rows of ``x`` that no valid ``j`` reads have ``inv_valid`` False.
    Then the backward is ``dx[i] = g[inv_idx[i]] if inv_valid[i] else 0`` (a gather).
    Shapes: x ``[R, H]``, idx/valid ``[S]``, inv_idx/inv_valid ``[R]``; returns ``[S, H]``.
    """
    return _gather_fwd(x, idx, valid, inv_idx, inv_valid)[0]


def _gather_fwd(x, idx, valid, inv_idx, inv_valid):
    out = jnp.where(valid[:, None], jnp.take(x, idx, axis=0, mode="clip"), jnp.zeros((), x.dtype))
    return out, (inv_idx, inv_valid, vma_type(x))


def _gather_bwd(res, g):
    inv_idx, inv_valid, x_type = res
    dx = jnp.where(inv_valid[:, None], jnp.take(g, inv_idx, axis=0, mode="clip"), jnp.zeros((), g.dtype))
    return match_cotangent(dx, x_type), None, None, None, None


gather_rows.defvjp(_gather_fwd, _gather_bwd)
