"""MoE expert computation: ``moe_experts``, the weighted sum of the chosen experts' gated MLPs
(registry op ``"moe"``).

Implementations (``implementation=``):
- ``"xla_dense"``: every expert on every token, combined by a ``[N, E]`` weight matrix. Exact and the
  fastest on CPU for tiny models; O(E/k) wasted FLOPs.
- ``"xla_ragged"``: dropless. Sort assignments by expert (``permute``: gathers forward and backward, no
  scatter-add), grouped matmul through XLA ``jax.lax.ragged_dot``, un-permute.
- ``"xla_capacity"``: fixed shapes with token dropping: each expert takes at most
  ``C = ceil(capacity_factor * N * k / E)`` rows (first come in token order), computed as one batched
  matmul ``[E, C, H] x [E, H, 2I]``; dropped assignments contribute 0.
- ``"tokamax"``: as ``"xla_ragged"`` with tokamax's Mosaic grouped matmul (GPU Hopper / TPU). Opt-in only:
  its weight gradients are several percent off the fp32 reference (``grouped_matmul.py``).
- ``"pallas_gpu"``: as ``"xla_ragged"`` with the project's Pallas (Triton-lowered) grouped-matmul kernels
  (``pallas_kernels.moe.gpu_gmm``; GPU only); ``"pallas_gpu_interpret"``: the same kernels in Pallas
  interpret mode (CPU tests). Accuracy and rates: BENCHMARKS.md (MoE).
- ``"auto"``: inside ``minimax_jax.sharding.use_mesh`` -> expert parallel (below) with the grouped matmul
  ``"auto"`` (``"pallas_gpu"`` on GPU, XLA elsewhere); otherwise ``"xla_dense"`` when
  ``N * E <= DENSE_MAX_TOKENS_X_EXPERTS`` and the layer's expert weights hold at most
  ``DENSE_MAX_EXPERT_BYTES`` (decode steps, prefill chunks of small models: one compiled program, no
  grouped-matmul autotuning per new shape, which made a long prefill of the demo model time out) unless the
  experts are FP8 on a GPU (the grouped kernel then reads their FP8 bytes, where ``"xla_dense"`` would
  dequantise every expert each step), else ``"pallas_gpu"`` on a GPU backend and ``"xla_ragged"`` elsewhere.
  Never ``"tokamax"``. (``"xla_dense"`` reads every expert for every token, and XLA's GPU compiler writes a
  float32 copy of them: at M2's experts a 9.7 GB copy per layer and step, BENCHMARKS.md (MoE).)
Inside ``use_mesh`` the implementations ``"auto" | "xla_ragged" | "tokamax" | "pallas_gpu*"`` run
expert-parallel in ``shard_map`` (``expert_parallel.py``); ``"xla_dense"`` / ``"xla_capacity"`` stay
GSPMD-partitioned. What ran is recorded under ``"moe"`` (``minimax_jax.ops.registry.implementation_report``):
the implementation's name, or ``expert_parallel[<transport>,<grouped matmul>,ep=P,tp=T]``.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

from minimax_jax import sharding
from minimax_jax.ops import registry
from minimax_jax.ops.moe.expert_parallel import TRANSPORTS, moe_expert_parallel
from minimax_jax.ops.moe.fp8_weight import Fp8Weight
from minimax_jax.ops.moe.fused_first import expert_mlp_from_tokens
from minimax_jax.ops.moe.grouped_matmul import tokamax_supports
from minimax_jax.ops.moe.permute import gather_rows, group_starts, permute_rows, sort_by_expert, unpermute_combine
from minimax_jax.ops.registry import Implementation, ImplementationUnavailable

__all__ = ["MOE_IMPLEMENTATIONS", "DENSE_MAX_TOKENS_X_EXPERTS", "DENSE_MAX_EXPERT_BYTES", "moe_experts", "capacity_of"]

OP = "moe"
#: ``"auto"`` outside a mesh runs ``"xla_dense"`` up to this many tokens x experts (module docstring).
DENSE_MAX_TOKENS_X_EXPERTS = 65536
#: ... and up to this many bytes of expert weights (``wi`` + ``wo``) per layer (module docstring).
DENSE_MAX_EXPERT_BYTES = 64 * 2**20


def capacity_of(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Rows per expert of the ``"xla_capacity"`` path: ``ceil(cf * N * k / E)`` (at least 1).

    Raises ValueError for ``capacity_factor <= 0``."""
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
    return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def moe_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, wi: jax.Array, wo: jax.Array, act: Callable,
                *, implementation: str = "auto", capacity_factor: float | None = None,
                ep_transport: str = "auto") -> jax.Array:
    """Weighted sum of the chosen experts' gated MLPs.

    Args:
      x: ``[N, H]`` compute dtype.
      weights: ``[N, k]`` float32 routing weights; experts: ``[N, k]`` int32 expert ids.
      wi: ``[E, H, 2I]`` fused gate/up; wo: ``[E, I, H]``; either may be an ``Fp8Weight`` (FP8 experts kept in
        FP8: the grouped matmul dequantises per tile in the GPU kernel or per expert chunk in XLA,
        ``grouped_matmul.py``; ``"xla_dense"`` / ``"xla_capacity"`` dequantise the layer's experts inside the
        step; expert parallelism shards them as stored when their blocks split with the expert width,
        ``expert_parallel.py``).
      act: ``f(gate_up [..., 2I]) -> [..., I]``; a ``GatedActivation`` (what the model passes) is fused into the
        first grouped matmul's epilogue by the Pallas kernels in forward-only calls, which outside a mesh also
        gathers its rows from x (``fused_first.py``; inside one ``grouped_matmul.sorted_expert_mlp``); any other
        callable runs after it.
      implementation: one of ``MOE_IMPLEMENTATIONS`` (module docstring).
      capacity_factor: rows per expert for ``"xla_capacity"`` (required there; ignored elsewhere).
      ep_transport: expert-parallel exchange, one of ``expert_parallel.TRANSPORTS``.
    Returns: ``[N, H]`` in ``x.dtype`` (accumulated in float32).
    Raises: ImplementationUnavailable for an unknown or unavailable implementation or an unknown
      transport; ValueError for ``"xla_capacity"`` without a capacity factor, or for shapes / dtypes that do not
      fit together as above (the message names the operand). Expert ids outside ``[0, E)`` (traced values, not
      checked) contribute nothing to their token in every implementation, and leave every other token's output
      unchanged.
    """
    _check_shapes(x, weights, experts, wi, wo)
    # int32 ids whatever integer type came in (a narrower one wraps E in comparisons and overflows slot
    # arithmetic); an id outside [0, E) gets weight 0 here (0, not 0 * a non-finite weight) and is routed
    # nowhere by each implementation.
    experts = experts.astype(jnp.int32)
    valid = (experts >= 0) & (experts < wi.shape[0])
    weights = jnp.where(valid, weights, jnp.zeros((), weights.dtype))
    if ep_transport not in TRANSPORTS:
        raise ImplementationUnavailable(f"expert-parallel transport {ep_transport!r} is not one of {TRANSPORTS}")
    if implementation == "xla_capacity" and capacity_factor is None:
        raise ValueError("moe implementation 'xla_capacity' needs capacity_factor")
    return registry.dispatch(OP, implementation, x, weights, experts, wi, wo, act,
                             capacity_factor=capacity_factor, ep_transport=ep_transport)


def _check_shapes(x, weights, experts, wi, wo) -> None:
    """One-line ValueErrors for operands that do not fit ``moe_experts``' contract."""
    def bad(what):
        raise ValueError(f"moe_experts: {what} (x {tuple(x.shape)}, weights {tuple(weights.shape)}, experts "
                         f"{tuple(experts.shape)}, wi {tuple(wi.shape)}, wo {tuple(wo.shape)})")
    if x.ndim != 2 or weights.ndim != 2 or experts.ndim != 2 or len(wi.shape) != 3 or len(wo.shape) != 3:
        bad("expects x [N, H], weights / experts [N, k], wi [E, H, 2I], wo [E, I, H]")
    if weights.shape != experts.shape or weights.shape[0] != x.shape[0]:
        bad("weights and experts must be [N, k] with N the rows of x")
    if not jnp.issubdtype(experts.dtype, jnp.integer):
        bad(f"experts must hold integer expert ids, got {experts.dtype}")
    e, h, two_i = wi.shape
    if h != x.shape[1] or two_i % 2:
        bad("wi must be [E, H, 2I]: H the width of x, an even gate/up width")
    if tuple(wo.shape) != (e, two_i // 2, h):
        bad(f"wo must be [E, I, H] = [{e}, {two_i // 2}, {h}]")


def _auto(backend, x, weights, experts, wi, wo, act, **_):
    grouped = ["pallas_gpu", "xla_ragged"] if backend == "gpu" else ["xla_ragged"]
    # FP8 experts on a GPU: the grouped kernel reads the chosen experts' FP8 bytes once, where "xla_dense"
    # would dequantise every expert of the layer in every decode step (5x the weight traffic)
    fp8_gpu = backend == "gpu" and any(isinstance(w, Fp8Weight) for w in (wi, wo))
    expert_bytes = sum(w.nbytes if isinstance(w, Fp8Weight) else w.size * w.dtype.itemsize for w in (wi, wo))
    if (sharding.current() is None and not fp8_gpu and expert_bytes <= DENSE_MAX_EXPERT_BYTES
            and x.shape[0] * wi.shape[0] <= DENSE_MAX_TOKENS_X_EXPERTS):
        return ["xla_dense"]
    return grouped


def _dropless_impl(gmm: str):
    """The dropless path with grouped-matmul implementation ``gmm``: expert parallel inside ``use_mesh``."""
    def run(x, weights, experts, wi, wo, act, *, ep_transport, **_):
        # An id outside [0, E) would index past the group sizes / offsets (a neighbour's rows): expert 0
        # instead, with the weight 0 moe_experts gave it.
        experts = jnp.where((experts >= 0) & (experts < wi.shape[0]), experts, 0)
        ctx = sharding.current()
        if ctx is not None:
            return moe_expert_parallel(x, weights, experts, wi, wo, act, mesh=ctx[0], rules=ctx[1], gmm_impl=gmm,
                                       transport=ep_transport)
        return _dropless(x, weights, experts, wi, wo, act, gmm)
    return run


def _dense(x, weights, experts, wi, wo, act, **_):
    e = wi.shape[0]
    combine = jnp.einsum("nke,nk->ne", jax.nn.one_hot(experts, e, dtype=jnp.float32), weights.astype(jnp.float32))
    h = jnp.einsum("nh,ehf->enf", x, wi.astype(x.dtype), preferred_element_type=jnp.float32)
    y = jnp.einsum("enf,efh->enh", act(h.astype(x.dtype)), wo.astype(x.dtype), preferred_element_type=jnp.float32)
    return jnp.einsum("enh,ne->nh", y, combine).astype(x.dtype)


def _dropless(x, weights, experts, wi, wo, act, gmm_impl):
    order, inv, group_sizes = sort_by_expert(experts, wi.shape[0])
    ys = expert_mlp_from_tokens(x, order, inv, group_sizes, wi, wo, act, gmm_impl, out_dtype=x.dtype)
    return unpermute_combine(ys, weights, order, inv).astype(x.dtype)


def _capacity(x, weights, experts, wi, wo, act, *, capacity_factor, **_):
    n, k = experts.shape
    e = wi.shape[0]
    m = n * k
    cap = capacity_of(n, k, e, capacity_factor)
    # an id outside [0, E) sorts last and is dropped (no capacity used; moe_experts gave it weight 0)
    experts = jnp.where((experts >= 0) & (experts < e), experts, e)
    order, inv, group_sizes = sort_by_expert(experts, e)
    starts = group_starts(group_sizes)
    xs = permute_rows(x, order, inv)                                     # [M, H] sorted by expert
    e_sorted = jnp.take(experts.reshape(-1), order)                      # expert of each sorted row
    pos = jnp.arange(m, dtype=jnp.int32) - jnp.take(starts, jnp.minimum(e_sorted, e - 1))   # rank in its expert
    keep = (pos < cap) & (e_sorted < e)
    slot = e_sorted * cap + pos                                          # row -> buffer slot
    c = jnp.arange(cap, dtype=jnp.int32)
    src = (starts[:, None] + c[None, :]).reshape(-1)                     # buffer slot -> row
    filled = (c[None, :] < group_sizes[:, None]).reshape(-1)
    buf = gather_rows(xs, src, filled, slot, keep).reshape(e, cap, -1)
    h = jnp.einsum("ech,ehf->ecf", buf, wi.astype(x.dtype), preferred_element_type=jnp.float32)
    y = jnp.einsum("ecf,efh->ech", act(h.astype(x.dtype)), wo.astype(x.dtype), preferred_element_type=jnp.float32)
    ys = gather_rows(y.astype(x.dtype).reshape(e * cap, -1), slot, keep, src, filled)
    return unpermute_combine(ys, weights, order, inv).astype(x.dtype)


_op = registry.register(OP, [
    Implementation("xla_dense", _dense),
    Implementation("xla_ragged", _dropless_impl("xla")),
    Implementation("xla_capacity", _capacity),
    Implementation("tokamax", _dropless_impl("tokamax"), platforms=("gpu", "tpu"), supports=tokamax_supports),
    Implementation("pallas_gpu", _dropless_impl("pallas_gpu"), platforms=("gpu",)),
    Implementation("pallas_gpu_interpret", _dropless_impl("pallas_gpu_interpret")),
], auto=_auto)

#: Every ``implementation=`` name, ``"auto"`` first (``minimax_jax.config`` checks ``moe_impl`` against it).
MOE_IMPLEMENTATIONS = _op.names
