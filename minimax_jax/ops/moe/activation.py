"""Gated MLP activations (SwiGLU and MiniMax-M3's clamped ``swigluoai``) as one hashable value, so that the MoE
op can fuse them into the first grouped matmul's epilogue (``pallas_kernels.moe.gpu_gmm.gmm_gated``) and
recognise them (any other callable runs after the matmul, in XLA).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

__all__ = ["GatedActivation", "GATED_KINDS"]

GATED_KINDS = ("silu", "swigluoai")


@dataclasses.dataclass(frozen=True)
class GatedActivation:
    """Gated activation over a fused ``[..., 2I]`` gate/up projection (gate columns first).

    ``"silu"``: ``silu(gate) * up`` (SwiGLU, Shazeer 2020; MiniMax-M2). ``"swigluoai"`` (MiniMax-M3, as
    gpt-oss): ``gate = min(gate, limit)``, ``up = clip(up, -limit, limit)``, ``out = gate * sigmoid(alpha *
    gate) * (up + 1)``. ``alpha`` / ``limit`` only matter for ``"swigluoai"``. Raises ValueError for another kind.
    """
    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self):
        if self.kind not in GATED_KINDS:
            raise ValueError(f"gated activation kind must be one of {GATED_KINDS}, got {self.kind!r}")

    def pair(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        """Elementwise on float32 gate / up values of one shape (``f(0, 0) = 0``); float32 out."""
        if self.kind == "silu":
            return jax.nn.silu(gate) * up
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        return gate * jax.nn.sigmoid(self.alpha * gate) * (up + 1.0)

    @property
    def gate_fn(self) -> "_Pair":
        """``pair`` as a hashable callable equal across equal activations (a kernel's static argument)."""
        return _Pair(self)

    def __call__(self, gate_up: jax.Array) -> jax.Array:
        """``[..., 2I] -> [..., I]`` in the input dtype, computed in float32."""
        gate, up = jnp.split(gate_up.astype(jnp.float32), 2, axis=-1)
        return self.pair(gate, up).astype(gate_up.dtype)


@dataclasses.dataclass(frozen=True)
class _Pair:
    act: GatedActivation

    def __call__(self, gate, up):
        return self.act.pair(gate, up)
