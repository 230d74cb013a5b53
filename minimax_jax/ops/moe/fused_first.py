"""The dropless MoE path from tokens (``expert_mlp_from_tokens``): in forward-only calls the first expert matmul
gathers its input rows itself and applies the gated activation in its epilogue, so neither the sorted copy of the
tokens ``[M, H]`` nor the gate/up projection ``[M, 2I]`` is written (``M = tokens * top-k``). Differentiated, the
separate path runs (``permute_rows``, ``grouped_matmul``, the activation): its backward needs both.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from minimax_jax.ops import registry
from minimax_jax.ops.moe.fp8_weight import Fp8Weight
from minimax_jax.ops.moe.grouped_matmul import (GATED_REPORT, OP, _fp8_in_kernel_problem, _gated_problem,
                                                _record_fp8_in_kernel, grouped_matmul,
                                                sorted_expert_mlp, zeros_past_sum)
from minimax_jax.ops.moe.permute import permute_rows
from pallas_kernels.moe.gpu_gmm import gmm_forward
from pallas_kernels.moe.gpu_gmm_fp8 import fp8_config
from pallas_kernels.moe.gpu_gmm_gated import gated_config

__all__ = ["expert_mlp_from_tokens", "GATHER_REPORT"]

GATHER_REPORT = OP + ".gather"


def _gather_problem(impl: str, x, rows: int, wi, act) -> str | None:
    """Why the first matmul cannot gather its ``rows`` sorted rows from the tokens ``x`` itself (None when it can):
    it does so together with the gated epilogue (``grouped_matmul._gated_problem``), for a token matrix of < 2**31
    elements (int32 offsets), and for FP8 experts only where the kernel dequantises them itself."""
    why = _gated_problem(impl, jax.ShapeDtypeStruct((rows, x.shape[1]), x.dtype), wi, act)
    if why is None and isinstance(wi, Fp8Weight):
        fp8_why = _fp8_in_kernel_problem(wi, impl.endswith("interpret"))
        why = None if fp8_why is None else f"FP8 experts dequantised before the kernel ({fp8_why})"
    if why is None and x.size >= 2**31:
        why = f"tokens {tuple(x.shape)}: >= 2**31 elements (the kernel's gather offsets are int32)"
    return why


def _separate_first(x, wi, order, inv, group_sizes, act, impl):
    xs = permute_rows(x, order, inv)
    return act(grouped_matmul(xs, wi, group_sizes, implementation=impl).astype(x.dtype))


GATHERED = "the first grouped matmul gathers the token rows and applies the activation in its epilogue"


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _fused_first(x, wi, order, inv, group_sizes, act, impl):
    # traced only where the call is not differentiated (custom_vjp traces the fwd rule under AD), so the
    # reports say what the compiled program runs
    registry.record_implementation(GATHER_REPORT, GATHERED)
    registry.record_implementation(GATED_REPORT, "fused into the first grouped matmul's epilogue (gathered rows)")
    rows = order // (order.shape[0] // x.shape[0])          # sorted row -> its token
    interpret = impl.endswith("interpret")
    if isinstance(wi, Fp8Weight):
        cfg = fp8_config(order.shape[0], wi.shape[0], wi.block)
        _record_fp8_in_kernel(wi, cfg, "gmm_forward with gathered rows")
        return gmm_forward(x, wi.w, group_sizes, config=cfg, interpret=interpret, rhs_scale=wi.scale_inv,
                           scale_block=wi.block, gate_fn=act.gate_fn, lhs_rows=rows)
    cfg = gated_config(wi.shape[-1] // 2, weight_bytes=wi.shape[1] * wi.shape[2] * jnp.dtype(x.dtype).itemsize)
    return gmm_forward(x, wi.astype(x.dtype), group_sizes, config=cfg, interpret=interpret, gate_fn=act.gate_fn,
                       lhs_rows=rows)


def _fused_first_fwd(x, wi, order, inv, group_sizes, act, impl):
    # differentiated: the separate path (its backward needs the sorted rows and h), through its own VJPs
    registry.record_implementation(GATHER_REPORT, "separate (differentiated)")
    registry.record_implementation(GATED_REPORT, "separate (differentiated)")
    out, vjp = jax.vjp(lambda x, wi: _separate_first(x, wi, order, inv, group_sizes, act, impl), x, wi)
    return out, vjp


def _fused_first_bwd(act, impl, vjp, dout):
    return (*vjp(dout), None, None, None)


_fused_first.defvjp(_fused_first_fwd, _fused_first_bwd)


def expert_mlp_from_tokens(x: jax.Array, order: jax.Array, inv: jax.Array, group_sizes: jax.Array, wi, wo, act,
                           gmm_impl: str, out_dtype=jnp.float32) -> jax.Array:
    """Gated expert MLP of the rows ``x[order // k]`` (``permute.sort_by_expert``), in sorted order.

    Args: ``x [T, H]`` tokens (compute dtype); ``order`` / ``inv`` int32 ``[T * k]`` and ``group_sizes [G]`` from
      ``sort_by_expert``; ``wi``, ``wo``, ``act``, ``gmm_impl``, ``out_dtype`` as ``sorted_expert_mlp``.
    Returns ``[T * k, H]`` in out_dtype, rows sorted by expert (``sorted_expert_mlp(permute_rows(x, order, inv),
      ...)``); recorded under ``"grouped_matmul.gather"``: whether the first matmul gathered its rows (a
      ``GatedActivation`` in the Pallas kernels, in a call that is not differentiated) or why not (what each
      traced program runs: "separate (differentiated)" for a gradient).
    Raises ImplementationUnavailable for an implementation that cannot run here.
    """
    impl = registry.resolve(OP, gmm_impl, x, wi, group_sizes, preferred_element_type=x.dtype).name
    why = _gather_problem(impl, x, order.shape[0], wi, act)
    if why is not None:
        registry.record_implementation(GATHER_REPORT, f"separate ({why})")
        return sorted_expert_mlp(permute_rows(x, order, inv), group_sizes, wi, wo, act, gmm_impl, out_dtype=out_dtype)
    a = _fused_first(x, wi, order, inv, group_sizes.astype(jnp.int32), act, impl)
    y = grouped_matmul(a, wo, group_sizes, implementation=impl).astype(out_dtype)
    assert zeros_past_sum(impl)       # the Pallas kernels store 0 past the group sum: no mask needed
    return y
