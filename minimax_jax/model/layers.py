"""Building blocks of the decoder as pure functions: norms, RoPE, projections, MLPs.

Math sources: transformers ``modeling_minimax_m2.py`` (Mixtral RMSNorm, FlexOlmo full-width q/k
norm, GLM4-MoE partial rotary), ``modeling_minimax_m3_vl.py`` (Gemma norm ``x_hat * (1 + w)``,
per-head q/k norm, swigluoai activation, shared expert); RoPE: Su et al. 2021 (NeoX half-split form).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from minimax_jax.config import ModelConfig
from minimax_jax.ops.moe.activation import GatedActivation

__all__ = ["rms_norm", "rope_frequencies", "apply_rope", "gated_activation", "swiglu", "dense_mlp"]


def rms_norm(x: jax.Array, scale: jax.Array, *, eps: float, kind: str) -> jax.Array:
    """RMSNorm over the last axis, computed in float32, returned in ``x.dtype``.

    Args:
      x: ``[..., N]`` any float dtype.
      scale: ``[N]`` weights as stored in the checkpoint.
      eps: epsilon added to the mean square.
      kind: ``"rms"`` (``y = x_hat * w``, M2/Mixtral) or ``"gemma"`` (``y = x_hat * (1 + w)``, M3).
    Returns: ``[..., N]`` in ``x.dtype``.
    """
    xf = x.astype(jnp.float32)
    xhat = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    w = scale.astype(jnp.float32)
    if kind == "gemma":
        w = 1.0 + w
    elif kind != "rms":
        raise ValueError(f"unknown norm kind {kind!r}")
    return (xhat * w).astype(x.dtype)


def rope_frequencies(positions: jax.Array, rotary_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """Cosines and sines for partial NeoX RoPE.

    Args:
      positions: ``[B, T]`` int32 absolute token positions.
      rotary_dim: number of rotated channels (even); ``inv_freq = theta^(-arange(0, r, 2) / r)``.
      theta: RoPE base.
    Returns: ``(cos, sin)`` each ``[B, T, rotary_dim]`` float32 (frequencies repeated twice, half-split).
    """
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the first ``cos.shape[-1]`` channels of each head (NeoX half-split), pass the rest.

    Args:
      x: ``[B, T, heads, D]``.
      cos, sin: ``[B, T, r]`` float32 from ``rope_frequencies`` with ``r <= D``.
    Returns: ``[B, T, heads, D]`` in ``x.dtype``; rotation computed in float32.
    """
    r = cos.shape[-1]
    if r == 0:
        return x
    xf = x.astype(jnp.float32)
    x_rot, x_pass = xf[..., :r], xf[..., r:]
    half = r // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    out = jnp.concatenate([x_rot * c + rotated * s, x_pass], axis=-1)
    return out.astype(x.dtype)


def gated_activation(cfg: ModelConfig) -> GatedActivation:
    """The config's gated MLP activation (``cfg.mlp_activation``: ``"silu"`` for M2, ``"swigluoai"`` for M3)."""
    return GatedActivation(cfg.mlp_activation, cfg.swiglu_alpha, cfg.swiglu_limit)


def swiglu(gate_up: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Gated activation over a fused ``[..., 2I]`` gate/up projection (gate first): ``gated_activation(cfg)``.

    ``"silu"``: ``silu(gate) * up`` (M2). ``"swigluoai"`` (M3): ``gate = min(gate, limit)``,
    ``up = clip(up, -limit, limit)``, ``out = gate * sigmoid(alpha * gate) * (up + 1)``.
    Returns ``[..., I]`` in the input dtype (computed in float32).
    """
    return gated_activation(cfg)(gate_up)


def dense_mlp(x: jax.Array, wi: jax.Array, wo: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Dense gated MLP: ``act(x @ wi) @ wo``. x ``[..., H]``, wi ``[H, 2I]``, wo ``[I, H]``."""
    h = jnp.einsum("...h,hf->...f", x, wi.astype(x.dtype))
    return jnp.einsum("...f,fh->...h", swiglu(h, cfg), wo.astype(x.dtype))
