"""FP8 (e4m3) block-scaled weights, the format of the MiniMax-M2 hub checkpoint.

A quantised weight ``W [rows, cols]`` is stored as ``W_fp8`` (float8_e4m3fn) plus
``weight_scale_inv [ceil(rows/B0), ceil(cols/B1)]`` (float32), block ``B = (128, 128)``.
Dequantisation (despite the name, the scale is multiplied):
``W[i, j] = float32(W_fp8[i, j]) * scale_inv[i // B0, j // B1]``; edge tiles are partial.
Source: MODEL_FACTS.md section 1 (``quantization_config`` of the M2 hub ``config.json``).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from minimax_jax.convert.errors import TensorShapeError

__all__ = ["BLOCK", "FP8_MAX", "scale_shape", "dequantize", "quantize"]

BLOCK = (128, 128)
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448.0


def scale_shape(shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> tuple[int, ...]:
    """Shape of ``weight_scale_inv`` for a weight of ``shape`` (leading axes, if any, kept)."""
    if len(shape) < 2:
        raise ValueError(f"block FP8 needs a weight of rank >= 2, got shape {shape}")
    r, c = shape[-2:]
    return tuple(shape[:-2]) + (-(-r // block[0]), -(-c // block[1]))


def dequantize(w: np.ndarray, scale_inv: np.ndarray, *, name: str = "weight",
               block: tuple[int, int] = BLOCK) -> np.ndarray:
    """``float32(w) * scale_inv`` tiled over ``block`` tiles (partial edge tiles included).

    Args:
      w: float8_e4m3fn (any float dtype works) ``[..., rows, cols]``.
      scale_inv: ``[..., ceil(rows/B0), ceil(cols/B1)]``, any float dtype.
      name: tensor name for error messages.
    Returns: float32 array of ``w.shape``.
    Raises: TensorShapeError naming ``name`` when the scale shape does not match.
    """
    want = scale_shape(w.shape, block)
    if tuple(scale_inv.shape) != want:
        raise TensorShapeError(
            f"tensor {name + '_scale_inv'!r}: expected shape {list(want)} for weight shape {list(w.shape)} "
            f"with {block[0]}x{block[1]} blocks, got {list(scale_inv.shape)}")
    r, c = w.shape[-2:]
    s = np.asarray(scale_inv, np.float32)
    if w.dtype == ml_dtypes.float8_e4m3fn:  # exact e4m3 -> float32 through a 256-entry table (fast)
        out = _E4M3_TO_F32[w.view(np.uint8)]
    else:
        out = w.astype(np.float32)
    for i in range(s.shape[-2]):  # one row of tiles at a time: multiply by its scales repeated over columns
        rows = out[..., i * block[0]:(i + 1) * block[0], :]
        rows *= np.repeat(s[..., i:i + 1, :], block[1], axis=-1)[..., :c]
    return out


_E4M3_TO_F32 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def quantize(w: np.ndarray, block: tuple[int, int] = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Block-quantise ``w [..., rows, cols]`` to (float8_e4m3fn weight, float32 scale_inv).

    Each tile's scale is ``max|tile| / 448`` (1.0 for an all-zero tile), so the tile's largest
    magnitude maps to the largest finite e4m3 value; values round to nearest even.
    """
    w = np.asarray(w, np.float32)
    r, c = w.shape[-2:]
    sr, sc = scale_shape(w.shape, block)[-2:]
    pad = [(0, 0)] * (w.ndim - 2) + [(0, sr * block[0] - r), (0, sc * block[1] - c)]
    t = np.pad(np.abs(w), pad).reshape(w.shape[:-2] + (sr, block[0], sc, block[1]))
    amax = t.max(axis=(-3, -1))
    scale = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
    full = np.repeat(np.repeat(scale, block[0], axis=-2)[..., :r, :], block[1], axis=-1)[..., :c]
    q = np.clip(w / full, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q, scale
