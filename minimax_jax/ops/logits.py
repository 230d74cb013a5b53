"""The lm-head matmul: float32 logits with a backward pass in the compute dtype.

``jnp.einsum(h, w, preferred_element_type=float32)`` gives float32 logits from bf16 operands, but its
automatic transpose multiplies the float32 cotangent ``d logits`` with bf16 operands, which XLA
promotes to float32 (TF32 on Hopper) matmuls (their share of a training step: see BENCHMARKS.md,
"Training step", run 12). Here the cotangent is rounded to the operands' dtype first (the usual
mixed-precision convention: activations and their gradients in bf16, accumulation in float32), so the
backward runs on bf16 tensor cores. With float32 operands nothing changes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["logits_matmul"]


@jax.custom_vjp
def logits_matmul(h: jax.Array, w: jax.Array) -> jax.Array:
    """``h @ w`` with float32 accumulation and output.

    Args:
      h: ``[..., H]`` hidden states (compute dtype, e.g. bf16).
      w: ``[H, V]`` output projection, already in ``h``'s dtype.
    Returns: logits ``[..., V]`` float32. Gradients: ``dh`` in ``h.dtype``, ``dw`` in ``w.dtype``, both
    computed from the cotangent rounded to ``h.dtype`` with float32 accumulation (module docstring).
    Raises: ValueError when ``h`` and ``w`` differ in dtype or in the contracted size.
    """
    _check(h, w)
    return jnp.einsum("...h,hv->...v", h, w, preferred_element_type=jnp.float32)


def _check(h, w):
    if h.dtype != w.dtype or h.shape[-1] != w.shape[0] or w.ndim != 2:
        raise ValueError(f"logits_matmul: h {h.shape} {h.dtype} and w {w.shape} {w.dtype} must share the dtype "
                         "and the hidden size (w is [H, V])")


def _fwd(h, w):
    return logits_matmul(h, w), (h, w)


def _bwd(res, g):
    h, w = res
    g = g.astype(h.dtype)
    dh = jnp.einsum("...v,hv->...h", g, w, preferred_element_type=jnp.float32).astype(h.dtype)
    dw = jnp.einsum("...h,...v->hv", h, g, preferred_element_type=jnp.float32).astype(w.dtype)
    return dh, dw


logits_matmul.defvjp(_fwd, _bwd)
