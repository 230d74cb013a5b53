"""MoE op: sigmoid top-k routing and expert computation, with an ``implementation=`` choice.

Routing math (MODEL_FACTS.md, transformers ``MiniMaxM2TopKRouter``): in float32,
``s = sigmoid(x @ W_router)``; experts are chosen by top-k of ``s + e_score_correction_bias``
(the bias only chooses); weights are ``s[chosen] / sum(s[chosen])``. Ties in the choice go to the
lower expert id (``jax.lax.top_k`` order).

Implementations of the expert computation:
- ``"dense"``: every expert on every token, combined by a [N, E] weight matrix. Exact, simple, and
  the fastest on CPU for tiny test models; O(E/k) wasted FLOPs.
- ``"ragged"``: dropless sort-based permutation + ``jax.lax.ragged_dot`` (XLA grouped matmul).
- ``"auto"``: ``"dense"`` when E * N is small (tests, demo), else ``"ragged"``.
Faster kernels (tokamax grouped matmul) and expert parallelism plug in here as more names.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from minimax_jax.ops.common import ImplementationUnavailable, record_implementation

__all__ = ["route", "moe_experts"]


def route(x: jax.Array, router: jax.Array, bias: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sigmoid top-k routing with a selection-only correction bias.

    Args:
      x: ``[N, H]`` tokens (any float dtype; cast to float32).
      router: ``[H, E]`` float32 router weights.
      bias: ``[E]`` float32 ``e_score_correction_bias`` (used only to choose experts).
      top_k: experts per token.
    Returns:
      ``(weights [N, k] float32 (rows sum to 1), experts [N, k] int32, load [E] float32)`` where
      ``load`` counts tokens routed to each expert.
    """
    logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    scores = jax.nn.sigmoid(logits)
    _, experts = jax.lax.top_k(scores + bias.astype(jnp.float32)[None, :], top_k)
    chosen = jnp.take_along_axis(scores, experts, axis=-1)
    weights = chosen / jnp.sum(chosen, axis=-1, keepdims=True)
    load = jnp.zeros((router.shape[1],), jnp.float32).at[experts.reshape(-1)].add(1.0)
    return weights, experts.astype(jnp.int32), load


def moe_experts(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    wi: jax.Array,
    wo: jax.Array,
    act,
    *,
    implementation: str = "auto",
) -> jax.Array:
    """Weighted sum of the chosen experts' gated MLPs.

    Args:
      x: ``[N, H]`` compute dtype.
      weights: ``[N, k]`` float32 routing weights; experts: ``[N, k]`` int32 expert ids.
      wi: ``[E, H, 2I]`` fused gate/up; wo: ``[E, I, H]``.
      act: ``f(gate_up [..., 2I]) -> [..., I]``.
      implementation: ``"dense" | "ragged" | "auto"``.
    Returns: ``[N, H]`` in ``x.dtype`` (accumulated in float32).
    Raises: ImplementationUnavailable for an unknown implementation name.
    """
    n, _ = x.shape
    e = wi.shape[0]
    impl = implementation
    if impl == "auto":
        impl = "dense" if n * e <= 65536 else "ragged"
    if impl == "dense":
        record_implementation("moe", "dense")
        return _dense(x, weights, experts, wi, wo, act)
    if impl == "ragged":
        record_implementation("moe", "ragged")
        return _ragged(x, weights, experts, wi, wo, act)
    raise ImplementationUnavailable(f"moe implementation {implementation!r} is not one of dense|ragged|auto")


def _dense(x, weights, experts, wi, wo, act):
    e = wi.shape[0]
    combine = jnp.zeros((x.shape[0], e), jnp.float32)
    combine = jax.vmap(lambda c, i, w: c.at[i].add(w))(combine, experts, weights)
    h = jnp.einsum("nh,ehf->enf", x, wi.astype(x.dtype), preferred_element_type=jnp.float32)
    y = jnp.einsum("enf,efh->enh", act(h.astype(x.dtype)), wo.astype(x.dtype), preferred_element_type=jnp.float32)
    return jnp.einsum("enh,ne->nh", y, combine).astype(x.dtype)


def _ragged(x, weights, experts, wi, wo, act):
    n, k = experts.shape
    e = wi.shape[0]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token_of = order // k
    xs = jnp.take(x, token_of, axis=0)
    group_sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    h = jax.lax.ragged_dot(xs, wi.astype(x.dtype), group_sizes, preferred_element_type=jnp.float32)
    y = jax.lax.ragged_dot(act(h.astype(x.dtype)), wo.astype(x.dtype), group_sizes,
                           preferred_element_type=jnp.float32)
    w = jnp.take(weights.reshape(-1), order)
    y = y * w[:, None]
    # Un-permute: slot order[i] of the flattened [N*k] array receives row i.
    out = jnp.zeros((n * k, y.shape[-1]), jnp.float32).at[order].set(y)
    return out.reshape(n, k, -1).sum(axis=1).astype(x.dtype)
