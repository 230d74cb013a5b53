"""Grouped matmul with block-scaled FP8 weights dequantised in the kernel (MoE inference from FP8 checkpoints).

The kernel is ``gpu_gmm``'s forward with an FP8 rhs (``gmm_forward(..., rhs_scale=, scale_block=)``; module
docstring of ``gpu_gmm``, "FP8 weights"); this module picks its tiles (each weight tile inside one scale block),
says which blocks it takes, and wraps it for autodiff (lhs only: FP8 weights are inference constants).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.common import common_vma, match_vma
from pallas_kernels.moe.gpu_gmm import DEFAULT_DLHS_CONFIG, TileConfig, gmm_forward
from pallas_kernels.moe.gpu_gmm_gated import gated_activation_xla

__all__ = ["DEFAULT_FP8_CONFIG", "DECODE_FP8_CONFIG", "fp8_config", "fp8_unsupported", "gmm_fp8"]

#: Tiles of at most 64 x 128 weight elements, so one tile lies in one scale block of the published 128 x 128
#: blocks (one scale per tile). Prefill-sized calls take the first, decode-sized ones (a few rows per expert:
#: ``fp8_config``) the second, whose 16-row tiles waste less MMA work on visits of one or two rows while the
#: weights stream once. Untimed defaults until bench/moe_fp8.py runs on a GPU.
DEFAULT_FP8_CONFIG = TileConfig(128, 64, 128, 8, 4, half_tail=True)
DECODE_FP8_CONFIG = TileConfig(16, 128, 128, 4, 4)


def fp8_config(m: int, num_groups: int, block=(128, 128)) -> TileConfig:
    """The FP8 forward's tiles for ``m`` rows over ``num_groups`` experts in scale blocks ``block``:
    ``DECODE_FP8_CONFIG`` up to 16 rows per expert on average (decode steps), else ``DEFAULT_FP8_CONFIG``, with
    ``bk`` / ``bn`` cut to divide the block (``math.gcd``) so that each weight tile has one scale."""
    cfg = DECODE_FP8_CONFIG if m <= 16 * num_groups else DEFAULT_FP8_CONFIG
    return dataclasses.replace(cfg, bk=math.gcd(cfg.bk, block[0]), bn=math.gcd(cfg.bn, block[1]))


def fp8_unsupported(shape, block, config: TileConfig | None = None) -> str | None:
    """None when ``gmm_fp8`` takes an FP8 rhs of ``shape [G, K, N]`` in scale blocks ``block = (br, bc)`` with
    ``config`` (default: ``fp8_config``'s tiles, which need ``br`` and ``bc`` multiples of 16), else why not (a
    short sentence): every weight tile must lie in one scale block (``bk`` divides ``br``, ``bn`` divides ``bc``)."""
    if len(shape) != 3 or len(block) != 2:
        return f"rhs {tuple(shape)} / block {tuple(block)}: need [G, K, N] and (br, bc)"
    if config is None:
        if block[0] % 16 or block[1] % 16:
            return f"scale block {tuple(block)} is not a multiple of 16 x 16 (the smallest weight tile)"
        return None
    if block[0] % config.bk or block[1] % config.bn:
        return (f"scale block {tuple(block)} is not a multiple of the {config.bk} x {config.bn} weight tiles of "
                f"{config.label()}")
    return None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _gmm_fp8(lhs, rhs, scale, group_sizes, block, out_dtype, cfg, interpret, gate_fn):
    return gmm_forward(lhs, rhs, group_sizes, out_dtype=out_dtype, config=cfg, interpret=interpret,
                       rhs_scale=scale, scale_block=block, gate_fn=gate_fn)


def _gmm_fp8_fwd(lhs, rhs, scale, group_sizes, block, out_dtype, cfg, interpret, gate_fn):
    # lhs itself is not needed (unless the gated backward recomputes h), only its dtype and varying type: a
    # 0-row slice carries both
    return (_gmm_fp8(lhs, rhs, scale, group_sizes, block, out_dtype, cfg, interpret, gate_fn),
            (lhs if gate_fn else lhs[:0], rhs, scale, group_sizes))


def _gmm_fp8_bwd(block, out_dtype, cfg, interpret, gate_fn, res, dout):
    like, rhs, scale, group_sizes = res
    if gate_fn is not None:    # the activation's VJP at h, recomputed (FP8 experts are rarely differentiated)
        h = gmm_forward(like, rhs, group_sizes, config=cfg, interpret=interpret, rhs_scale=scale, scale_block=block)
        dout = jax.vjp(lambda h: gated_activation_xla(gate_fn, h, out_dtype), h)[1](dout)[0]
    s = jnp.repeat(jnp.repeat(scale, block[0], axis=1)[:, :rhs.shape[1]], block[1], axis=2)[:, :, :rhs.shape[2]]
    w = (rhs.astype(jnp.float32) * s).astype(like.dtype)      # the forward's dequantised weights
    dlhs = gmm_forward(dout.astype(like.dtype), w, group_sizes, transpose_rhs=True, config=DEFAULT_DLHS_CONFIG,
                       interpret=interpret)
    # FP8-kept weights are inference weights: constants here (zero cotangents, typed like their primals inside
    # shard_map), gradients reach lhs only
    return (match_vma(dlhs, like), match_vma(jnp.zeros(rhs.shape, rhs.dtype), rhs),
            match_vma(jnp.zeros(scale.shape, scale.dtype), scale), np.zeros(group_sizes.shape, jax.dtypes.float0))


_gmm_fp8.defvjp(_gmm_fp8_fwd, _gmm_fp8_bwd)


def gmm_fp8(lhs: jax.Array, rhs: jax.Array, rhs_scale: jax.Array, group_sizes: jax.Array, *,
            scale_block: tuple[int, int] = (128, 128), config: TileConfig | None = None, out_dtype=None,
            interpret: bool = False, gate_fn=None) -> jax.Array:
    """Grouped matmul with block-scaled FP8 weights dequantised in the kernel: ``out[rows of g] = lhs[rows of g]
    @ W[g]``, ``W[g, i, j] = float32(rhs[g, i, j]) * rhs_scale[g, i // br, j // bc]`` rounded to ``lhs.dtype``
    (DeepSeek-V3 / MiniMax FP8 block format, MODEL_FACTS.md section 1).

    Args:
      lhs: ``[M, K]`` bf16 / f16 / f32, rows sorted by group; rhs: ``[G, K, N]`` float8_e4m3fn; rhs_scale:
        ``[G, ceil(K/br), ceil(N/bc)]`` float32; group_sizes: int ``[G]`` (as ``gmm``).
      scale_block: ``(br, bc)``; config: tiles (default ``fp8_config(M, G, scale_block)``), each inside one scale block
        (``fp8_unsupported``); out_dtype: default ``lhs.dtype`` (fp32 accumulation).
      gate_fn: None, or the gated activation fused into the epilogue (``gpu_gmm_gated.gmm_gated``): rhs ``[G, K, 2I]``,
        output ``[M, I]``; needs ``I % bn == 0``.
    Returns: ``[M, N]`` (``[M, N / 2]`` with gate_fn); rows past ``sum(group_sizes)`` are 0. Only the FP8 bytes of
      the weights are read: the dequantised copy never exists. Equal, bit for bit, to ``gmm_forward`` on the
      weights dequantised first with the same tiles.
    Gradients: lhs gets the transposed grouped matmul over the weights dequantised to lhs.dtype (in lhs.dtype);
      the FP8 weights are constants (zero cotangents: FP8-kept checkpoints serve inference).
    Raises ValueError when the blocks and tiles do not fit (``fp8_unsupported``).
    """
    cfg = config or fp8_config(lhs.shape[0], rhs.shape[0], scale_block)
    why = fp8_unsupported(rhs.shape, scale_block, cfg)
    if why is None and gate_fn is not None and (rhs.shape[2] % 2 or (rhs.shape[2] // 2) % cfg.bn):
        why = f"gated: rhs {tuple(rhs.shape)} needs [G, K, 2I] with I a multiple of bn = {cfg.bn}"
    if why is not None:
        raise ValueError(f"gmm_fp8: {why}")
    # inside shard_map: one varying type for the operands first (as gpu_gmm.gmm), so the custom VJP's cotangents
    # are typed like their primals; no-op elsewhere
    lhs, rhs, rhs_scale, group_sizes = common_vma(lhs, rhs, rhs_scale.astype(jnp.float32),
                                                   group_sizes.astype(jnp.int32))
    return _gmm_fp8(lhs, rhs, rhs_scale, group_sizes, tuple(scale_block), jnp.dtype(out_dtype or lhs.dtype), cfg,
                    bool(interpret), gate_fn)
