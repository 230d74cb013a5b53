"""Fill our leaves from HF tensors piece by piece, with bounded temporaries.

A unit buffer (one layer of one stacked leaf, or a whole small leaf) is filled from its pieces;
a piece larger than ``chunk_bytes`` (as float32) is read in ranges of its first HF axis, so the
transient memory is one buffer plus at most ``chunk_bytes`` (+ its dtype casts).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from minimax_jax.convert import fp8
from minimax_jax.convert.layout import Piece
from minimax_jax.convert.plan import ConversionPlan
from minimax_jax.convert.safetensors_io import SafetensorsReader

__all__ = ["PieceReader", "fill_unit", "DEFAULT_CHUNK_BYTES"]

DEFAULT_CHUNK_BYTES = 256 * 1024 * 1024
_TILE = 256
ReadFn = Callable[[str, "slice | None"], np.ndarray]


class PieceReader:
    """Reads a planned tensor (canonical name), dequantising FP8 exactly; ``rows`` slices HF axis 0.

    For a 2-D FP8 weight, ``rows.start`` must be a multiple of the 128-row block.
    Returns the stored dtype for BF16/F16/F32 tensors, float32 for FP8.
    ``on_bytes(n)`` (optional) is called with the bytes read, for progress bars.
    """

    def __init__(self, reader: SafetensorsReader, plan: ConversionPlan, on_bytes: Callable[[int], None] | None = None):
        self.reader, self.plan, self.on_bytes = reader, plan, on_bytes

    def __call__(self, name: str, rows: slice | None = None) -> np.ndarray:
        info = self.plan.info(name)
        arr = self.reader.read(info.name, rows)
        n = arr.nbytes
        sinfo = self.plan.scale_info(name)
        if info.dtype == "F8_E4M3":
            srows = None
            if rows is not None:
                start, stop, _ = rows.indices(info.shape[0])
                if len(info.shape) == 2:
                    b = fp8.BLOCK[0]
                    if start % b:
                        raise ValueError(f"FP8 row range of {info.name!r} must start on a {b}-row block")
                    srows = slice(start // b, -(-stop // b))
                else:
                    srows = slice(start, stop)
            scale = self.reader.read(sinfo.name, srows)
            n += scale.nbytes
            arr = fp8.dequantize(arr, scale, name=info.name)
        if self.on_bytes:
            self.on_bytes(n)
        return arr


_FAST_MIN = 1 << 20  # elements; smaller pieces are transposed by numpy
_jit_cache: dict = {}


def _cpu_transpose(arr: np.ndarray, perm: tuple[int, ...]) -> np.ndarray | None:
    """``arr.transpose(perm)`` made contiguous by XLA on the host CPU (about 2x faster than numpy's
    strided copy for large matrices, and multi-threaded); None when no CPU backend is available."""
    import jax

    try:
        cpu = jax.devices("cpu")[0]
    except RuntimeError:
        return None
    fn = _jit_cache.get(perm)
    if fn is None:
        fn = _jit_cache[perm] = jax.jit(lambda x: x.transpose(perm))
    return np.asarray(fn(jax.device_put(arr, cpu)))


def _to_ours(piece: Piece, arr: np.ndarray) -> np.ndarray:
    """HF array -> our orientation, shaped for ``buf[piece.dest]`` (contiguous when it was large)."""
    out = None
    if piece.perm and arr.size >= _FAST_MIN:
        out = _cpu_transpose(arr, piece.perm)
    if out is None:
        out = arr.transpose(piece.perm) if piece.perm else arr
    while out.ndim < len(piece.dest):  # per-expert 2-D piece into a [1, ...] expert slice
        out = out[None]
    return out


def _hf_axis0_in_ours(piece: Piece) -> int:
    """Axis of our (dest-ranked) array that HF axis 0 becomes."""
    k = list(piece.perm).index(0) if piece.perm else 0
    return k + (len(piece.dest) - len(piece.shape))


def fill_unit(buf: np.ndarray, pieces, read: ReadFn, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> np.ndarray:
    """Write every piece into ``buf`` (our per-unit leaf, any dtype; values are cast on assignment).

    Pieces whose float32 size exceeds ``chunk_bytes`` are read in HF-axis-0 ranges (multiples of
    128 rows when possible, so FP8 blocks are never split).
    Returns ``buf``.
    """
    def get(p, rows):
        arr = read(p.name, rows)
        if arr.dtype != buf.dtype and arr.dtype.itemsize > buf.dtype.itemsize:
            arr = arr.astype(buf.dtype)  # narrow before transposing: elementwise, so same values, fewer bytes
        return arr

    for p in pieces:
        rows_total = p.shape[0] if p.shape else 1
        row_bytes = 4 * int(np.prod(p.shape[1:], dtype=np.int64)) if p.shape else 4
        if len(p.shape) < 2 or rows_total * row_bytes <= chunk_bytes:
            _assign(buf, p.dest, _to_ours(p, get(p, None)))
            continue
        step = max(1, chunk_bytes // row_bytes)
        if step >= fp8.BLOCK[0]:
            step -= step % fp8.BLOCK[0]
        elif len(p.shape) == 2:
            step = fp8.BLOCK[0]
        k = _hf_axis0_in_ours(p)
        d0 = p.dest[k]
        base = d0.start or 0
        for a in range(0, rows_total, step):
            b = min(a + step, rows_total)
            dest = list(p.dest)
            dest[k] = slice(base + a, base + b)
            _assign(buf, tuple(dest), _to_ours(p, get(p, slice(a, b))))
    return buf


def _assign(buf: np.ndarray, dest: tuple, src: np.ndarray) -> None:
    """``buf[dest] = src`` (with dtype cast); a transposed ``src`` is copied in 256x256 tiles of its
    last two axes, about twice as fast as numpy's strided copy on large matrices."""
    view = buf[dest]
    if src.ndim < 2 or src.flags.c_contiguous or src.shape[-1] * src.shape[-2] < 4 * _TILE * _TILE:
        view[...] = src
        return
    r, c = src.shape[-2:]
    for i in range(0, r, _TILE):
        for j in range(0, c, _TILE):
            view[..., i:i + _TILE, j:j + _TILE] = src[..., i:i + _TILE, j:j + _TILE]
