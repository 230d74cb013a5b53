"""Attention override at load time: run a checkpoint's MSA layers as full (dense) attention.

``--attention dense`` (``load_model(..., attention="dense")``) turns every ``"msa"`` entry of
``cfg.layer_types`` into ``"full"`` and drops the index projections / norms from the parameters
(full-attention layers have none; the indexer is simply not used). Everything else (weights,
RoPE, norms, MoE, MTP modules) is unchanged, so the result is the same network with exact causal
attention in place of MSA's top-k block selection: the dense baseline for the same checkpoint.

The override lives in the config / parameter layer, driven by ``layer_types`` alone (no model-name
checks). ``"as_trained"`` (the default) returns the inputs unchanged.
"""

from __future__ import annotations

from typing import Any

from minimax_jax.config import ModelConfig

__all__ = ["ATTENTION_MODES", "INDEX_PARAM_NAMES", "apply_attention_mode", "check_attention_mode",
           "describe_attention_mode"]

#: Accepted values of ``--attention`` / ``load_model(attention=...)``.
ATTENTION_MODES = ("as_trained", "dense")
#: Parameters of an MSA layer's indexer (``docs/ARCHITECTURE.md``, params pytree).
INDEX_PARAM_NAMES = ("index_q_proj", "index_k_proj", "index_q_norm", "index_k_norm")


def check_attention_mode(mode: str) -> None:
    """Raise ValueError (naming the accepted values) unless ``mode`` is in ``ATTENTION_MODES``."""
    if mode not in ATTENTION_MODES:
        raise ValueError(f"attention mode must be one of {ATTENTION_MODES}, got {mode!r} "
                         "('dense' runs MSA layers as full attention; 'as_trained' keeps the checkpoint's layers)")


def _drop_index(layer: dict[str, Any]) -> dict[str, Any]:
    out = dict(layer)
    out["attn"] = {k: v for k, v in layer["attn"].items() if k not in INDEX_PARAM_NAMES}
    return out


def apply_attention_mode(cfg: ModelConfig, params: dict[str, Any], mode: str) -> tuple[ModelConfig, dict[str, Any]]:
    """Return ``(cfg, params)`` for attention ``mode`` (``ATTENTION_MODES``).

    ``"dense"``: ``layer_types`` "msa" -> "full"; index parameters removed from the decoder segments
    and from the MTP modules' layers. When no segment boundary moves (the usual case: MSA runs
    differ from their neighbours in the MLP kind too) the stacked arrays are reused as they are;
    otherwise the layers are re-stacked into the new segments (one copy of the decoder weights).
    A model without MSA layers is returned unchanged.

    Raises: ValueError for an unknown mode.
    """
    check_attention_mode(mode)
    if mode == "as_trained" or not cfg.has_msa:
        return cfg, params
    from minimax_jax.model.params import layer_segments, stack_layers, unstack_layers

    new_cfg = cfg.replace(layer_types=tuple("full" if t == "msa" else t for t in cfg.layer_types))
    old_segs, new_segs = layer_segments(cfg), layer_segments(new_cfg)
    out = dict(params)
    if [(s.start, s.length) for s in old_segs] == [(s.start, s.length) for s in new_segs]:
        out["segments"] = [_drop_index(sp) for sp in params["segments"]]
    else:
        out["segments"] = stack_layers([_drop_index(lp) for lp in unstack_layers(params, cfg)], new_cfg)
    if "mtp" in params:
        out["mtp"] = [dict(m, layer=_drop_index(m["layer"])) for m in params["mtp"]]
    return new_cfg, out


def describe_attention_mode(cfg_as_trained: ModelConfig, mode: str) -> str:
    """One line saying what ``mode`` does to this checkpoint (for the CLI's log and bench rows)."""
    check_attention_mode(mode)
    n_msa = sum(t == "msa" for t in cfg_as_trained.layer_types)
    if mode == "as_trained":
        kinds = ", ".join(f"{cfg_as_trained.layer_types.count(t)} {t}" for t in ("full", "msa", "sliding")
                          if t in cfg_as_trained.layer_types)
        return f"as_trained ({kinds} attention layers)"
    if n_msa == 0:
        return "dense (the model has no MSA layers: unchanged)"
    return f"dense ({n_msa} MSA layers run as full causal attention; their indexer weights are unused)"
