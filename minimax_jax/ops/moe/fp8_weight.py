"""Block-scaled FP8 weights kept in FP8 in device memory: the ``Fp8Weight`` pytree node.

``Fp8Weight(w, scale_inv, block)`` holds ``w [..., R, C]`` float8_e4m3fn and ``scale_inv [..., ceil(R/br),
ceil(C/bc)]`` float32 with the static ``block = (br, bc)``; its value is
``W[..., i, j] = float32(w[..., i, j]) * scale_inv[..., i // br, j // bc]`` (MODEL_FACTS.md section 1: the
published scale is multiplied, despite its name; edge tiles are partial). Axes are ours (``[in, out]``, the
transposed HF orientation), so the block is (128, 128) for published checkpoints; a leaf assembled from pieces
at offsets that are not multiples of 128 (e.g. fused gate | up columns with ``I % 128 != 0``) has a block that
divides 128 with the published scales repeated, which is exact.

Where the model reads a dense weight it calls ``w.astype(compute dtype)``: here that dequantises (inside the
jitted step, one layer at a time), so every projection works unchanged. The grouped matmul
(``grouped_matmul.py``) takes ``Fp8Weight`` experts and dequantises per expert chunk. ``w[idx]`` indexes
leading (layer / expert) axes of both arrays. As a pytree its leaves are ``w`` and ``scale_inv``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Fp8Weight", "FP8_DTYPE", "BLOCK", "dequantize_blocks", "scale_shape", "is_fp8"]

FP8_DTYPE = jnp.float8_e4m3fn
BLOCK = (128, 128)


def scale_shape(shape, block=BLOCK) -> tuple[int, ...]:
    """``scale_inv`` shape of a weight of ``shape`` (leading axes kept)."""
    r, c = shape[-2:]
    return tuple(shape[:-2]) + (-(-r // block[0]), -(-c // block[1]))


def dequantize_blocks(w: jax.Array, scale_inv: jax.Array, block, dtype) -> jax.Array:
    """``float32(w) * scale_inv`` repeated over ``block`` tiles, cast to ``dtype``; ``w [..., R, C]``."""
    r, c = w.shape[-2:]
    s = jnp.repeat(scale_inv.astype(jnp.float32), block[0], axis=-2)[..., :r, :]
    s = jnp.repeat(s, block[1], axis=-1)[..., :c]
    return (w.astype(jnp.float32) * s).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """FP8 e4m3 weight + float32 block scales (module docstring); leaves ``w``, ``scale_inv``."""

    w: jax.Array
    scale_inv: jax.Array
    block: tuple[int, int] = dataclasses.field(default=BLOCK, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.w.shape)

    @property
    def ndim(self) -> int:
        return len(self.w.shape)

    @property
    def dtype(self):
        return self.w.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of both arrays."""
        return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in (self.w, self.scale_inv))

    def astype(self, dtype) -> jax.Array:
        """The dequantised weight in ``dtype`` (computed in float32)."""
        return dequantize_blocks(self.w, self.scale_inv, self.block, dtype)

    def __getitem__(self, idx) -> "Fp8Weight":
        idx = idx if isinstance(idx, tuple) else (idx,)
        if len(idx) > self.ndim - 2 or any(i is Ellipsis for i in idx):
            raise IndexError(f"Fp8Weight of shape {self.shape} can only be indexed on its leading axes, got {idx}")
        return Fp8Weight(self.w[idx], self.scale_inv[idx], self.block)


def is_fp8(x) -> bool:
    return isinstance(x, Fp8Weight)
