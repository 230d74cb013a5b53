"""Plan a conversion from checkpoint headers alone: which HF tensors fill which leaf, and every
problem (missing, unknown, wrong shape, wrong dtype, FP8 scale mismatch) found before any data is
read or any output written.

Name forms accepted besides ``model.*`` / ``lm_head.*``: the M3-VL bundle prefixes
``language_model.model.*`` / ``language_model.lm_head.*`` (hub) and ``model.language_model.*``
(transformers-native VL). Tensors that are known but not converted are reported, not dropped
silently: vision-tower / projector tensors (text tower only), M2's MTP slots ``model.layers.{n}.*``
with ``n >= num_layers`` (unpublished for every M2 release), MTP modules beyond
``cfg.num_mtp_modules``. Anything else unexplained is an error naming it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np

from minimax_jax.config import ModelConfig, dtype_of
from minimax_jax.convert import fp8
from minimax_jax.convert.errors import (MissingTensorError, TensorDtypeError, TensorShapeError,
                                        UnknownTensorError)
from minimax_jax.convert.layout import Piece, Slot, layer_slots, mtp_layer_prefixes, mtp_slots, top_slots
from minimax_jax.convert.safetensors_io import SafetensorsReader, TensorInfo

__all__ = ["LeafPlan", "ConversionPlan", "make_plan", "canonical_name", "FLOAT_DTYPES"]

FLOAT_DTYPES = ("F32", "BF16", "F16")
SCALE_SUFFIX = "_scale_inv"
_VISION = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector|patch_merge_mlp|visual)\.")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_MTP = re.compile(r"^model\.mtp\.layers\.(\d+)\.")
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def canonical_name(name: str) -> str:
    """Strip the M3-VL wrappers so names read ``model.*`` / ``lm_head.*``."""
    if name.startswith("language_model."):
        name = name[len("language_model."):]
    if name.startswith("model.language_model."):
        name = "model." + name[len("model.language_model."):]
    return name


@dataclasses.dataclass
class LeafPlan:
    """One leaf of our tree. ``units[k] = (index, pieces)``: our leaf ``[index]`` (a layer for
    stacked leaves, ``()`` for the whole leaf) is assembled from ``pieces`` (canonical names)."""

    path: tuple[Any, ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    stacked: bool
    units: list[tuple[tuple[int, ...], tuple[Piece, ...]]]
    fp8_block: tuple[int, int] | None = None   # kept FP8 (``fp8_keep``): its scale block in our axes

    @property
    def unit_shape(self) -> tuple[int, ...]:
        return self.shape[1:] if self.stacked else self.shape


@dataclasses.dataclass
class ConversionPlan:
    cfg: ModelConfig
    leaves: list[LeafPlan]
    actual: dict[str, str]                 # canonical name -> name in the files
    infos: dict[str, TensorInfo]           # canonical name -> header info
    warnings: list[str]
    source_bytes: int                      # bytes of every tensor the plan reads (scales included)

    def info(self, canonical: str) -> TensorInfo:
        return self.infos[canonical]

    def scale_info(self, canonical: str) -> TensorInfo | None:
        return self.infos.get(canonical + SCALE_SUFFIX)


def _path_leaf(path):
    return ".".join(str(p) for p in path)


def make_plan(reader: SafetensorsReader, cfg: ModelConfig, *, dtype: str | None = None,
              keep_fp8: bool = False) -> ConversionPlan:
    """Map every leaf of ``cfg``'s params to checkpoint tensors and validate names, shapes, dtypes.

    Args:
      reader: the checkpoint (headers already parsed).
      cfg: the architecture (normally ``ModelConfig.from_hf_config`` of the same directory).
      dtype: our parameter dtype name (default ``cfg.param_dtype``); router weights stay float32.
      keep_fp8: layer leaves whose pieces are all F8_E4M3 are planned as kept FP8 (``LeafPlan.fp8_block``,
        ``fp8_keep.keep_block``); the others as ``dtype``.
    Returns: a ConversionPlan.
    Raises: MissingTensorError, UnknownTensorError, TensorShapeError, TensorDtypeError (each names
      the tensor and the expected vs actual value).
    """
    from minimax_jax.model.params import layer_segments  # lazy: imports jax

    actual: dict[str, str] = {}
    for n in reader.names():
        c = canonical_name(n)
        if c in actual:
            raise UnknownTensorError(f"tensors {actual[c]!r} and {n!r} both map to {c!r}")
        actual[c] = n
    infos = {c: reader.info(n) for c, n in actual.items()}
    has = infos.__contains__
    dt = np.dtype(dtype_of(dtype or cfg.param_dtype))
    used: set[str] = set()

    def resolve(slot: Slot) -> tuple[Piece, ...]:
        alt = slot.resolve(has)
        if alt is None:
            best = max(slot.alts, key=lambda a: sum(has(p.name) for p in a.pieces))
            missing = [p for p in best.pieces if not has(p.name)]
            msg = (f"missing tensor {missing[0].name!r} (expected shape {list(missing[0].shape)}) "
                   f"needed for {_path_leaf(slot.path)}")
            if len(missing) > 1:
                msg += f"; {len(missing) - 1} more missing, e.g. {[p.name for p in missing[1:4]]}"
            raise MissingTensorError(msg)
        for p in alt.pieces:
            used.add(p.name)
        return alt.pieces

    leaves: list[LeafPlan] = []
    for si, seg in enumerate(layer_segments(cfg)):
        per_layer = [layer_slots(cfg, f"model.layers.{seg.start + j}.", seg.layer_type, seg.mlp_type)
                     for j in range(seg.length)]
        for k, slot in enumerate(per_layer[0]):
            units = [((j,), resolve(per_layer[j][k])) for j in range(seg.length)]
            leaves.append(LeafPlan(("segments", si) + slot.path, (seg.length,) + slot.shape,
                                   np.dtype(np.float32) if slot.keep_f32 else dt, True, units))
    for slot in top_slots(cfg):
        leaves.append(LeafPlan(slot.path, slot.shape, dt, False, [((), resolve(slot))]))
    for i in range(cfg.num_mtp_modules):
        lp = next((p for p in mtp_layer_prefixes(i) if has(p + "input_layernorm.weight")), mtp_layer_prefixes(i)[0])
        for slot in mtp_slots(cfg, i, lp):
            leaves.append(LeafPlan(("mtp", i) + slot.path, slot.shape,
                                   np.dtype(np.float32) if slot.keep_f32 else dt, False, [((), resolve(slot))]))

    warnings = _classify_rest(cfg, infos, actual, used)
    source_bytes = 0
    for leaf in leaves:
        for _, pieces in leaf.units:
            for p in pieces:
                source_bytes += _check_piece(p, infos, actual)
    if keep_fp8:
        from minimax_jax.convert.fp8_keep import keep_block

        for leaf in leaves:
            leaf.fp8_block = keep_block(leaf, infos)
    return ConversionPlan(cfg, leaves, actual, infos, warnings, source_bytes)


def _check_piece(p: Piece, infos: dict[str, TensorInfo], actual: dict[str, str]) -> int:
    """Validate one piece's shape/dtype (and FP8 scale); return the bytes it reads."""
    info = infos[p.name]
    name = actual[p.name]
    if tuple(info.shape) != tuple(p.shape):
        raise TensorShapeError(f"tensor {name!r}: expected shape {list(p.shape)} from the config, "
                               f"got {list(info.shape)} (config/weights mismatch?)")
    scale = infos.get(p.name + SCALE_SUFFIX)
    if info.dtype == "F8_E4M3":
        if scale is None:
            raise TensorDtypeError(f"tensor {name!r} is F8_E4M3 but {name + SCALE_SUFFIX!r} is missing")
        if len(info.shape) < 2:
            raise TensorDtypeError(f"tensor {name!r}: F8_E4M3 needs rank >= 2, got shape {list(info.shape)}")
        want = fp8.scale_shape(info.shape)
        if tuple(scale.shape) != want:
            raise TensorShapeError(f"tensor {name + SCALE_SUFFIX!r}: expected shape {list(want)} "
                                   f"({fp8.BLOCK[0]}x{fp8.BLOCK[1]} blocks of {list(info.shape)}), got {list(scale.shape)}")
        if scale.dtype not in FLOAT_DTYPES:
            raise TensorDtypeError(f"tensor {name + SCALE_SUFFIX!r}: dtype {scale.dtype}, expected one of {FLOAT_DTYPES}")
        return info.nbytes + scale.nbytes
    if info.dtype not in FLOAT_DTYPES:
        raise TensorDtypeError(f"tensor {name!r}: dtype {info.dtype}, expected one of {FLOAT_DTYPES} "
                               f"or F8_E4M3 with {SCALE_SUFFIX}")
    if scale is not None:
        raise TensorDtypeError(f"tensor {name!r} has {name + SCALE_SUFFIX!r} but is {info.dtype}, not F8_E4M3")
    return info.nbytes


def _classify_rest(cfg: ModelConfig, infos, actual, used: set[str]) -> list[str]:
    """Names not used by the plan: report the known-skippable ones, raise for the rest."""
    rest = [c for c in infos if c not in used and not (c.endswith(SCALE_SUFFIX) and c[:-len(SCALE_SUFFIX)] in used)]
    extra_layers: dict[int, list[str]] = {}
    extra_mtp: dict[int, list[str]] = {}
    vision, unknown = [], []
    for c in sorted(rest):
        m, mm = _LAYER.match(c), _MTP.match(c)
        if m and int(m.group(1)) >= cfg.num_layers:
            extra_layers.setdefault(int(m.group(1)), []).append(actual[c])
        elif mm and int(mm.group(1)) >= cfg.num_mtp_modules:
            extra_mtp.setdefault(int(mm.group(1)), []).append(actual[c])
        elif _VISION.match(c):
            vision.append(actual[c])
        elif _IGNORED.search(c):
            continue
        elif mm and c.endswith(".embed_tokens.weight"):
            vision.append(actual[c])  # a per-module copy of the shared embedding: not a parameter of ours
        else:
            unknown.append(actual[c])
    if unknown:
        shown = ", ".join(repr(u) for u in unknown[:10])
        more = f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
        raise UnknownTensorError(f"unknown tensor(s) not explained by the config: {shown}{more}")
    warnings = []
    if extra_layers:
        names = [n for v in extra_layers.values() for n in v]
        warnings.append(
            f"skipped {len(names)} tensors of layer indices {sorted(extra_layers)} >= num_layers ({cfg.num_layers}): "
            f"MTP slots this config does not use (M2 publishes no MTP weights), e.g. {names[:4]}")
    if extra_mtp:
        names = [n for v in extra_mtp.values() for n in v]
        warnings.append(f"skipped {len(names)} tensors of MTP modules {sorted(extra_mtp)} >= num_mtp_modules "
                        f"({cfg.num_mtp_modules}), e.g. {names[:4]}")
    if vision:
        warnings.append(f"skipped {len(vision)} tensors outside the text tower (e.g. {vision[0]!r})")
    return warnings
