"""Conversion that keeps an FP8 checkpoint's layer weights in FP8 (``convert_hf_to_orbax(weights_dtype="fp8")``).

A layer leaf (under ``segments`` / ``mtp``) whose pieces are all F8_E4M3 is stored as
``{"w": float8_e4m3fn [dense leaf shape], "scale_inv": float32 [..., ceil(R/br), ceil(C/bc)]}`` in our axes
(``minimax_jax.model.fp8_params``, ``minimax_jax.ops.moe.Fp8Weight``): the e4m3 bytes are copied (transposed
to ``[in, out]``), the 128x128 HF scales transposed with them. Its block ``(br, bc)`` is 128 per axis unless
pieces meet at an offset that is not a multiple of 128 (fused gate | up with ``I % 128 != 0``): then the
largest divisor of 128 dividing every offset, each published scale repeated ``128 / b`` times (exact).
``DST/fp8_weights.json`` names the FP8 leaves and their blocks; ``load_checkpoint`` reads it.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Callable

import ml_dtypes
import numpy as np

from minimax_jax.convert import fp8
from minimax_jax.convert.assemble import fill_unit
from minimax_jax.convert.errors import CorruptFileError
from minimax_jax.convert.layout import piece_to_ours
from minimax_jax.convert.orbax_stream import LazyLeaf
from minimax_jax.convert.plan import SCALE_SUFFIX, ConversionPlan, LeafPlan
from minimax_jax.convert.safetensors_io import SafetensorsReader

__all__ = ["FP8_FILE", "WEIGHTS_DTYPES", "keep_block", "plan_blocks", "lazy_fp8_leaves", "write_blocks",
           "read_blocks", "scale_dest"]

FP8_FILE = "fp8_weights.json"
FORMAT = "minimax-jax fp8 weights v1"
#: ``weights_dtype`` values of the converter and loaders: None (dequantise, as ``dtype``) or "fp8" (keep).
WEIGHTS_DTYPES = (None, "fp8")
_LAYER_ROOTS = ("segments", "mtp")


def keep_block(leaf: LeafPlan, infos) -> tuple[int, int] | None:
    """The block of ``leaf`` kept in FP8, or None when it is not a layer leaf of rank >= 2 whose pieces are all
    F8_E4M3 (then it is converted to the plan's dtype)."""
    if leaf.path[0] not in _LAYER_ROOTS or len(leaf.unit_shape) < 2:
        return None
    pieces = [p for _, ps in leaf.units for p in ps]
    if not pieces or any(infos[p.name].dtype != "F8_E4M3" for p in pieces):
        return None
    dims = leaf.unit_shape[-2:]
    block = []
    for axis, dim in zip((-2, -1), dims):
        offsets = []
        for p in pieces:
            s = p.dest[axis]
            lo, hi = s.start or 0, dim if s.stop is None else s.stop
            offsets += [o for o in (lo, hi) if 0 < o < dim]
        block.append(math.gcd(fp8.BLOCK[0], *offsets))
    return tuple(block)


def plan_blocks(plan: ConversionPlan) -> dict[str, tuple[int, int]]:
    """``{dotted leaf name: block}`` of the plan's FP8 leaves."""
    return {".".join(map(str, leaf.path)): leaf.fp8_block for leaf in plan.leaves if leaf.fp8_block}


def scale_dest(dest: tuple[slice, ...], block: tuple[int, int]) -> tuple[slice, ...]:
    """A piece's ``dest`` in the weight -> its slices in ``scale_inv`` (offsets are multiples of ``block``)."""
    out = list(dest[:-2])
    for s, b in zip(dest[-2:], block):
        lo = (s.start or 0) // b
        out.append(slice(lo, None if s.stop is None else -(-s.stop // b)))
    return tuple(out)


def _fill_scale(buf: np.ndarray, pieces, read_scale: Callable[[str], np.ndarray], block) -> np.ndarray:
    for p in pieces:
        s = piece_to_ours(p, read_scale(p.name).astype(np.float32))   # HF [out/128, in/128] -> ours, like the weight
        s = np.repeat(np.repeat(s, fp8.BLOCK[0] // block[0], axis=-2), fp8.BLOCK[1] // block[1], axis=-1)
        view = buf[scale_dest(p.dest, block)]
        view[...] = s[..., :view.shape[-2], :view.shape[-1]]
    return buf


def lazy_fp8_leaves(leaf: LeafPlan, plan: ConversionPlan, reader: SafetensorsReader, pool,
                    on_bytes=None) -> list[tuple[tuple, LazyLeaf]]:
    """``[(path + ("w",), LazyLeaf e4m3), (path + ("scale_inv",), LazyLeaf f32)]`` for a kept-FP8 leaf."""
    block = leaf.fp8_block
    count = on_bytes or (lambda n: None)

    def raw(name, rows=None):
        arr = reader.read(plan.info(name).name, rows)
        count(arr.nbytes)
        return arr

    def scale(name):
        arr = reader.read(plan.info(name + SCALE_SUFFIX).name)
        count(arr.nbytes)
        return arr

    e4m3 = np.dtype(ml_dtypes.float8_e4m3fn)
    s_unit = fp8.scale_shape(leaf.unit_shape, block)
    s_shape = fp8.scale_shape(leaf.shape, block)
    name = ".".join(map(str, leaf.path))
    acquire = pool.acquire if leaf.stacked else np.empty
    w_units = [(i, (lambda p=ps: fill_unit(acquire(leaf.unit_shape, e4m3), p, raw))) for i, ps in leaf.units]
    s_units = [(i, (lambda p=ps: _fill_scale(np.zeros(s_unit, np.float32), p, scale, block))) for i, ps in leaf.units]
    return [(leaf.path + ("w",), LazyLeaf(leaf.shape, e4m3, w_units, stacked=leaf.stacked, name=name + ".w",
                                          release=pool.release if leaf.stacked else None)),
            (leaf.path + ("scale_inv",), LazyLeaf(s_shape, np.float32, s_units, stacked=leaf.stacked,
                                                  name=name + ".scale_inv"))]


def write_blocks(directory: str, blocks: dict[str, tuple[int, int]]) -> None:
    """Write ``directory/fp8_weights.json`` (the FP8 leaves and their blocks)."""
    doc = {"format": FORMAT, "dtype": "float8_e4m3fn",
           "value": "w * scale_inv[i // block[0], j // block[1]] in our [in, out] axes",
           "blocks": {k: list(v) for k, v in sorted(blocks.items())}}
    with open(os.path.join(directory, FP8_FILE), "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def read_blocks(directory: str | os.PathLike) -> dict[str, tuple[int, int]]:
    """The FP8 leaves of a checkpoint directory (``{}`` without ``fp8_weights.json``).

    Raises: CorruptFileError for an unreadable or foreign file."""
    path = os.path.join(os.fspath(directory), FP8_FILE)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            doc: Any = json.load(f)
        if doc.get("format") != FORMAT:
            raise ValueError(f"format {doc.get('format')!r}, expected {FORMAT!r}")
        return {k: (int(v[0]), int(v[1])) for k, v in doc["blocks"].items()}
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise CorruptFileError(f"checkpoint {directory}: {FP8_FILE} is unreadable ({e})") from e
