"""Params trees with layer weights kept in FP8 (``minimax_jax.ops.moe.Fp8Weight`` leaves).

In memory an FP8 leaf (e.g. ``segments[s]["mlp"]["wi"]``, ``[L, E, H, 2I]``) is an ``Fp8Weight`` whose ``w``
has the dense leaf's shape (float8_e4m3fn) and whose ``scale_inv`` is ``[L, E, ceil(H/br), ceil(2I/bc)]``
float32; on disk (orbax) it is the dict ``{"w": ..., "scale_inv": ...}`` (``to_storage`` / ``from_storage``).
Which leaves are FP8 and their blocks: ``blocks``, ``{dotted leaf name: (br, bc)}`` (names as
``leaf_name``: ``"segments.0.mlp.wi"``). The model code needs nothing else: it reads every weight with
``.astype`` and the MoE ops take ``Fp8Weight`` experts.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from minimax_jax.ops.moe.fp8_weight import FP8_DTYPE, Fp8Weight, scale_shape

__all__ = ["leaf_name", "fp8_blocks", "quantized_abstract", "to_storage", "from_storage", "dequantize_params",
           "leaf_bytes", "fp8_shardings"]


def leaf_name(path) -> str:
    """Dotted name of a key path (dict keys, list indices)."""
    out = []
    for k in path:
        out.append(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))))
    return ".".join(out)


def _is_fp8(x) -> bool:
    return isinstance(x, Fp8Weight)


def fp8_blocks(tree: Any) -> dict[str, tuple[int, int]]:
    """``{leaf name: block}`` of the ``Fp8Weight`` leaves of ``tree``."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_fp8)[0]
    return {leaf_name(p): tuple(x.block) for p, x in flat if _is_fp8(x)}


def _map_named(fn, tree, is_leaf=None):
    return jax.tree_util.tree_map_with_path(lambda p, x: fn(leaf_name(p), x), tree, is_leaf=is_leaf)


def quantized_abstract(abstract: Any, blocks: dict[str, tuple[int, int]]) -> Any:
    """``abstract`` (ShapeDtypeStructs of the dense params) with an ``Fp8Weight`` of ShapeDtypeStructs at each
    leaf named in ``blocks``. Raises KeyError naming a block whose leaf does not exist (or has rank < 2)."""
    seen = set()

    def one(name, x):
        if name not in blocks:
            return x
        seen.add(name)
        if len(x.shape) < 2:
            raise KeyError(f"FP8 leaf {name!r} has rank {len(x.shape)} < 2")
        b = tuple(blocks[name])
        return Fp8Weight(jax.ShapeDtypeStruct(x.shape, FP8_DTYPE),
                         jax.ShapeDtypeStruct(scale_shape(x.shape, b), np.float32), b)

    out = _map_named(one, abstract)
    missing = sorted(set(blocks) - seen)
    if missing:
        raise KeyError(f"FP8 leaves {missing[:5]} are not leaves of the model's params")
    return out


def to_storage(tree: Any) -> Any:
    """``Fp8Weight`` leaves as ``{"w", "scale_inv"}`` dicts (what orbax stores)."""
    return jax.tree.map(lambda x: {"w": x.w, "scale_inv": x.scale_inv} if _is_fp8(x) else x, tree, is_leaf=_is_fp8)


def from_storage(tree: Any, blocks: dict[str, tuple[int, int]]) -> Any:
    """Inverse of ``to_storage``: the dicts named in ``blocks`` become ``Fp8Weight``."""
    def is_node(x):
        return isinstance(x, dict) and set(x) == {"w", "scale_inv"}

    return _map_named(lambda n, x: Fp8Weight(x["w"], x["scale_inv"], tuple(blocks[n])) if is_node(x) and n in blocks
                      else x, tree, is_leaf=is_node)


def dequantize_params(tree: Any, dtype) -> Any:
    """Every ``Fp8Weight`` replaced by its dequantised array in ``dtype`` (one leaf at a time)."""
    return jax.tree.map(lambda x: jax.jit(lambda v: v.astype(dtype))(x) if _is_fp8(x) else x, tree, is_leaf=_is_fp8)


def leaf_bytes(tree: Any, names: Any = None) -> int:
    """Bytes of the leaves of ``tree`` (an ``Fp8Weight`` counts both arrays); ``names``: only these leaves."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_fp8)[0]
    total = 0
    for p, x in flat:
        if names is None or leaf_name(p) in names:
            total += x.nbytes if _is_fp8(x) else int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
    return total


def fp8_shardings(dense: Any, qabstract: Any) -> Any:
    """Shardings of a tree with ``Fp8Weight`` leaves from those of the dense tree (``params_shardings``): ``w``
    takes the dense leaf's sharding, ``scale_inv`` the same spec minus mesh axes that do not divide its dims."""
    def one(sh, q):
        if not _is_fp8(q):
            return sh
        if not isinstance(sh, jax.sharding.NamedSharding):
            return Fp8Weight(sh, sh, q.block)
        spec = list(sh.spec) + [None] * (len(q.scale_inv.shape) - len(sh.spec))
        for i, (ax, d) in enumerate(zip(spec, q.scale_inv.shape)):
            axes = () if ax is None else (ax if isinstance(ax, tuple) else (ax,))
            if axes and d % int(np.prod([sh.mesh.shape[a] for a in axes])):
                spec[i] = None
        return Fp8Weight(sh, jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec(*spec)), q.block)

    return jax.tree.map(one, dense, qabstract, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
