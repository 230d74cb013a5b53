"""Declarative map between HF checkpoint tensors and the leaves of our params tree.

Every leaf of one decoder layer (and the top-level / MTP leaves) is a *slot*: a list of
alternative spellings (``Alt``), each a list of ``Piece``s. A piece is one HF tensor: its name, the
HF shape the config implies, where it lands inside our (per-layer) leaf (``dest``, a tuple of
slices) and the axis permutation from HF to our orientation (HF linear ``[out, in]`` -> ours
``[in, out]``). A checkpoint uses, per slot, the first alternative whose tensors all exist.

Spellings (``style`` tags; MODEL_FACTS.md, transformers 5.24 ``conversion_mapping.py``, vLLM/SGLang
MiniMax-M3 loaders):
- ``m2_hub``: M2 hub files; ``block_sparse_moe.{gate.weight, e_score_correction_bias,
  experts.N.{w1,w3,w2}.weight}`` (w1 gate, w3 up, w2 down).
- ``m2_native``: transformers' in-memory M2; ``mlp.{gate.weight, e_score_correction_bias,
  experts.gate_up_proj [E,2I,H], experts.down_proj [E,H,I]}``.
- ``m3_hub``: M3 hub files; as m2_hub plus ``block_sparse_moe.shared_experts.{gate,up,down}_proj``,
  dense ``mlp.{gate,up,down}_proj``, ``self_attn.index_{q,k}_{proj,norm}``.
- ``m3_native``: what transformers' ``MiniMaxM3VLForCausalLM`` holds and saves (and the only
  spelling it loads): ``mlp.gate.{weight,e_score_correction_bias}``, ``mlp.experts.{gate_up_proj,
  down_proj}``, ``mlp.shared_experts.{gate_up_proj,down_proj}.weight``, dense
  ``mlp.{gate_up_proj,down_proj}.weight``, ``self_attn.indexer.{q_proj,k_proj,q_norm,k_norm}``.
MTP module i lives under ``model.mtp.layers.{i}.``: ``enorm``, ``hnorm``, ``eh_proj`` [H, 2H],
``final_layernorm`` and its decoder layer under ``transformer_layer.`` (vLLM's MiniMaxM3MTP; older
exports: ``mtp_block.`` or no sub-prefix).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from minimax_jax.config import ModelConfig

__all__ = ["Piece", "Alt", "Slot", "layer_slots", "top_slots", "mtp_slots", "mtp_layer_prefixes",
           "EXPORT_STYLE", "ALL_STYLES"]

ALL = slice(None)
ALL_STYLES = ("m2_hub", "m2_native", "m3_hub", "m3_native")
HUB = ("m2_hub", "m3_hub")
NATIVE = ("m2_native", "m3_native")
EXPORT_STYLE = {"rms": "m2_hub", "gemma": "m3_native"}  # by cfg.norm_kind: what HF transformers loads


@dataclasses.dataclass(frozen=True)
class Piece:
    """One HF tensor and where it goes. ``dest`` indexes our per-layer leaf; ``perm`` maps HF axes
    to ours (``ours = hf.transpose(perm)``), ``None`` for no permutation."""

    name: str
    shape: tuple[int, ...]
    dest: tuple[slice, ...]
    perm: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Alt:
    pieces: tuple[Piece, ...]
    styles: tuple[str, ...] = ALL_STYLES


@dataclasses.dataclass(frozen=True)
class Slot:
    """One leaf: ``path`` inside the layer (or the whole tree for top-level slots), our per-layer
    ``shape``, whether it is kept in float32, and its alternatives (first match wins)."""

    path: tuple[Any, ...]
    shape: tuple[int, ...]
    alts: tuple[Alt, ...]
    keep_f32: bool = False

    def resolve(self, has: Callable[[str], bool]) -> Alt | None:
        for a in self.alts:
            if all(has(p.name) for p in a.pieces):
                return a
        return None

    def for_style(self, style: str) -> Alt:
        for a in self.alts:
            if style in a.styles:
                return a
        raise KeyError(f"slot {self.path} has no {style} spelling")


def _t(name, out, inn, dest=(ALL, ALL)) -> Piece:
    """A linear weight stored HF-style [out, in] landing transposed at ``dest`` of our [in, out]."""
    return Piece(name, (out, inn), dest, (1, 0))


def _one(path, shape, *alts, keep_f32=False) -> Slot:
    return Slot(tuple(path), tuple(shape), tuple(alts), keep_f32)


def _vec(path, names_styles, n, keep_f32=False) -> Slot:
    return _one(path, (n,), *[Alt((Piece(nm, (n,), (ALL,)),), st) for nm, st in names_styles], keep_f32=keep_f32)


def layer_slots(cfg: ModelConfig, prefix: str, layer_type: str, mlp_type: str) -> list[Slot]:
    """Slots of one decoder layer whose HF names start with ``prefix`` (e.g. ``"model.layers.3."``)."""
    P = prefix
    H, qd, kd, D = cfg.hidden_size, cfg.q_dim, cfg.kv_dim, cfg.head_dim
    s: list[Slot] = [
        _vec(("input_norm", "scale"), [(P + "input_layernorm.weight", ALL_STYLES)], H),
        _vec(("post_attn_norm", "scale"), [(P + "post_attention_layernorm.weight", ALL_STYLES)], H),
        _one(("attn", "q_proj"), (H, qd), Alt((_t(P + "self_attn.q_proj.weight", qd, H),))),
        _one(("attn", "k_proj"), (H, kd), Alt((_t(P + "self_attn.k_proj.weight", kd, H),))),
        _one(("attn", "v_proj"), (H, kd), Alt((_t(P + "self_attn.v_proj.weight", kd, H),))),
        _one(("attn", "o_proj"), (qd, H), Alt((_t(P + "self_attn.o_proj.weight", H, qd),))),
    ]
    if cfg.qk_norm != "none":
        nq, nk = (qd, kd) if cfg.qk_norm == "full" else (D, D)
        s.append(_vec(("attn", "q_norm", "scale"), [(P + "self_attn.q_norm.weight", ALL_STYLES)], nq))
        s.append(_vec(("attn", "k_norm", "scale"), [(P + "self_attn.k_norm.weight", ALL_STYLES)], nk))
    if layer_type == "msa":
        Hi, Di = cfg.index_num_heads or cfg.num_kv_heads, cfg.index_head_dim
        for ours, hf_native, hf_hub, out in (("index_q_proj", "indexer.q_proj", "index_q_proj", Hi * Di),
                                             ("index_k_proj", "indexer.k_proj", "index_k_proj", Di)):
            s.append(_one(("attn", ours), (H, out),
                          Alt((_t(P + f"self_attn.{hf_native}.weight", out, H),), NATIVE),
                          Alt((_t(P + f"self_attn.{hf_hub}.weight", out, H),), HUB)))
        for ours, hf_native, hf_hub in (("index_q_norm", "indexer.q_norm", "index_q_norm"),
                                        ("index_k_norm", "indexer.k_norm", "index_k_norm")):
            s.append(_vec(("attn", ours, "scale"), [(P + f"self_attn.{hf_native}.weight", NATIVE),
                                                    (P + f"self_attn.{hf_hub}.weight", HUB)], Di))
    if mlp_type == "moe":
        s += _moe_slots(cfg, P)
    else:
        s += _gated_mlp_slots(cfg.dense_intermediate_size, H, ("mlp", "wi"), ("mlp", "wo"),
                              [(P + "mlp.", NATIVE, HUB)])
    return s


def _gated_mlp_slots(inter, H, wi_path, wo_path, bases) -> list[Slot]:
    """A gated MLP stored fused (``gate_up_proj`` [2I, H], gate rows first) or split
    (``gate_proj``/``up_proj`` [I, H]); ``down_proj`` [H, I]. ``bases``: (prefix, fused styles,
    split styles) per spelling."""
    wi_alts, wo_alts = [], []
    for base, fused_styles, split_styles in bases:
        if fused_styles:
            wi_alts.append(Alt((_t(base + "gate_up_proj.weight", 2 * inter, H),), fused_styles))
        if split_styles:
            wi_alts.append(Alt((_t(base + "gate_proj.weight", inter, H, (ALL, slice(0, inter))),
                                _t(base + "up_proj.weight", inter, H, (ALL, slice(inter, 2 * inter)))), split_styles))
        wo_alts.append(Alt((_t(base + "down_proj.weight", H, inter),), tuple(fused_styles) + tuple(split_styles)))
    return [_one(wi_path, (H, 2 * inter), *wi_alts), _one(wo_path, (inter, H), *wo_alts)]


def _moe_slots(cfg: ModelConfig, P: str) -> list[Slot]:
    H, E, I = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    router = _one(("mlp", "router"), (H, E),
                  Alt((_t(P + "block_sparse_moe.gate.weight", E, H),), HUB),
                  Alt((_t(P + "mlp.gate.weight", E, H),), NATIVE), keep_f32=True)
    bias = _vec(("mlp", "router_bias"), [(P + "block_sparse_moe.e_score_correction_bias", HUB),
                                         (P + "mlp.gate.e_score_correction_bias", ("m3_native",)),
                                         (P + "mlp.e_score_correction_bias", ("m2_native",))], E, keep_f32=True)

    def per_expert(base, g, u, d, styles):
        wi = [Piece(f"{base}{e}.{g}.weight", (I, H), (slice(e, e + 1), ALL, slice(0, I)), (1, 0)) for e in range(E)]
        wi += [Piece(f"{base}{e}.{u}.weight", (I, H), (slice(e, e + 1), ALL, slice(I, 2 * I)), (1, 0))
               for e in range(E)]
        wo = [Piece(f"{base}{e}.{d}.weight", (H, I), (slice(e, e + 1), ALL, ALL), (1, 0)) for e in range(E)]
        return Alt(tuple(wi), styles), Alt(tuple(wo), styles)

    hub_wi, hub_wo = per_expert(P + "block_sparse_moe.experts.", "w1", "w3", "w2", HUB)
    alt_wi = [hub_wi]
    alt_wo = [hub_wo]
    for base, names in ((P + "block_sparse_moe.experts.", ("gate_proj", "up_proj", "down_proj")),
                        (P + "mlp.experts.", ("w1", "w3", "w2")),
                        (P + "mlp.experts.", ("gate_proj", "up_proj", "down_proj"))):
        a, b = per_expert(base, *names, ())
        alt_wi.append(a)
        alt_wo.append(b)
    alt_wi.append(Alt((Piece(P + "mlp.experts.gate_up_proj", (E, 2 * I, H), (ALL, ALL, ALL), (0, 2, 1)),), NATIVE))
    alt_wo.append(Alt((Piece(P + "mlp.experts.down_proj", (E, H, I), (ALL, ALL, ALL), (0, 2, 1)),), NATIVE))
    # Per-expert pieces carry a length-1 expert slice; their HF arrays are 2-D, so they are expanded on
    # write (see ``assemble``). Native experts come first when present (one tensor per layer).
    out = [router, bias, _one(("mlp", "wi"), (E, H, 2 * I), *([alt_wi[-1]] + alt_wi[:-1])),
           _one(("mlp", "wo"), (E, I, H), *([alt_wo[-1]] + alt_wo[:-1]))]
    if cfg.shared_intermediate_size:
        out += _gated_mlp_slots(cfg.shared_intermediate_size, H, ("mlp", "shared_wi"), ("mlp", "shared_wo"),
                                [(P + "mlp.shared_experts.", NATIVE, ()),
                                 (P + "block_sparse_moe.shared_experts.", (), HUB),
                                 (P + "mlp.shared_experts.", (), ())])
    return out


def top_slots(cfg: ModelConfig) -> list[Slot]:
    """Embedding, final norm and (untied) lm_head; paths are in the whole params tree."""
    V, H = cfg.vocab_size, cfg.hidden_size
    s = [_one(("embed", "embedding"), (V, H), Alt((Piece("model.embed_tokens.weight", (V, H), (ALL, ALL)),))),
         _vec(("final_norm", "scale"), [("model.norm.weight", ALL_STYLES)], H)]
    if not cfg.tie_word_embeddings:
        s.append(_one(("lm_head",), (H, V), Alt((_t("lm_head.weight", V, H),))))
    return s


MTP_LAYER_SUBPREFIXES = ("transformer_layer.", "mtp_block.", "")


def mtp_layer_prefixes(i: int) -> list[str]:
    """Candidate prefixes of MTP module ``i``'s decoder layer, preferred first."""
    return [f"model.mtp.layers.{i}.{s}" for s in MTP_LAYER_SUBPREFIXES]


def mtp_slots(cfg: ModelConfig, i: int, layer_prefix: str) -> list[Slot]:
    """Slots of MTP module ``i`` (paths inside the module dict); its layer read under ``layer_prefix``."""
    from minimax_jax.model.params import mtp_layer_kinds  # lazy: params imports jax

    H = cfg.hidden_size
    p = f"model.mtp.layers.{i}."
    lt, mt = mtp_layer_kinds(cfg)
    s = [_vec(("enorm", "scale"), [(p + "enorm.weight", ALL_STYLES)], H),
         _vec(("hnorm", "scale"), [(p + "hnorm.weight", ALL_STYLES)], H),
         _one(("eh_proj",), (2 * H, H), Alt((_t(p + "eh_proj.weight", H, 2 * H),))),
         _vec(("final_norm", "scale"), [(p + "final_layernorm.weight", ALL_STYLES), (p + "norm.weight", ()),
                                        (p + "shared_head.norm.weight", ())], H)]
    for sl in layer_slots(cfg, layer_prefix, lt, mt):
        s.append(dataclasses.replace(sl, path=("layer",) + sl.path))
    return s


def piece_to_ours(piece: Piece, arr: np.ndarray) -> np.ndarray:
    """HF array -> our orientation, shaped for ``buf[piece.dest]``."""
    out = arr.transpose(piece.perm) if piece.perm else arr
    want_rank = len(piece.dest)
    while out.ndim < want_rank:  # per-expert 2-D piece into a [1, ...] expert slice
        out = out[None]
    return out


def ours_to_piece(piece: Piece, buf: np.ndarray) -> np.ndarray:
    """Inverse of ``piece_to_ours``: the HF tensor for ``piece`` cut from our per-layer leaf ``buf``."""
    sub = buf[piece.dest]
    while sub.ndim > len(piece.shape):
        sub = sub[0]
    if piece.perm:
        sub = sub.transpose(np.argsort(piece.perm))
    return np.ascontiguousarray(sub)
