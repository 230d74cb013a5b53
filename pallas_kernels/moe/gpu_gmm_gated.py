"""The first MoE grouped matmul with its gated activation fused into the epilogue (``gmm_gated``): tiles, the
separate path's activation, and the autodiff wrapper. The kernel is ``gpu_gmm``'s forward with ``gate_fn``
(module docstring of ``gpu_gmm``, "gated epilogue").
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.common import common_vma
from pallas_kernels.moe.gpu_gmm import GROUPED_VISITS_MIN_BYTES, TileConfig, _check, _gmm_bwd, gmm_forward, shape_configs
from pallas_kernels.moe.gpu_tgmm_ws import WsTgmmConfig

__all__ = ["DEFAULT_GATED_CONFIG", "gated_config", "gated_activation_xla", "gmm_gated"]

#: ``bn`` columns of each half per program, so the tile has the shared memory and accumulators of
#: ``gpu_gmm.DEFAULT_CONFIG``'s 256 columns. Untimed (bench/moe.py's ``pallas_gpu`` layer variant runs it,
#: ``pallas_gpu_separate`` the separate path).
DEFAULT_GATED_CONFIG = TileConfig(128, 64, 128, 8, 4, half_tail=True)


def gated_config(half_width: int, config: TileConfig | None = None, weight_bytes: int = 0) -> TileConfig | str:
    """The tiles ``gmm_gated`` runs for gate / up halves of ``half_width`` (I) columns: ``config`` (default
    ``DEFAULT_GATED_CONFIG``, with ``visit_group = 4`` when an expert's ``[K, 2I]`` weight of ``weight_bytes``
    exceeds ``gpu_gmm.GROUPED_VISITS_MIN_BYTES``, as ``gpu_gmm.shape_configs``) with ``bn`` cut to the largest
    power of two up to ``bn`` that divides I (at least 16), or, when none does, why not (a short sentence)."""
    cfg = config or DEFAULT_GATED_CONFIG
    if config is None and weight_bytes > GROUPED_VISITS_MIN_BYTES:
        cfg = dataclasses.replace(cfg, visit_group=4)
    bn = cfg.bn
    while bn >= 16 and half_width % bn:
        bn //= 2
    if bn < 16:
        return f"gated epilogue: I = {half_width} is not a multiple of 16"
    return dataclasses.replace(cfg, bn=bn)


def gated_activation_xla(gate_fn, h: jax.Array, dtype) -> jax.Array:
    """The separate path's activation (XLA): ``h [M, 2I]`` (gate first) -> ``gate_fn`` in float32 -> ``[M, I]``
    in dtype (the backward of the gated kernels differentiates it)."""
    gate, up = jnp.split(h.astype(jnp.float32), 2, axis=-1)
    return gate_fn(gate, up).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8, 9))
def _gmm_gated(lhs, rhs, group_sizes, gate_fn, cfg, fwd_cfg, dlhs_cfg, tgmm_cfg, out_dtype, interpret):
    return gmm_forward(lhs, rhs, group_sizes, out_dtype=out_dtype, config=cfg, interpret=interpret, gate_fn=gate_fn)


def _gmm_gated_fwd(lhs, rhs, group_sizes, gate_fn, cfg, fwd_cfg, dlhs_cfg, tgmm_cfg, out_dtype, interpret):
    # differentiated: the separate path, whose h [M, 2I] the activation's VJP needs (kept as the residual)
    h = gmm_forward(lhs, rhs, group_sizes, config=fwd_cfg, interpret=interpret)
    return gated_activation_xla(gate_fn, h, out_dtype), (lhs, rhs, group_sizes, h)


def _gmm_gated_bwd(gate_fn, cfg, fwd_cfg, dlhs_cfg, tgmm_cfg, out_dtype, interpret, res, dout):
    lhs, rhs, group_sizes, h = res
    dh = jax.vjp(lambda h: gated_activation_xla(gate_fn, h, out_dtype), h)[1](dout)[0]
    return _gmm_bwd(lhs.dtype, fwd_cfg, dlhs_cfg, tgmm_cfg, interpret, (lhs, rhs, group_sizes), dh)


_gmm_gated.defvjp(_gmm_gated_fwd, _gmm_gated_bwd)


def gmm_gated(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, gate_fn, *, config: TileConfig | None = None,
              forward_config: TileConfig | None = None, dlhs_config: TileConfig | None = None,
              tgmm_config: TileConfig | WsTgmmConfig | None = None, out_dtype=None,
              interpret: bool = False) -> jax.Array:
    """Differentiable first MoE matmul with its gated activation fused: ``out[rows of g] = gate_fn(h[:, :I],
    h[:, I:])``, ``h = lhs[rows of g] @ rhs[g]`` rounded to lhs.dtype.

    Args:
      lhs: ``[M, K]`` bf16 / f16 / f32, rows sorted by group; rhs: ``[G, K, 2I]`` (gate columns first), lhs's dtype;
        group_sizes: int ``[G]`` (as ``gmm``).
      gate_fn: hashable elementwise ``f(gate, up) -> out`` on float32 arrays with ``f(0, 0) = 0`` (a gated
        activation, e.g. ``silu(gate) * up``).
      config: the fused kernel's tiles (default ``gated_config(I)``; ``gmm_forward``, ``gate_fn``).
      forward_config / dlhs_config / tgmm_config: the separate path's kernels, run when differentiated (default
        ``gpu_gmm.shape_configs``, as ``gmm``).
      out_dtype: default lhs.dtype.
    Returns: ``[M, I]``; rows past ``sum(group_sizes)`` are 0.
    Gradients: the forward is then the separate path (``gmm`` to h, the activation in XLA, h kept for the
      backward: the fused epilogue would have to write h anyway), the backward that of ``gmm`` on the
      activation's cotangent. So only inference (forward-only calls) runs the fused kernel.
    Raises ValueError when no tile fits I (``gated_config``), TypeError for configs of the wrong type.
    Math: MegaBlocks grouped GEMM (``gmm``) with a SwiGLU-style epilogue (Shazeer 2020, "GLU Variants Improve
      Transformer").
    """
    _check(lhs, rhs, group_sizes, False)
    for c in (config, forward_config, dlhs_config):
        if c is not None and not isinstance(c, TileConfig):
            raise TypeError(f"configs must be TileConfig or None, got {type(c).__name__}")
    if tgmm_config is not None and not isinstance(tgmm_config, (TileConfig, WsTgmmConfig)):
        raise TypeError(f"tgmm_config must be a TileConfig, a WsTgmmConfig or None, got {type(tgmm_config).__name__}")
    cfg = gated_config(rhs.shape[2] // 2, config, rhs.shape[1] * rhs.shape[2] * rhs.dtype.itemsize)
    if isinstance(cfg, str) or rhs.shape[2] % 2:
        raise ValueError(f"gmm_gated: rhs {rhs.shape}: {cfg if isinstance(cfg, str) else 'odd 2I'}")
    lhs, rhs, group_sizes = common_vma(lhs, rhs, group_sizes.astype(jnp.int32))
    base = shape_configs(rhs.shape[1], rhs.shape[2], rhs.dtype)
    return _gmm_gated(lhs, rhs, group_sizes, gate_fn, cfg, forward_config or base["fwd"],
                      dlhs_config or base["dlhs"], tgmm_config or base["tgmm"],
                      jnp.dtype(out_dtype or lhs.dtype), bool(interpret))
