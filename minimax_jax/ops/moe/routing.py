"""MoE routing: sigmoid top-k with a selection-only correction bias, the aux-loss-free router-bias update
and an optional load-balancing loss.

Math (MODEL_FACTS.md, transformers ``MiniMaxM2TopKRouter``): in float32, ``s = sigmoid(x @ W_router)``;
experts are chosen by top-k of ``s + e_score_correction_bias`` (the bias only chooses); weights are
``s[chosen] / sum(s[chosen])``. Ties go to the lower id.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common import match_cotangent, vma_type

__all__ = ["router_scores", "route", "update_router_bias", "load_balancing_loss"]


def router_scores(x: jax.Array, router: jax.Array) -> jax.Array:
    """``sigmoid(x @ router)`` in float32 (HIGHEST precision): ``[N, H] x [H, E] -> [N, E]``."""
    logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return jax.nn.sigmoid(logits)


def route(x: jax.Array, router: jax.Array, bias: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sigmoid top-k routing with a selection-only correction bias.

    Args:
      x: ``[N, H]`` tokens (any float dtype; cast to float32).
      router: ``[H, E]`` float32 router weights.
      bias: ``[E]`` float32 ``e_score_correction_bias`` (used only to choose experts).
      top_k: experts per token.
    Returns:
      ``(weights [N, k] float32 (rows sum to 1), experts [N, k] int32, load [E] float32)`` where
      ``load`` counts tokens routed to each expert (the router statistic the bias update uses).
    Raises ValueError (one line naming the shapes) for operands that do not fit or ``top_k`` outside ``[1, E]``.
    """
    if x.ndim != 2 or router.ndim != 2 or bias.shape != (router.shape[-1],) or x.shape[1] != router.shape[0]:
        raise ValueError(f"route: expects x [N, H], router [H, E], bias [E]; got x {tuple(x.shape)}, router "
                         f"{tuple(router.shape)}, bias {tuple(bias.shape)}")
    if not 1 <= int(top_k) <= router.shape[1]:
        raise ValueError(f"route: top_k must be in [1, E = {router.shape[1]}], got {top_k}")
    scores = router_scores(x, router)
    _, experts = jax.lax.top_k(scores + jax.lax.stop_gradient(bias.astype(jnp.float32))[None, :], top_k)
    experts = experts.astype(jnp.int32)
    chosen = _take_scores(scores, experts)
    weights = chosen / jnp.sum(chosen, axis=-1, keepdims=True)
    load = jnp.zeros((router.shape[1],), jnp.int32).at[experts.reshape(-1)].add(1).astype(jnp.float32)
    return weights, experts, jax.lax.stop_gradient(load)


@jax.custom_vjp
def _take_scores(scores: jax.Array, experts: jax.Array) -> jax.Array:
    """``scores[n, experts[n, j]]`` (``[N, E], [N, k] -> [N, k]``) whose backward is a masked sum
    over k (a fused compare-and-reduce) instead of take_along_axis's scatter-add."""
    return jnp.take_along_axis(scores, experts, axis=-1)


def _take_scores_fwd(scores, experts):
    return _take_scores(scores, experts), (experts, scores.shape[-1], vma_type(scores))


def _take_scores_bwd(res, g):
    experts, e, scores_type = res
    hit = experts[:, :, None] == jnp.arange(e, dtype=experts.dtype)[None, None, :]
    return match_cotangent(jnp.sum(jnp.where(hit, g[:, :, None], 0.0), axis=1), scores_type), None


_take_scores.defvjp(_take_scores_fwd, _take_scores_bwd)


def update_router_bias(bias: jax.Array, load: jax.Array, rate: float | jax.Array) -> jax.Array:
    """Aux-loss-free balancing step: ``bias + rate * sign(mean(load) - load)`` over the last axis.

    Args: bias ``[..., E]`` float32; load ``[..., E]`` tokens per expert (same leading shape);
      rate: step size (DeepSeek-V3 uses 1e-3). Returns the new bias, float32.
    """
    load = load.astype(jnp.float32)
    mean = jnp.mean(load, axis=-1, keepdims=True)
    return (bias.astype(jnp.float32) + jnp.asarray(rate, jnp.float32) * jnp.sign(mean - load)).astype(bias.dtype)


def load_balancing_loss(scores: jax.Array, experts: jax.Array) -> jax.Array:
    """Optional auxiliary balance loss ``E * sum_e f_e * p_e`` (Switch / DeepSeek style).

    Args: scores ``[N, E]`` from ``router_scores`` (differentiable); experts ``[N, k]`` chosen ids.
    ``f_e`` = fraction of the ``N * k`` assignments that went to expert e (no gradient);
    ``p_e`` = mean over tokens of the token-normalised score ``s_e / sum(s)``.
    Returns a float32 scalar; 1.0 for perfectly uniform routing. Multiply by a small coefficient.
    """
    n, e = scores.shape
    f = jnp.sum(jax.nn.one_hot(experts, e, dtype=jnp.float32), axis=(0, 1)) / (n * experts.shape[1])
    p = jnp.mean(scores / jnp.sum(scores, axis=-1, keepdims=True), axis=0)
    return e * jnp.sum(jax.lax.stop_gradient(f) * p)
