"""Tensor-name mapping between Hugging Face MiniMax checkpoints and our params tree.

Layouts handled (MODEL_FACTS.md; transformers 5.24 ``save_pretrained`` output checked offline):
- M2 hub layout: ``model.layers.L.block_sparse_moe.{gate.weight, e_score_correction_bias,
  experts.N.w1/w2/w3.weight}`` (w1 = gate, w3 = up, w2 = down).
- HF-native in-memory layout: ``model.layers.L.mlp.{gate.weight, e_score_correction_bias,
  experts.gate_up_proj [E, 2I, H] (gate rows first), experts.down_proj [E, H, I]}``.
- M3 text: ``mlp.gate.{weight, e_score_correction_bias}``, ``mlp.experts.*``,
  ``mlp.shared_experts.{gate_up_proj, down_proj}.weight``, dense layers ``mlp.{gate_up_proj,
  down_proj}.weight``, index branch ``self_attn.indexer.{q_proj,k_proj,q_norm,k_norm}.weight`` or
  ``self_attn.{index_q_proj,index_k_proj,index_q_norm,index_k_norm}.weight``.
Linear weights are transposed (HF ``[out, in]`` -> ours ``[in, out]``).

This module works on one layer at a time through a ``get(name) -> np.ndarray`` callback so the
streaming converter never needs the whole model in memory.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import numpy as np

from minimax_jax.config import ModelConfig

__all__ = ["MissingTensorError", "layer_from_hf", "layer_to_hf", "top_from_hf", "top_to_hf", "layer_hf_names",
           "mtp_from_hf", "mtp_to_hf"]

Getter = Callable[[str], np.ndarray]


class MissingTensorError(KeyError):
    """A tensor the config requires is absent from the checkpoint (message names it)."""


def _first(get: Getter, has: Callable[[str], bool], names: Iterable[str]) -> np.ndarray:
    names = list(names)
    for n in names:
        if has(n):
            return get(n)
    raise MissingTensorError(f"missing tensor: none of {names} is in the checkpoint")


def layer_from_hf(get: Getter, has: Callable[[str], bool], prefix: str, cfg: ModelConfig,
                  layer_type: str, mlp_type: str) -> dict[str, Any]:
    """Read one decoder layer under ``prefix`` (e.g. ``"model.layers.3."``) into our layout.

    Args:
      get: returns a tensor (float numpy array, already dequantised) by full name.
      has: tells whether a name exists.
      prefix: name prefix of the layer.
      cfg, layer_type, mlp_type: what the layer must contain.
    Returns: the layer's params dict (numpy arrays, no leading axis).
    Raises: MissingTensorError naming the missing tensor.
    """
    g = lambda *ns: _first(get, has, [prefix + n for n in ns])  # noqa: E731
    attn: dict[str, Any] = {
        "q_proj": g("self_attn.q_proj.weight").T, "k_proj": g("self_attn.k_proj.weight").T,
        "v_proj": g("self_attn.v_proj.weight").T, "o_proj": g("self_attn.o_proj.weight").T,
    }
    if cfg.qk_norm != "none":
        attn["q_norm"] = {"scale": g("self_attn.q_norm.weight")}
        attn["k_norm"] = {"scale": g("self_attn.k_norm.weight")}
    if layer_type == "msa":
        attn["index_q_proj"] = g("self_attn.indexer.q_proj.weight", "self_attn.index_q_proj.weight").T
        attn["index_k_proj"] = g("self_attn.indexer.k_proj.weight", "self_attn.index_k_proj.weight").T
        attn["index_q_norm"] = {"scale": g("self_attn.indexer.q_norm.weight", "self_attn.index_q_norm.weight")}
        attn["index_k_norm"] = {"scale": g("self_attn.indexer.k_norm.weight", "self_attn.index_k_norm.weight")}
    if mlp_type == "moe":
        mlp: dict[str, Any] = {
            "router": g("block_sparse_moe.gate.weight", "mlp.gate.weight").T.astype(np.float32),
            "router_bias": g("block_sparse_moe.e_score_correction_bias", "mlp.e_score_correction_bias",
                             "mlp.gate.e_score_correction_bias").astype(np.float32),
        }
        if has(prefix + "mlp.experts.gate_up_proj"):
            mlp["wi"] = np.transpose(get(prefix + "mlp.experts.gate_up_proj"), (0, 2, 1))
            mlp["wo"] = np.transpose(g("mlp.experts.down_proj"), (0, 2, 1))
        else:
            wi, wo = [], []
            for e in range(cfg.num_experts):
                base = f"block_sparse_moe.experts.{e}."
                w1, w3, w2 = g(base + "w1.weight"), g(base + "w3.weight"), g(base + "w2.weight")
                wi.append(np.concatenate([w1.T, w3.T], axis=1))
                wo.append(w2.T)
            mlp["wi"], mlp["wo"] = np.stack(wi), np.stack(wo)
        if cfg.shared_intermediate_size:
            mlp["shared_wi"] = g("mlp.shared_experts.gate_up_proj.weight").T
            mlp["shared_wo"] = g("mlp.shared_experts.down_proj.weight").T
    else:
        mlp = {"wi": g("mlp.gate_up_proj.weight").T, "wo": g("mlp.down_proj.weight").T}
    return {"input_norm": {"scale": g("input_layernorm.weight")}, "attn": attn,
            "post_attn_norm": {"scale": g("post_attention_layernorm.weight")}, "mlp": mlp}


def layer_to_hf(layer: dict[str, Any], prefix: str, cfg: ModelConfig, layer_type: str, mlp_type: str,
                *, hub_layout: bool = True) -> dict[str, np.ndarray]:
    """Our layer params -> HF tensors. ``hub_layout`` writes M2's per-expert w1/w2/w3 names;
    M3 (shared expert / gemma norms) always uses the M3 names that transformers saves."""
    a, m = layer["attn"], layer["mlp"]
    out = {prefix + "input_layernorm.weight": layer["input_norm"]["scale"],
           prefix + "post_attention_layernorm.weight": layer["post_attn_norm"]["scale"]}
    for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
        out[prefix + f"self_attn.{n}.weight"] = np.asarray(a[n]).T
    if "q_norm" in a:
        out[prefix + "self_attn.q_norm.weight"] = a["q_norm"]["scale"]
        out[prefix + "self_attn.k_norm.weight"] = a["k_norm"]["scale"]
    if layer_type == "msa":
        out[prefix + "self_attn.indexer.q_proj.weight"] = np.asarray(a["index_q_proj"]).T
        out[prefix + "self_attn.indexer.k_proj.weight"] = np.asarray(a["index_k_proj"]).T
        out[prefix + "self_attn.indexer.q_norm.weight"] = a["index_q_norm"]["scale"]
        out[prefix + "self_attn.indexer.k_norm.weight"] = a["index_k_norm"]["scale"]
    m3_names = cfg.norm_kind == "gemma"
    if mlp_type == "moe":
        wi, wo = np.asarray(m["wi"]), np.asarray(m["wo"])
        if m3_names:
            out[prefix + "mlp.gate.weight"] = np.asarray(m["router"]).T
            out[prefix + "mlp.gate.e_score_correction_bias"] = m["router_bias"]
            out[prefix + "mlp.experts.gate_up_proj"] = np.transpose(wi, (0, 2, 1))
            out[prefix + "mlp.experts.down_proj"] = np.transpose(wo, (0, 2, 1))
        elif hub_layout:
            out[prefix + "block_sparse_moe.gate.weight"] = np.asarray(m["router"]).T
            out[prefix + "block_sparse_moe.e_score_correction_bias"] = m["router_bias"]
            i = wi.shape[-1] // 2
            for e in range(wi.shape[0]):
                base = prefix + f"block_sparse_moe.experts.{e}."
                out[base + "w1.weight"] = wi[e, :, :i].T
                out[base + "w3.weight"] = wi[e, :, i:].T
                out[base + "w2.weight"] = wo[e].T
        else:
            out[prefix + "mlp.gate.weight"] = np.asarray(m["router"]).T
            out[prefix + "mlp.e_score_correction_bias"] = m["router_bias"]
            out[prefix + "mlp.experts.gate_up_proj"] = np.transpose(wi, (0, 2, 1))
            out[prefix + "mlp.experts.down_proj"] = np.transpose(wo, (0, 2, 1))
        if "shared_wi" in m:
            out[prefix + "mlp.shared_experts.gate_up_proj.weight"] = np.asarray(m["shared_wi"]).T
            out[prefix + "mlp.shared_experts.down_proj.weight"] = np.asarray(m["shared_wo"]).T
    else:
        out[prefix + "mlp.gate_up_proj.weight"] = np.asarray(m["wi"]).T
        out[prefix + "mlp.down_proj.weight"] = np.asarray(m["wo"]).T
    return {k: np.ascontiguousarray(np.asarray(v)) for k, v in out.items()}


def layer_hf_names(cfg: ModelConfig, layer: int, *, hub_layout: bool = True) -> list[str]:
    """The HF names ``layer_to_hf`` writes for layer ``layer`` (for completeness checks)."""
    import jax

    from minimax_jax.model.params import abstract_params, segment_of_layer  # lazy: avoids cycles

    ap = abstract_params(cfg)
    si, j = segment_of_layer(cfg, layer)
    lp = jax.tree.map(lambda x: np.zeros(x.shape[1:], np.float32), ap["segments"][si])
    return sorted(layer_to_hf(lp, f"model.layers.{layer}.", cfg, cfg.layer_types[layer], cfg.mlp_types[layer],
                              hub_layout=hub_layout))


def top_from_hf(get: Getter, has: Callable[[str], bool], cfg: ModelConfig) -> dict[str, Any]:
    """Embedding, final norm and lm_head."""
    out: dict[str, Any] = {"embed": {"embedding": _first(get, has, ["model.embed_tokens.weight"])},
                           "final_norm": {"scale": _first(get, has, ["model.norm.weight"])}}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = _first(get, has, ["lm_head.weight"]).T
    return out


def top_to_hf(params: dict[str, Any], cfg: ModelConfig) -> dict[str, np.ndarray]:
    out = {"model.embed_tokens.weight": np.asarray(params["embed"]["embedding"]),
           "model.norm.weight": np.asarray(params["final_norm"]["scale"])}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = np.ascontiguousarray(np.asarray(params["lm_head"]).T)
    return out


def mtp_from_hf(get: Getter, has: Callable[[str], bool], cfg: ModelConfig, i: int) -> dict[str, Any]:
    """MTP module ``i`` from ``model.mtp.layers.{i}.`` (enorm, hnorm, eh_proj, one decoder layer
    under ``.mtp_block.`` or directly, final norm ``.norm`` / ``.final_layernorm``)."""
    from minimax_jax.model.params import mtp_layer_kinds

    p = f"model.mtp.layers.{i}."
    lt, mt = mtp_layer_kinds(cfg)
    layer_prefix = p + "mtp_block." if has(p + "mtp_block.input_layernorm.weight") else p
    return {
        "enorm": {"scale": _first(get, has, [p + "enorm.weight"])},
        "hnorm": {"scale": _first(get, has, [p + "hnorm.weight"])},
        "eh_proj": _first(get, has, [p + "eh_proj.weight"]).T,
        "layer": layer_from_hf(get, has, layer_prefix, cfg, lt, mt),
        "final_norm": {"scale": _first(get, has, [p + "final_layernorm.weight", p + "norm.weight",
                                                  p + "shared_head.norm.weight"])},
    }


def mtp_to_hf(mod: dict[str, Any], cfg: ModelConfig, i: int) -> dict[str, np.ndarray]:
    from minimax_jax.model.params import mtp_layer_kinds

    p = f"model.mtp.layers.{i}."
    lt, mt = mtp_layer_kinds(cfg)
    out = {p + "enorm.weight": np.asarray(mod["enorm"]["scale"]), p + "hnorm.weight": np.asarray(mod["hnorm"]["scale"]),
           p + "eh_proj.weight": np.ascontiguousarray(np.asarray(mod["eh_proj"]).T),
           p + "final_layernorm.weight": np.asarray(mod["final_norm"]["scale"])}
    out.update(layer_to_hf(mod["layer"], p + "mtp_block.", cfg, lt, mt))
    return out
