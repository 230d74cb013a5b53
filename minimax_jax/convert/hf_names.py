"""Tensor-name mapping between Hugging Face MiniMax checkpoints and our params tree, for one layer
(or the top-level / MTP tensors) at a time through ``get(name)`` / ``has(name)`` callbacks.

The spellings themselves (M2 hub, transformers-native M2, M3 hub, transformers-native M3, MTP
modules under ``model.mtp.layers.{i}.``) live in ``minimax_jax.convert.layout``; this module is the
in-memory front end used by ``from_state`` and tests. Linear weights are transposed (HF
``[out, in]`` -> ours ``[in, out]``).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from minimax_jax.config import ModelConfig
from minimax_jax.convert.errors import MissingTensorError, TensorShapeError
from minimax_jax.convert.layout import (EXPORT_STYLE, Slot, layer_slots, mtp_layer_prefixes, mtp_slots,
                                        ours_to_piece, piece_to_ours, top_slots)

__all__ = ["MissingTensorError", "layer_from_hf", "layer_to_hf", "top_from_hf", "top_to_hf", "layer_hf_names",
           "mtp_from_hf", "mtp_to_hf"]

Getter = Callable[[str], np.ndarray]


def _set(tree: dict, path: tuple, value) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def _get(tree: dict, path: tuple):
    for k in path:
        tree = tree[k]
    return tree


def _read_slots(slots: list[Slot], get: Getter, has: Callable[[str], bool]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for slot in slots:
        alt = slot.resolve(has)
        if alt is None:
            names = [p.name for p in slot.alts[0].pieces if not has(p.name)]
            raise MissingTensorError(f"missing tensor {names[0]!r} needed for {'.'.join(map(str, slot.path))} "
                                     f"(no spelling of it is in the checkpoint)")
        buf = np.empty(slot.shape, np.float32)
        for p in alt.pieces:
            arr = np.asarray(get(p.name), np.float32)
            if tuple(arr.shape) != tuple(p.shape):
                raise TensorShapeError(f"tensor {p.name!r}: expected shape {list(p.shape)}, got {list(arr.shape)}")
            buf[p.dest] = piece_to_ours(p, arr)
        _set(out, slot.path, buf)
    return out


def _write_slots(slots: list[Slot], tree: dict, style: str) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for slot in slots:
        buf = np.asarray(_get(tree, slot.path))
        for p in slot.for_style(style).pieces:
            out[p.name] = ours_to_piece(p, buf)
    return out


def _style(cfg: ModelConfig, hub_layout: bool) -> str:
    if cfg.norm_kind == "gemma":
        return EXPORT_STYLE["gemma"]
    return "m2_hub" if hub_layout else "m2_native"


def layer_from_hf(get: Getter, has: Callable[[str], bool], prefix: str, cfg: ModelConfig,
                  layer_type: str, mlp_type: str) -> dict[str, Any]:
    """Read one decoder layer under ``prefix`` (e.g. ``"model.layers.3."``) into our layout.

    Args:
      get: returns a tensor (float numpy array, already dequantised) by full name.
      has: tells whether a name exists.
      prefix: name prefix of the layer.
      cfg, layer_type, mlp_type: what the layer must contain.
    Returns: the layer's params dict (float32 numpy arrays, no leading axis).
    Raises: MissingTensorError naming the missing tensor; TensorShapeError for a wrong shape.
    """
    return _read_slots(layer_slots(cfg, prefix, layer_type, mlp_type), get, has)


def layer_to_hf(layer: dict[str, Any], prefix: str, cfg: ModelConfig, layer_type: str, mlp_type: str,
                *, hub_layout: bool = True) -> dict[str, np.ndarray]:
    """Our layer params -> HF tensors. M2: ``hub_layout`` writes the hub's per-expert w1/w3/w2 names,
    else transformers' native names; M3 always writes the names transformers' M3 model loads."""
    return _write_slots(layer_slots(cfg, prefix, layer_type, mlp_type), layer, _style(cfg, hub_layout))


def layer_hf_names(cfg: ModelConfig, layer: int, *, hub_layout: bool = True) -> list[str]:
    """The HF names ``layer_to_hf`` writes for layer ``layer`` (for completeness checks)."""
    style = _style(cfg, hub_layout)
    slots = layer_slots(cfg, f"model.layers.{layer}.", cfg.layer_types[layer], cfg.mlp_types[layer])
    return sorted(p.name for s in slots for p in s.for_style(style).pieces)


def top_from_hf(get: Getter, has: Callable[[str], bool], cfg: ModelConfig) -> dict[str, Any]:
    """Embedding, final norm and lm_head."""
    return _read_slots(top_slots(cfg), get, has)


def top_to_hf(params: dict[str, Any], cfg: ModelConfig) -> dict[str, np.ndarray]:
    return _write_slots(top_slots(cfg), params, _style(cfg, True))


def mtp_from_hf(get: Getter, has: Callable[[str], bool], cfg: ModelConfig, i: int) -> dict[str, Any]:
    """MTP module ``i`` from ``model.mtp.layers.{i}.`` (enorm, hnorm, eh_proj, final_layernorm; its
    decoder layer under ``transformer_layer.``, ``mtp_block.`` or no sub-prefix)."""
    cands = mtp_layer_prefixes(i)
    lp = next((p for p in cands if has(p + "input_layernorm.weight")), cands[0])
    return _read_slots(mtp_slots(cfg, i, lp), get, has)


def mtp_to_hf(mod: dict[str, Any], cfg: ModelConfig, i: int) -> dict[str, np.ndarray]:
    """MTP module ``i`` -> HF tensors (decoder layer under ``transformer_layer.``, as vLLM reads it)."""
    return _write_slots(mtp_slots(cfg, i, mtp_layer_prefixes(i)[0]), mod, _style(cfg, True))
