"""The dense / sliding-window attention op (``attention``; api.py) and its implementations:
xla.py (plain JAX), cudnn.py (cuDNN, plain and packed), flash.py (Pallas flash kernels)."""

from minimax_jax.ops.attention.api import IMPLEMENTATIONS, attention
from minimax_jax.ops.attention.xla import visibility_mask

__all__ = ["IMPLEMENTATIONS", "attention", "visibility_mask"]
