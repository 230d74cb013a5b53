"""Restore a converted checkpoint directory (``convert_hf_to_orbax`` output) as our params tree,
optionally straight onto a device mesh with one ``NamedSharding`` per leaf (each host reads only
the pieces its devices hold; the full tree is never gathered on one host)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from minimax_jax.config import ModelConfig
from minimax_jax.convert.atomic_dir import PARAMS_DIR, read_config
from minimax_jax.convert.errors import CheckpointError, CorruptFileError, first_line, quiet_failed_read_teardown
from minimax_jax.convert.manifest import MANIFEST_FILE, default_warn, read_manifest, verify_tree

__all__ = ["load_checkpoint", "checkpoint_metadata", "stored_abstract"]


def stored_abstract(directory: str | os.PathLike, cfg: ModelConfig) -> tuple[Any, dict]:
    """``(tree, blocks)``: the ShapeDtypeStructs ``directory/params`` must hold for ``cfg`` (its FP8 leaves,
    named in ``fp8_weights.json``, as ``{"w", "scale_inv"}`` dicts) and those FP8 leaves' blocks.

    Raises: CheckpointError when ``fp8_weights.json`` names a leaf the config does not have."""
    from minimax_jax.convert.fp8_keep import read_blocks
    from minimax_jax.model.fp8_params import quantized_abstract, to_storage
    from minimax_jax.model.params import abstract_params

    blocks = read_blocks(directory)
    try:
        return to_storage(quantized_abstract(abstract_params(cfg), blocks)), blocks
    except KeyError as e:
        raise CheckpointError(f"checkpoint {directory}: {e.args[0]} (fp8_weights.json and the config disagree)") from None


def checkpoint_metadata(directory: str | os.PathLike) -> Any:
    """The orbax metadata tree (per leaf: shape, dtype, name) of ``directory/params``.

    Raises: CorruptFileError when the metadata cannot be read (a missing ``manifest.ocdbt`` or
    ``_METADATA``, an interrupted copy): the message names the directory.
    """
    import orbax.checkpoint as ocp

    # Absolute path: orbax 0.12 returns no item metadata for a relative checkpoint path.
    path = os.path.join(os.path.abspath(os.fspath(directory)), PARAMS_DIR)
    try:
        md = ocp.StandardCheckpointer().metadata(path)
        item = getattr(md, "item_metadata", md)
        tree = getattr(item, "tree", item) if item is not None else None
    except Exception as e:  # orbax / tensorstore raise many types for a damaged directory
        raise CorruptFileError(f"checkpoint {path} is incomplete or corrupt: its metadata cannot be read "
                               f"({first_line(e)}); restore it from a good copy") from e
    if tree is None:
        raise CorruptFileError(f"checkpoint {path} is incomplete or corrupt: it has no readable parameter tree "
                               f"(missing manifest.ocdbt / _METADATA?); restore it from a good copy")
    return tree


def load_checkpoint(directory: str | os.PathLike, cfg: ModelConfig | None = None, mesh=None, rules=None, *,
                    shardings: Any = None, dtype: str | None = None, verify: bool = True,
                    warn=default_warn, weights_dtype: str | None = None) -> tuple[ModelConfig, Any]:
    """Load ``(cfg, params)`` from a converted checkpoint directory.

    Args:
      directory: holds ``config.yaml`` and ``params/`` (orbax).
      cfg: expected config (default: ``directory/config.yaml``); its params must match the stored
        tree leaf for leaf (shape), else CheckpointError.
      mesh, rules: with a mesh and no ``shardings``, shardings come from
        ``minimax_jax.model.params_shardings(cfg, mesh, rules)`` (rules default: "default").
      shardings: pytree of ``jax.sharding.Sharding`` matching the params tree (takes precedence).
      dtype: cast floating leaves (except the float32 router weights) on restore, e.g. "float32".
      verify: check every leaf against ``minimax_manifest.json`` right after the restore (before a
        cast); a checkpoint without one loads with one line to ``warn``.
      weights_dtype: for a checkpoint with FP8 leaves (``fp8_weights.json``, written by
        ``convert_hf_to_orbax(weights_dtype="fp8")``): None dequantises them (to ``dtype``, else the stored
        param dtype) on the device after the restore; ``"fp8"`` keeps them as ``minimax_jax.ops.moe.Fp8Weight``
        (the dense leaf's sharding for ``w``; ``shardings``, if given, is the dense tree's).
    Returns: ``(cfg, params)`` with jax.Array (and ``Fp8Weight``) leaves (on the default device without a mesh).
    Raises: FileNotFoundError, CheckpointError (structure / shape mismatch naming the leaf; ``weights_dtype="fp8"``
      for a checkpoint without FP8 leaves),
      CorruptFileError (unreadable metadata, truncated or missing weight files), ChecksumMismatch
      (a corrupt leaf, named).
    """
    import jax

    from minimax_jax.config import dtype_of
    from minimax_jax.convert.fp8_keep import FP8_FILE, WEIGHTS_DTYPES
    from minimax_jax.model.fp8_params import dequantize_params, fp8_shardings, from_storage, quantized_abstract

    if weights_dtype not in WEIGHTS_DTYPES:
        raise ValueError(f"weights_dtype must be one of {WEIGHTS_DTYPES}, got {weights_dtype!r}")
    directory = os.path.abspath(os.fspath(directory))  # orbax metadata lookups fail on relative paths
    stored_cfg = read_config(directory)
    cfg = cfg or stored_cfg
    want, blocks = stored_abstract(directory, cfg)
    if weights_dtype == "fp8" and not blocks:
        raise CheckpointError(f"checkpoint {directory} holds no FP8 weights (no {FP8_FILE}): convert an FP8 "
                              f"checkpoint with weights_dtype='fp8', or load it without weights_dtype='fp8'")
    stored = checkpoint_metadata(directory)
    s_flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(stored)[0]}
    w_flat, treedef = jax.tree_util.tree_flatten_with_path(want)
    only_stored = sorted(set(s_flat) - {jax.tree_util.keystr(k) for k, _ in w_flat})
    for k, w in w_flat:
        ks = jax.tree_util.keystr(k)
        if ks not in s_flat:
            raise CheckpointError(f"checkpoint {directory} has no leaf params{ks} (expected shape {list(w.shape)})")
        if tuple(s_flat[ks].shape) != tuple(w.shape):
            raise CheckpointError(f"leaf params{ks}: config expects shape {list(w.shape)}, checkpoint has "
                                  f"{list(s_flat[ks].shape)} (config/checkpoint mismatch)")
    if only_stored:
        raise CheckpointError(f"checkpoint {directory} has leaves the config does not: {only_stored[:5]}")

    if shardings is None and mesh is not None:
        from minimax_jax.model import params_shardings
        from minimax_jax.sharding import load_rules

        shardings = params_shardings(cfg, mesh, rules if rules is not None else load_rules("default"))
    if shardings is None:
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: dev, want)
    elif blocks:
        from minimax_jax.model.fp8_params import to_storage
        from minimax_jax.model.params import abstract_params

        shardings = to_storage(fp8_shardings(shardings, quantized_abstract(abstract_params(cfg), blocks)))
    cast = np.dtype(dtype_of(dtype)) if dtype else None
    manifest = read_manifest(directory) if verify else None
    if verify and manifest is None:
        warn(f"checkpoint {directory} has no {MANIFEST_FILE} (written by an older version): loaded without "
             "checksum verification")

    fp8_keys = (jax.tree_util.DictKey("w"), jax.tree_util.DictKey("scale_inv"))

    def final_dtype(path, st):
        if blocks and path[-1] in fp8_keys:   # FP8 leaves: dequantised (or kept) below, never cast
            return np.dtype(st.dtype)
        if cast is not None and path[-1] not in (jax.tree_util.DictKey("router"), jax.tree_util.DictKey("router_bias")):
            return cast
        return np.dtype(st.dtype)

    def target(path, w, sh):
        st = s_flat[jax.tree_util.keystr(path)]
        # verified leaves are restored as stored and cast afterwards (the digest covers the stored bytes)
        return jax.ShapeDtypeStruct(w.shape, np.dtype(st.dtype) if manifest else final_dtype(path, st), sharding=sh)

    abstract = jax.tree_util.tree_map_with_path(target, want, shardings)
    import orbax.checkpoint as ocp

    quiet_failed_read_teardown()    # before: the noise of a failed read can come before its exception
    try:
        with ocp.StandardCheckpointer() as ck:
            params = ck.restore(os.path.join(directory, PARAMS_DIR), abstract)
    except Exception as e:  # tensorstore reports truncated / missing chunks as ValueError or OSError
        raise CorruptFileError(f"checkpoint {os.path.join(directory, PARAMS_DIR)}: reading the weights failed, "
                               f"the files are truncated or corrupt ({first_line(e)}); restore it from a good "
                               f"copy") from e
    if manifest:
        verify_tree(params, manifest, directory)
        flat, tdef = jax.tree_util.tree_flatten_with_path(params)
        paths, leaves = [p for p, _ in flat], [x for _, x in flat]
        del params, flat
        for i, p in enumerate(paths):   # one leaf at a time: each stored copy is dropped once cast
            dt = final_dtype(p, s_flat[jax.tree_util.keystr(p)])
            if leaves[i].dtype != dt:
                leaves[i] = leaves[i].astype(dt)
        params = jax.tree_util.tree_unflatten(tdef, leaves)
    if blocks:
        params = from_storage(params, blocks)
        if weights_dtype != "fp8":
            params = dequantize_params(params, cast if cast is not None else dtype_of(cfg.param_dtype))
    return cfg, params
