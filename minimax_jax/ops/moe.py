"""MoE op: sigmoid top-k routing, expert computation with an ``implementation=`` choice, router
statistics, the aux-loss-free router-bias update and an optional load-balancing loss.

Routing math (MODEL_FACTS.md, transformers ``MiniMaxM2TopKRouter``): in float32,
``s = sigmoid(x @ W_router)``; experts are chosen by top-k of ``s + e_score_correction_bias``
(the bias only chooses); weights are ``s[chosen] / sum(s[chosen])``. Ties go to the lower id.

Expert computation (``moe_experts``), implementations:
- ``"dense"``: every expert on every token, combined by a ``[N, E]`` weight matrix. Exact and the
  fastest on CPU for tiny models; O(E/k) wasted FLOPs.
- ``"ragged"``: dropless. Sort assignments by expert (``moe_permute``: gathers forward and
  backward, no scatter-add), grouped matmul through XLA ``jax.lax.ragged_dot``, un-permute.
- ``"tokamax"``: as ``"ragged"`` with tokamax's Mosaic grouped matmul (GPU Hopper / TPU).
- ``"pallas_gpu"``: as ``"ragged"`` with the project's Pallas (Triton-lowered) grouped-matmul
  kernels (``pallas_kernels.moe.gpu_gmm``; GPU only); ``"pallas_gpu_interpret"``: the same kernels
  in Pallas interpret mode (CPU tests). H200 check (bench/moe.py, 2026-11-30, jax 0.11.2): relative
  Frobenius errors vs the fp32 reference y 0.0039, dx 0.0042, d wi 0.0038, d wo 0.0039 (as
  ``"ragged"``), 283-432 TFLOP/s forward, 299-427 forward+backward (``"ragged"``: 3-22).
- ``"capacity"``: fixed shapes with token dropping: each expert takes at most
  ``C = ceil(capacity_factor * N * k / E)`` rows (first come in token order), computed as one batched
  matmul ``[E, C, H] x [E, H, 2I]``; dropped assignments contribute 0.
- ``"auto"``: inside ``minimax_jax.sharding.use_mesh`` -> expert parallel (below) with the grouped
  matmul ``"auto"`` (``"pallas_gpu"`` on GPU, XLA elsewhere); otherwise ``"dense"`` when
  ``N * E <= 65536`` (decode steps, prefill chunks, tiny models: one compiled program, no
  grouped-matmul autotuning per new shape, which made a 128K-token prefill of the demo model time
  out on the H200), else ``"pallas_gpu"`` on a GPU backend and ``"ragged"`` elsewhere. The
  resolved name is what is recorded. ``"auto"`` does not pick ``"tokamax"``: on the H200
  (bench/moe.py check, 2026-11-30, tokamax 0.0.17) its weight gradients were off by 6-8%
  (relative Frobenius error of d wi / d wo vs the fp32 reference, against 0.4% for ``"ragged"``
  and the inputs' gradient; upstream: openxla/tokamax issue 887), so it is opt-in
  (``moe_impl="tokamax"``) until that is resolved.
Inside ``use_mesh`` the implementations ``"auto" | "ragged" | "tokamax" | "pallas_gpu*"`` run expert-parallel in
``shard_map`` (``minimax_jax.parallel.expert``); ``"dense"``/``"capacity"`` stay GSPMD-partitioned.
The resolved path is recorded under ``"moe"`` (``minimax_jax.ops.common.implementation_report``).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from minimax_jax.ops.common import (ImplementationUnavailable, default_backend, match_cotangent, record_implementation,
                                    vma_type)
from minimax_jax.ops.grouped_matmul import grouped_matmul, zeros_past_sum
from minimax_jax.ops.moe_permute import gather_rows, group_starts, permute_rows, sort_by_expert, unpermute_combine

__all__ = ["BACKENDS_OF", "MOE_IMPLEMENTATIONS", "router_scores", "route", "moe_experts", "sorted_expert_mlp",
           "capacity_of", "update_router_bias", "update_router_biases", "load_balancing_loss"]

MOE_IMPLEMENTATIONS = ("auto", "dense", "ragged", "tokamax", "pallas_gpu", "pallas_gpu_interpret", "capacity")
#: Implementations that run only on some backends (the others run anywhere): name -> backends.
BACKENDS_OF = {"pallas_gpu": ("gpu",), "tokamax": ("gpu", "tpu")}
# dropless implementations -> grouped-matmul implementation (minimax_jax.ops.grouped_matmul)
_GMM_OF = {"auto": "auto", "ragged": "xla", "tokamax": "tokamax", "pallas_gpu": "pallas_gpu",
           "pallas_gpu_interpret": "pallas_gpu_interpret"}


# ----------------------------------------------------------------------------- routing
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
    """
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


def update_router_biases(params: dict[str, Any], cfg, router_load: jax.Array, rate: float | jax.Array) -> dict[str, Any]:
    """Apply ``update_router_bias`` to every MoE layer of a params tree.

    Args:
      params: the model params; ``params["segments"][i]["mlp"]["router_bias"]`` is ``[L_i, E]``.
      cfg: the ModelConfig (segments come from ``layer_segments(cfg)``).
      router_load: ``[num_moe_layers, E]`` = ``forward(...).aux["router_load"]`` (MoE layers in order;
        sum it over micro-batches / data shards first if needed).
      rate: step size.
    Returns: a new params tree (other leaves shared, not copied); MTP layers are left unchanged.
    Raises: ValueError when ``router_load`` does not have one row per MoE layer.
    """
    from minimax_jax.model.params import layer_segments  # noqa: PLC0415  (model imports ops)

    if router_load.shape[0] != cfg.num_moe_layers:
        raise ValueError(f"router_load has {router_load.shape[0]} rows, the config has {cfg.num_moe_layers} MoE layers")
    out = dict(params)
    segs = list(params["segments"])
    row = 0
    for i, seg in enumerate(layer_segments(cfg)):
        if seg.mlp_type != "moe":
            continue
        mlp = dict(segs[i]["mlp"])
        mlp["router_bias"] = update_router_bias(mlp["router_bias"], router_load[row:row + seg.length], rate)
        segs[i] = {**segs[i], "mlp": mlp}
        row += seg.length
    out["segments"] = segs
    return out


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


# ----------------------------------------------------------------------------- experts
def capacity_of(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Rows per expert of the ``"capacity"`` path: ``ceil(cf * N * k / E)`` (at least 1)."""
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
    return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def sorted_expert_mlp(xs: jax.Array, group_sizes: jax.Array, wi: jax.Array, wo: jax.Array, act: Callable,
                      gmm_impl: str, out_dtype=jnp.float32) -> jax.Array:
    """Gated expert MLP on rows sorted by expert: ``[M, H] -> [M, H]`` in ``out_dtype``.

    Args: ``xs [M, H]`` compute dtype, rows sorted by expert; ``group_sizes [G]`` int32, sum <= M;
      ``wi [G, H, 2I]`` (gate columns first), ``wo [G, I, H]``; ``act`` maps ``[..., 2I] -> [..., I]``;
      ``gmm_impl`` a grouped-matmul implementation (``grouped_matmul.GMM_IMPLEMENTATIONS``); ``out_dtype``
      of the result (both grouped matmuls accumulate in float32; a caller that narrows the result anyway
      passes its dtype, the values are the same).
    Returns ``[M, H]`` in ``out_dtype``; rows past ``sum(group_sizes)`` are 0 (masked here unless the
    implementation already stores zeros there, ``grouped_matmul.zeros_past_sum``).
    Raises ImplementationUnavailable for an implementation that cannot run here.
    """
    h = grouped_matmul(xs, wi, group_sizes, implementation=gmm_impl)
    y = grouped_matmul(act(h.astype(xs.dtype)), wo, group_sizes, implementation=gmm_impl).astype(out_dtype)
    if zeros_past_sum(gmm_impl):
        # the kernels already store exact zeros there: a mask would be a pass over [M, H] in the forward
        # and another over its cotangent (0.3 + 0.44 ms of M2's 8K layer on the H200, session 13 profile)
        return y
    live = jnp.arange(xs.shape[0]) < jnp.sum(group_sizes)
    return jnp.where(live[:, None], y, jnp.zeros((), y.dtype))


def moe_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, wi: jax.Array, wo: jax.Array, act: Callable,
                *, implementation: str = "auto", capacity_factor: float | None = None,
                ep_transport: str = "auto") -> jax.Array:
    """Weighted sum of the chosen experts' gated MLPs.

    Args:
      x: ``[N, H]`` compute dtype.
      weights: ``[N, k]`` float32 routing weights; experts: ``[N, k]`` int32 expert ids.
      wi: ``[E, H, 2I]`` fused gate/up; wo: ``[E, I, H]``.
      act: ``f(gate_up [..., 2I]) -> [..., I]``.
      implementation: one of ``MOE_IMPLEMENTATIONS`` (module docstring).
      capacity_factor: rows per expert for ``"capacity"`` (required there; ignored elsewhere).
      ep_transport: expert-parallel exchange, ``"auto" | "all_to_all" | "ragged_all_to_all"``.
    Returns: ``[N, H]`` in ``x.dtype`` (accumulated in float32).
    Raises: ImplementationUnavailable for an unknown or unavailable implementation; ValueError for
      ``"capacity"`` without a capacity factor.
    """
    if implementation not in MOE_IMPLEMENTATIONS:
        raise ImplementationUnavailable(f"moe implementation {implementation!r} is not one of {MOE_IMPLEMENTATIONS}")
    n = x.shape[0]
    e = wi.shape[0]
    from minimax_jax import sharding  # noqa: PLC0415  (sharding imports the model lazily)

    ctx = sharding.current()
    if ctx is not None and implementation in _GMM_OF:
        from minimax_jax.parallel.expert import moe_expert_parallel  # noqa: PLC0415

        gmm = _GMM_OF[implementation]
        return moe_expert_parallel(x, weights, experts, wi, wo, act, mesh=ctx[0], rules=ctx[1], gmm_impl=gmm,
                                   transport=ep_transport)
    impl = implementation
    if impl == "auto":
        impl = "dense" if n * e <= 65536 else ("pallas_gpu" if default_backend() == "gpu" else "ragged")
    if impl == "dense":
        record_implementation("moe", "dense")
        return _dense(x, weights, experts, wi, wo, act)
    if impl == "capacity":
        if capacity_factor is None:
            raise ValueError("moe implementation 'capacity' needs capacity_factor")
        record_implementation("moe", "capacity")
        return _capacity(x, weights, experts, wi, wo, act, capacity_factor)
    gmm = _GMM_OF[impl]
    record_implementation("moe", impl)
    return _dropless(x, weights, experts, wi, wo, act, gmm)


def _dense(x, weights, experts, wi, wo, act):
    e = wi.shape[0]
    combine = jnp.einsum("nke,nk->ne", jax.nn.one_hot(experts, e, dtype=jnp.float32), weights.astype(jnp.float32))
    h = jnp.einsum("nh,ehf->enf", x, wi.astype(x.dtype), preferred_element_type=jnp.float32)
    y = jnp.einsum("enf,efh->enh", act(h.astype(x.dtype)), wo.astype(x.dtype), preferred_element_type=jnp.float32)
    return jnp.einsum("enh,ne->nh", y, combine).astype(x.dtype)


def _dropless(x, weights, experts, wi, wo, act, gmm_impl):
    order, inv, group_sizes = sort_by_expert(experts, wi.shape[0])
    xs = permute_rows(x, order, inv)
    ys = sorted_expert_mlp(xs, group_sizes, wi, wo, act, gmm_impl, out_dtype=x.dtype)
    return unpermute_combine(ys, weights, order, inv).astype(x.dtype)


def _capacity(x, weights, experts, wi, wo, act, capacity_factor):
    n, k = experts.shape
    e = wi.shape[0]
    m = n * k
    cap = capacity_of(n, k, e, capacity_factor)
    order, inv, group_sizes = sort_by_expert(experts, e)
    starts = group_starts(group_sizes)
    xs = permute_rows(x, order, inv)                                     # [M, H] sorted by expert
    e_sorted = jnp.take(experts.reshape(-1), order)                      # expert of each sorted row
    pos = jnp.arange(m, dtype=jnp.int32) - jnp.take(starts, e_sorted)    # rank inside its expert
    keep = pos < cap
    slot = e_sorted * cap + pos                                          # row -> buffer slot
    c = jnp.arange(cap, dtype=jnp.int32)
    src = (starts[:, None] + c[None, :]).reshape(-1)                     # buffer slot -> row
    filled = (c[None, :] < group_sizes[:, None]).reshape(-1)
    buf = gather_rows(xs, src, filled, slot, keep).reshape(e, cap, -1)
    h = jnp.einsum("ech,ehf->ecf", buf, wi.astype(x.dtype), preferred_element_type=jnp.float32)
    y = jnp.einsum("ecf,efh->ech", act(h.astype(x.dtype)), wo.astype(x.dtype), preferred_element_type=jnp.float32)
    ys = gather_rows(y.astype(x.dtype).reshape(e * cap, -1), slot, keep, src, filled)
    return unpermute_combine(ys, weights, order, inv).astype(x.dtype)
