"""Convert a Hugging Face safetensors checkpoint (BF16/F32 or FP8 block-scaled) into our orbax
checkpoint directory, streaming layer by layer.

Output directory (written atomically, see ``atomic_dir``)::

    DST/params/          orbax PyTree checkpoint of our params tree (docs/ARCHITECTURE.md)
    DST/config.yaml      ModelConfig.to_dict() (param_dtype/dtype = the conversion dtype)
    DST/conversion.json  source, dtype, warnings (skipped tensors), bytes, seconds
    DST/minimax_manifest.json  a checksum per leaf (``manifest``), verified by ``load_checkpoint``
    DST/fp8_weights.json the leaves kept in FP8 and their blocks (only with ``weights_dtype="fp8"``, ``fp8_keep``)
    DST/hf_config.json   the source config.json, for provenance
    DST/tokenizer.json, tokenizer_config.json, chat_template.jinja, ... (copied when present)
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import Any

import numpy as np

from minimax_jax.config import ModelConfig
from minimax_jax.convert.assemble import PieceReader, fill_unit
from minimax_jax.convert.atomic_dir import (PARAMS_DIR, REPORT_FILE, atomic_output_dir, check_destination,
                                            copy_side_files, write_config, write_json)
from minimax_jax.convert.errors import CheckpointError, SourceKindError
from minimax_jax.convert.fp8_keep import WEIGHTS_DTYPES, lazy_fp8_leaves, plan_blocks, write_blocks
from minimax_jax.convert.manifest import write_manifest
from minimax_jax.convert.orbax_stream import DEFAULT_CHUNK_BYTES, LazyLeaf, save_lazy_tree
from minimax_jax.convert.plan import ConversionPlan, make_plan
from minimax_jax.convert.safetensors_io import SafetensorsReader

__all__ = ["convert_hf_to_orbax", "nest", "lazy_tree"]

log = logging.getLogger(__name__)


def nest(items: list[tuple[tuple[Any, ...], Any]]) -> Any:
    """Build the params tree from ``(path, value)`` pairs; integer path keys make lists."""
    root: dict = {}
    for path, value in items:
        node = root
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = value

    def fix(n):
        if not isinstance(n, dict):
            return n
        if n and all(isinstance(k, int) for k in n):
            return [fix(n[i]) for i in range(len(n))]
        return {k: fix(v) for k, v in n.items()}

    return fix(root)


class BufferPool:
    """Reuses unit buffers of stacked leaves by (shape, dtype): a fresh buffer costs a page fault per
    4 KiB on first touch, which doubles the assembly time of a layer. Keeps at most one free buffer
    per shape, so it holds at most one layer's worth of buffers."""

    def __init__(self):
        self._free: dict[tuple, np.ndarray] = {}

    def acquire(self, shape, dtype) -> np.ndarray:
        buf = self._free.pop((tuple(shape), np.dtype(dtype)), None)
        return buf if buf is not None else np.empty(shape, dtype)

    def release(self, arr: np.ndarray) -> None:
        self._free.setdefault((arr.shape, arr.dtype), arr)


def lazy_tree(plan: ConversionPlan, reader: SafetensorsReader, *, on_bytes=None) -> Any:
    """Our params tree with a ``LazyLeaf`` per leaf, filled from ``reader`` when saved. Every element
    of a unit buffer is overwritten by its pieces (the layout tiles each leaf exactly), so reused
    buffers never leak stale values."""
    read = PieceReader(reader, plan, on_bytes)
    pool = BufferPool()
    items = []
    for leaf in plan.leaves:
        if leaf.fp8_block:
            items += lazy_fp8_leaves(leaf, plan, reader, pool, on_bytes)
            continue
        if leaf.stacked:
            units = [(index, (lambda p=pieces, s=leaf.unit_shape, d=leaf.dtype: fill_unit(pool.acquire(s, d), p, read)))
                     for index, pieces in leaf.units]
        else:
            units = [(index, (lambda p=pieces, s=leaf.unit_shape, d=leaf.dtype: fill_unit(np.empty(s, d), p, read)))
                     for index, pieces in leaf.units]
        items.append((leaf.path, LazyLeaf(leaf.shape, leaf.dtype, units, stacked=leaf.stacked,
                                          name=".".join(map(str, leaf.path)),
                                          release=pool.release if leaf.stacked else None)))
    return nest(items)


def _check_against_model(tree: Any, cfg: ModelConfig, blocks: dict | None = None) -> None:
    """The planned tree must have exactly the structure and shapes of ``abstract_params`` (with ``blocks``:
    its FP8 leaves as stored, ``minimax_jax.model.fp8_params``)."""
    import jax

    from minimax_jax.model.fp8_params import quantized_abstract, to_storage
    from minimax_jax.model.params import abstract_params

    want = to_storage(quantized_abstract(abstract_params(cfg), blocks or {}))
    is_leaf = lambda x: isinstance(x, LazyLeaf)  # noqa: E731
    got_l = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    want_l = jax.tree_util.tree_flatten_with_path(want)[0]
    got_d = {jax.tree_util.keystr(k): v for k, v in got_l}
    want_d = {jax.tree_util.keystr(k): v for k, v in want_l}
    if set(got_d) != set(want_d):
        raise CheckpointError(f"internal: planned leaves differ from the model's: only planned "
                              f"{sorted(set(got_d) - set(want_d))[:5]}, only model {sorted(set(want_d) - set(got_d))[:5]}")
    for k, w in want_d.items():
        g = got_d[k]
        if tuple(g.shape) != tuple(w.shape):
            raise CheckpointError(f"internal: leaf {k}: planned shape {g.shape}, model shape {tuple(w.shape)}")


def convert_hf_to_orbax(src: str | os.PathLike, dst: str | os.PathLike, dtype: str = "bfloat16", *,
                        overwrite: bool = False, progress: bool = True, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                        max_in_flight: int = 2, compress: bool = False,
                        cfg: ModelConfig | None = None, weights_dtype: str | None = None) -> tuple[ModelConfig, dict]:
    """Convert the HF checkpoint in ``src`` into our orbax checkpoint directory ``dst``.

    Args:
      src: directory with ``config.json`` and ``model.safetensors.index.json`` + shards, or a single
        ``model.safetensors`` (hub or transformers-native names, BF16/F16/F32 or FP8 e4m3 with
        128x128 ``weight_scale_inv``).
      dst: output directory; must not exist unless ``overwrite``.
      dtype: parameter dtype of the output, "bfloat16" or "float32" (router weights stay float32).
      overwrite: replace an existing ``dst`` this tool wrote (only after the new one is complete);
        ``dst`` may never be, contain or lie inside ``src`` (``atomic_dir.check_destination``).
      progress: show a tqdm bar (bytes, rate, ETA) on stderr.
      chunk_bytes: orbax storage chunk size bound.
      max_in_flight: layer units held at once while writing (memory ~ this x largest unit).
      compress: zstd-compress the orbax chunks (orbax's default, off here for speed).
      cfg: use this config instead of ``src/config.json`` (its dtype fields are replaced).
      weights_dtype: None (FP8 tensors are dequantised to ``dtype``) or ``"fp8"``: layer weights stored FP8
        e4m3 stay FP8 with their block scales (``fp8_keep``; about half the bytes of bfloat16).
    Returns: ``(cfg, report)``; ``report`` is what ``conversion.json`` holds.
    Raises: ConfigError (bad config), CheckpointError subclasses (missing / unknown / wrong shape /
      wrong dtype / truncated tensors; ``weights_dtype="fp8"`` for a checkpoint without FP8 layer weights:
      SourceKindError, a TensorDtypeError; raised before anything is written), DestinationError /
      DestinationExistsError (a FileExistsError), before anything is read or written.
    """
    from tqdm.auto import tqdm

    src = os.fspath(src)
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"dtype must be 'bfloat16' or 'float32', got {dtype!r}")
    if weights_dtype not in WEIGHTS_DTYPES:
        raise ValueError(f"weights_dtype must be one of {WEIGHTS_DTYPES}, got {weights_dtype!r}")
    check_destination(dst, sources=(src,), overwrite=overwrite, kind="orbax")
    cfg = (cfg or ModelConfig.from_hf_config(src)).replace(dtype=dtype, param_dtype=dtype)
    reader = SafetensorsReader(src)
    plan = make_plan(reader, cfg, keep_fp8=weights_dtype == "fp8")
    blocks = plan_blocks(plan)
    if weights_dtype == "fp8" and not blocks:
        raise SourceKindError(f"weights_dtype='fp8': {src} has no FP8 (F8_E4M3 + weight_scale_inv) layer weights "
                               f"to keep; convert it without weights_dtype='fp8'")
    for w in plan.warnings:
        log.warning("%s", w)
    t0 = time.time()
    with tqdm(total=plan.source_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="convert",
              disable=not progress, dynamic_ncols=True) as bar:
        tree = lazy_tree(plan, reader, on_bytes=bar.update)
        _check_against_model(tree, cfg, blocks)
        with atomic_output_dir(dst, overwrite=overwrite, sources=(src,), kind="orbax") as tmp:
            entries = save_lazy_tree(os.path.join(tmp, PARAMS_DIR), tree, chunk_bytes=chunk_bytes,
                                     max_in_flight=max_in_flight, compress=compress)
            write_manifest(tmp, entries, writer="convert")
            write_config(cfg, tmp)
            if blocks:
                write_blocks(tmp, blocks)
            copied = copy_side_files(src, tmp)
            if os.path.isfile(os.path.join(src, "config.json")):
                shutil.copy2(os.path.join(src, "config.json"), os.path.join(tmp, "hf_config.json"))
            seconds = time.time() - t0
            fp8 = sum(1 for i in plan.infos.values() if i.dtype == "F8_E4M3")
            kept = sum(len(ps) for leaf in plan.leaves if leaf.fp8_block for _, ps in leaf.units)
            report = {"source": os.path.abspath(src), "dtype": dtype, "warnings": plan.warnings,
                      "source_bytes": plan.source_bytes, "seconds": round(seconds, 3),
                      "source_tensors": len(plan.infos), "fp8_tensors_dequantized": fp8 - kept,
                      "weights_dtype": weights_dtype or dtype, "fp8_tensors_kept": kept, "fp8_leaves": len(blocks),
                      "copied_files": copied,
                      "format": "minimax-jax orbax checkpoint v1"}
            write_json(report, os.path.join(tmp, REPORT_FILE))
    return cfg, report
