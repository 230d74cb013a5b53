"""Dense projections whose weight may be kept in FP8 (registry op ``"linear"``): ``x @ w``.

A plain weight is multiplied in XLA (``x @ w.astype(x.dtype)``, no dispatch). An ``Fp8Weight`` (an FP8 checkpoint's
attention / index projections and dense MLPs, ``load_model(weights_dtype="fp8")``) dispatches:

- ``"xla"``: the weight dequantised to ``x.dtype`` in XLA, then the matmul. XLA writes the dequantised copy to
  device memory in every call (seen in the compiled decode step of M2's shapes: a bf16 copy of each of q / k / v /
  o_proj per layer and step), so a decode step moves about five times the FP8 weight's bytes.
- ``"pallas_gpu"``: ``pallas_kernels.moe.gpu_gmm_fp8.gmm_fp8`` with one group: the kernel reads the FP8 bytes and
  dequantises each tile (bit for bit the dequantised weight's values); ``"pallas_gpu_interpret"``: the same kernel
  in Pallas interpret mode (CPU tests).
- ``"auto"``: ``"pallas_gpu"`` on a GPU outside ``sharding.use_mesh`` or on a one-device mesh (a GSPMD-sharded
  weight would be gathered whole for the custom call) for calls of at most ``KERNEL_MAX_ROWS`` rows (decode and verification steps, where
  the weight's bytes are the cost) when the scale blocks fit its tiles; else ``"xla"`` (prefill-sized calls: the
  copy is amortised over many rows and cuBLAS's bf16 GEMM is the faster matmul).
What ran is recorded under ``"linear"`` (``registry.implementation_report``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from minimax_jax import sharding
from minimax_jax.ops import registry
from minimax_jax.ops.moe.fp8_weight import Fp8Weight
from minimax_jax.ops.registry import Implementation
from pallas_kernels.moe.gpu_gmm_fp8 import fp8_unsupported, gmm_fp8

__all__ = ["linear", "KERNEL_MAX_ROWS"]

OP = "linear"
#: ``"auto"`` runs the FP8 kernel for calls of at most this many rows (module docstring).
KERNEL_MAX_ROWS = 1024


def linear(x: jax.Array, w, *, implementation: str = "auto") -> jax.Array:
    """``x @ w`` in ``x.dtype`` (float32 accumulation).

    Args:
      x: ``[..., K]`` compute dtype.
      w: ``[K, N]`` array (cast to ``x.dtype``), or an ``Fp8Weight`` of that shape (module docstring).
      implementation: for an ``Fp8Weight``: ``"auto"`` | ``"xla"`` | ``"pallas_gpu"`` | ``"pallas_gpu_interpret"``;
        ignored for plain weights.
    Returns: ``[..., N]`` in ``x.dtype``.
    Raises: ValueError when the shapes do not fit; ImplementationUnavailable for a kernel that cannot take ``w``.
    """
    if len(w.shape) != 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"linear: x {tuple(x.shape)} and w {tuple(w.shape)} do not fit as [..., K] @ [K, N]")
    if not isinstance(w, Fp8Weight):
        return x @ w.astype(x.dtype)
    return registry.dispatch(OP, implementation, x, w)


def _xla(x, w):
    return x @ w.astype(x.dtype)


def _kernel(interpret: bool):
    def run(x, w):
        x2 = x.reshape(-1, x.shape[-1])
        out = gmm_fp8(x2, w.w[None], w.scale_inv[None], jnp.full((1,), x2.shape[0], jnp.int32),
                      scale_block=tuple(w.block), interpret=interpret)
        return out.reshape(x.shape[:-1] + (w.shape[1],))
    return run


def _kernel_supports(x, w) -> str | None:
    why = fp8_unsupported((1,) + tuple(w.shape), tuple(w.block))
    if why is None and x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        why = f"the FP8 kernel takes bf16 / f16 / f32 activations, got {x.dtype}"
    return why


def _auto(backend, x, w):
    rows = x.size // x.shape[-1]
    ctx = sharding.current()
    if backend == "gpu" and (ctx is None or ctx[0].size == 1) and rows <= KERNEL_MAX_ROWS:
        return ["pallas_gpu", "xla"]
    return ["xla"]


registry.register(OP, [
    Implementation("xla", _xla),
    Implementation("pallas_gpu", _kernel(False), platforms=("gpu",), supports=_kernel_supports),
    Implementation("pallas_gpu_interpret", _kernel(True), supports=_kernel_supports),
], auto=_auto)
