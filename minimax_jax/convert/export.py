"""Export our orbax checkpoint directory to Hugging Face safetensors, streaming layer by layer.

Names: M2 configs (``norm_kind == "rms"``) use the M2 hub layout (per-expert ``w1/w3/w2``, which
transformers loads through its MiniMax-M2 weight conversion); M3 configs use the transformers-native
layout (``mlp.experts.gate_up_proj`` ...), the only one ``MiniMaxM3VLForCausalLM`` loads (checked
with transformers 5.24). Tensors keep the stored dtype (BF16 or F32; router weights F32), or with
``fp8=True`` every decoder-layer linear weight (attention, index, experts, shared / dense MLP)
is re-quantised to e4m3 + 128x128 ``weight_scale_inv`` (router, norms, embedding, lm_head and
MTP ``eh_proj`` stay unquantised, as in the M2 hub). Leaves kept in FP8 (``fp8_keep``) are written as stored
with ``fp8=True`` (the HF e4m3 bytes and scales come back bit for bit) and dequantised to the param dtype
without. Shards of at most ``max_shard_bytes`` with
``model.safetensors.index.json``; ``config.json`` from ``cfg.to_hf_config()``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator

import numpy as np

from minimax_jax.config import ModelConfig
from minimax_jax.convert import fp8 as fp8_lib
from minimax_jax.convert.atomic_dir import (PARAMS_DIR, atomic_output_dir, check_destination, copy_side_files,
                                            read_config, write_json)
from minimax_jax.convert.errors import ChecksumMismatch
from minimax_jax.convert.fp8_keep import read_blocks, scale_dest
from minimax_jax.convert.layout import (EXPORT_STYLE, Piece, layer_slots, mtp_layer_prefixes, mtp_slots, ours_to_piece,
                                        top_slots)
from minimax_jax.convert.load import checkpoint_metadata
from minimax_jax.convert.manifest import (MANIFEST_FILE, StreamDigest, array_digest, default_warn, entry,
                                          read_manifest, write_manifest)
from minimax_jax.convert.safetensors_io import INDEX_FILE

__all__ = ["export_orbax_to_hf", "iter_hf_tensors", "DEFAULT_SHARD_BYTES"]

DEFAULT_SHARD_BYTES = 2 * 1024 ** 3


class _LeafStore:
    """Lazily opened TensorStore arrays of a checkpoint's leaves (orbax's own read spec), by path."""

    def __init__(self, directory: str, on_read=None):
        import jax
        import orbax.checkpoint as ocp
        from etils import epath
        from orbax.checkpoint import type_handlers as th

        self._th, self._epath, self._on_read = th, epath, on_read
        # absolute: orbax returns no item metadata for a relative directory (a KeyError on the first leaf)
        directory = os.path.abspath(directory)
        md = ocp.StandardCheckpointer().metadata(os.path.join(directory, PARAMS_DIR))
        item = getattr(md, "item_metadata", md)
        self._zarr3 = bool(getattr(item, "use_zarr3", False))
        tree = getattr(item, "tree", item)
        self._ctx = th.get_ts_context(use_ocdbt=True)
        self._meta = {tuple(p.key if hasattr(p, "key") else p.idx for p in path): m
                      for path, m in jax.tree_util.tree_flatten_with_path(tree)[0]}
        self._open: dict = {}
        self._digests: dict = {}

    def get(self, path: tuple) -> Any:
        import tensorstore as ts

        if path not in self._open:
            m = self._meta[path]
            info = self._th.ParamInfo(name=m.name, parent_dir=self._epath.Path(m.directory), is_ocdbt_checkpoint=True,
                                      use_zarr3=self._zarr3, ts_context=self._ctx)
            spec = self._th.get_json_tspec_read(info, use_ocdbt=True)
            self._open[path] = ts.open(spec, open=True, context=self._ctx).result()
        return self._open[path]

    def read(self, path: tuple, index: tuple = ()) -> np.ndarray:
        arr = np.asarray(self.get(path)[index].read().result())
        if self._on_read:
            self._on_read(arr.nbytes)
        self._digest(path, index, arr)
        return arr

    def _digest(self, path: tuple, index: tuple, arr: np.ndarray) -> None:
        """Hash while reading: a leaf read whole, or layer 0, 1, ... in order, gets its digest from
        these reads; any other reading order drops it (``verify`` then reads the leaf again)."""
        d, nxt = self._digests.get(path, (None, 0))
        if index == () and path not in self._digests:
            d = StreamDigest()
            d.update(arr)
            self._digests[path] = (d, -1)
        elif len(index) == 1 and index[0] == nxt and (d is not None or nxt == 0):
            d = d or StreamDigest()
            d.update(arr)
            self._digests[path] = (d, nxt + 1)
        else:
            self._digests[path] = (None, -2)

    def verify(self, manifest: dict, where: str) -> None:
        """Compare every leaf's digest with ``manifest``; raises ChecksumMismatch naming the leaf."""
        for path, m in self._meta.items():
            name = ".".join(map(str, path))
            want = manifest["tensors"].get(name, {}).get("digest")
            if not want:
                continue
            d, nxt = self._digests.get(path, (None, -2))
            if d is None or nxt not in (-1, m.shape[0] if len(m.shape) else -1):
                d = StreamDigest()
                d.update(np.asarray(self.get(path).read().result()))
            if d.hexdigest() != want:
                raise ChecksumMismatch(f"checkpoint {where}: tensor {name!r} checksum mismatch (file flipped or "
                                       "truncated); restore it from a good copy", tensor=name)


def _quantizable(name: str) -> bool:
    """Decoder-layer linear weights (attention, index, shared/dense MLP, experts); not the router
    (``gate.weight``), norms, embedding, lm_head or MTP ``eh_proj``."""
    return (".layers." in name and name.endswith("weight") and "_proj" in name and "eh_proj" not in name) or (
        ".experts." in name and name.endswith((".w1.weight", ".w2.weight", ".w3.weight", "gate_up_proj", "down_proj")))


def iter_hf_tensors(directory: str, cfg: ModelConfig, *, fp8: bool = False, on_read=None,
                    store: _LeafStore | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(hf_name, array)`` for the whole checkpoint, one leaf unit (a layer of a leaf) in memory
    at a time; ``on_read(nbytes)`` is called per unit read (progress)."""
    from minimax_jax.config import dtype_of
    from minimax_jax.model.params import layer_segments

    store = store or _LeafStore(directory, on_read)
    style = EXPORT_STYLE[cfg.norm_kind]
    blocks = read_blocks(directory)
    dense_dtype = np.dtype(dtype_of(cfg.param_dtype))

    def read(path, index=()):
        name = ".".join(map(str, path))
        if name not in blocks:
            return store.read(path, index)
        return store.read(path + ("w",), index), store.read(path + ("scale_inv",), index), blocks[name]

    def emit(name, arr):
        if isinstance(arr, tuple):   # a kept-FP8 piece: (e4m3 [out, in], scale_inv [ceil(out/128), ceil(in/128)])
            if fp8:
                yield name, arr[0]
                yield name + "_scale_inv", arr[1]
            else:
                yield name, fp8_lib.dequantize(arr[0], arr[1], name=name).astype(dense_dtype)
            return
        if fp8 and arr.ndim >= 2 and _quantizable(name):
            q, s = fp8_lib.quantize(arr.astype(np.float32))
            yield name, q
            yield name + "_scale_inv", s
        else:
            yield name, arr

    def cut(p, buf):
        if not isinstance(buf, tuple):
            return ours_to_piece(p, buf)
        w, sc, block = buf
        # our scale rows of this piece, every (128 / block)-th: its own 128x128 scales (fp8_keep)
        dest = list(scale_dest(p.dest, block))
        for k in (-2, -1):
            dest[k] = slice(dest[k].start, dest[k].stop, fp8_lib.BLOCK[k] // block[k])
        return ours_to_piece(p, w), ours_to_piece(Piece(p.name, fp8_lib.scale_shape(p.shape), tuple(dest), p.perm), sc)

    for slot in top_slots(cfg):
        buf = read(slot.path)
        for p in slot.for_style(style).pieces:
            yield from emit(p.name, cut(p, buf))
    for si, seg in enumerate(layer_segments(cfg)):
        for j in range(seg.length):
            for slot in layer_slots(cfg, f"model.layers.{seg.start + j}.", seg.layer_type, seg.mlp_type):
                buf = read(("segments", si) + slot.path, (j,))
                for p in slot.for_style(style).pieces:
                    yield from emit(p.name, cut(p, buf))
    for i in range(cfg.num_mtp_modules):
        for slot in mtp_slots(cfg, i, mtp_layer_prefixes(i)[0]):
            buf = read(("mtp", i) + slot.path)
            for p in slot.for_style(style).pieces:
                yield from emit(p.name, cut(p, buf))


def export_orbax_to_hf(src: str | os.PathLike, dst: str | os.PathLike, fp8: bool = False, *,
                       max_shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False,
                       progress: bool = True, verify: bool = True, warn=default_warn) -> dict:
    """Write ``dst`` = HF checkpoint (sharded safetensors + index + config.json + tokenizer files +
    ``minimax_manifest.json`` of the written tensors) from our checkpoint directory ``src``. Atomic
    (temporary sibling renamed on success).

    With ``verify`` every leaf of ``src`` is checked against its manifest while it is read (a
    ``src`` without one: one line to ``warn``). Peak memory ~ one shard being assembled
    (``max_shard_bytes``) + one leaf unit.
    Returns: a summary dict (tensors, bytes, shards).
    Raises: DestinationExistsError (a FileExistsError) when ``dst`` exists and not ``overwrite``,
      DestinationError when it overlaps ``src`` or is not ours to replace (both before anything is
      read); ChecksumMismatch naming a corrupt leaf (nothing is left at ``dst``).
    """
    from safetensors.numpy import save_file
    from tqdm.auto import tqdm

    src = os.fspath(src)
    check_destination(dst, sources=(src,), overwrite=overwrite, kind="hf")
    cfg = read_config(src)
    manifest = read_manifest(os.path.abspath(src)) if verify else None
    if verify and manifest is None:
        warn(f"checkpoint {os.path.abspath(src)} has no {MANIFEST_FILE} (written by an older version): "
             "exporting it without checksum verification")
    total = sum(int(np.prod(m.shape)) * np.dtype(m.dtype).itemsize
                for m in _flat_meta(checkpoint_metadata(src)))
    with atomic_output_dir(dst, overwrite=overwrite, sources=(src,), kind="hf") as tmp, \
            tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="export", disable=not progress,
                 dynamic_ncols=True) as bar:
        shards: list[list[str]] = []
        weight_map: dict[str, int] = {}
        cur: dict[str, np.ndarray] = {}
        cur_bytes = 0
        total_size = 0

        def flush():
            nonlocal cur, cur_bytes
            if cur:
                save_file(cur, os.path.join(tmp, f"shard-{len(shards):05d}.tmp"), metadata={"format": "pt"})
                shards.append(list(cur))
                cur, cur_bytes = {}, 0

        entries = {}
        store = _LeafStore(src, bar.update)
        for name, arr in iter_hf_tensors(src, cfg, fp8=fp8, store=store):
            if cur and cur_bytes + arr.nbytes > max_shard_bytes:
                flush()
            cur[name] = np.ascontiguousarray(arr)
            entries[name] = entry(arr.shape, arr.dtype, array_digest(cur[name]))
            cur_bytes += arr.nbytes
            total_size += arr.nbytes
        flush()
        if manifest is not None:
            store.verify(manifest, os.path.abspath(src))
        write_manifest(tmp, entries, writer="export_orbax_to_hf")
        n = len(shards)
        for k, names in enumerate(shards):
            fn = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            os.rename(os.path.join(tmp, f"shard-{k:05d}.tmp"), os.path.join(tmp, fn))
            os.chmod(os.path.join(tmp, fn), _file_mode())   # safetensors writes 0600; like the other files
            for nm in names:
                weight_map[nm] = fn
        write_json({"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))},
                   os.path.join(tmp, INDEX_FILE))
        hf_cfg = cfg.to_hf_config()
        hf_cfg["torch_dtype"] = hf_cfg["dtype"] = "bfloat16" if cfg.param_dtype == "bfloat16" else "float32"
        if fp8:
            hf_cfg["quantization_config"] = {
                "quant_method": "fp8", "fmt": "float8_e4m3fn", "weight_block_size": list(fp8_lib.BLOCK),
                "activation_scheme": "dynamic",
                "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head", "eh_proj"]}
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_cfg, f, indent=2)
        copy_side_files(src, tmp)
    return {"tensors": len(weight_map), "bytes": total_size, "shards": n}


def _file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file: 0o666 less the process umask (0o644 under the
    usual umask 022). Read from /proc where available, so the umask is never changed, even briefly."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def _flat_meta(tree):
    import jax

    return jax.tree.leaves(tree, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))
