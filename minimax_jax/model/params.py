"""Parameter pytree: layout, initialisation, logical axes, segments of stacked layers.

The layout is documented in docs/ARCHITECTURE.md. Linear weights are ``[in, out]``. Consecutive
layers of the same (layer_type, mlp_type) form a segment whose leaves are stacked on a leading
layer axis, so the forward scans a segment and compile time does not grow with depth.

Inference may hold the decoder layers *split* instead (``split_layers``): each segment a list of
per-layer trees, each leaf its own device buffer. The unrolled decode / prefill step
(``minimax_jax.decode.step``) would read layer j's weights from the stack as ``a[j]``, and XLA materialises
a slice that feeds a custom call (the Pallas grouped matmuls): a copy of every layer's expert weights in
every step. Split layers are read in place. ``forward`` and ``model_step``
take either layout (``layer_params``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from minimax_jax.config import ModelConfig, dtype_of

__all__ = ["Segment", "layer_segments", "init_params", "abstract_params", "param_axes",
           "init_layer_params", "layer_axes", "add_index_params", "segment_of_layer", "count_params",
           "is_split", "layer_params", "split_layers", "layers_layout"]


@dataclasses.dataclass(frozen=True)
class Segment:
    """A run of ``length`` identical layers starting at layer ``start``."""

    start: int
    length: int
    layer_type: str
    mlp_type: str


def layer_segments(cfg: ModelConfig) -> list[Segment]:
    """Split the layers into maximal runs of equal (layer_type, mlp_type)."""
    segs: list[Segment] = []
    for i, kinds in enumerate(zip(cfg.layer_types, cfg.mlp_types)):
        if segs and (segs[-1].layer_type, segs[-1].mlp_type) == kinds and segs[-1].start + segs[-1].length == i:
            s = segs[-1]
            segs[-1] = Segment(s.start, s.length + 1, s.layer_type, s.mlp_type)
        else:
            segs.append(Segment(i, 1, kinds[0], kinds[1]))
    return segs


def segment_of_layer(cfg: ModelConfig, layer: int) -> tuple[int, int]:
    """Map a layer index to ``(segment index, offset inside the segment)``."""
    for si, s in enumerate(layer_segments(cfg)):
        if s.start <= layer < s.start + s.length:
            return si, layer - s.start
    raise IndexError(f"layer {layer} out of range [0, {cfg.num_layers})")


# ----------------------------------------------------------------------------- axes
def layer_axes(cfg: ModelConfig, layer_type: str, mlp_type: str) -> dict[str, Any]:
    """Logical axis names of one layer's params (no leading layer axis)."""
    norm = {"scale": ("norm",)}
    attn: dict[str, Any] = {
        "q_proj": ("embed", "q_heads"), "k_proj": ("embed", "kv_heads"), "v_proj": ("embed", "kv_heads"),
        "o_proj": ("q_heads", "embed"),
    }
    if cfg.qk_norm == "full":
        attn["q_norm"] = {"scale": ("q_heads",)}
        attn["k_norm"] = {"scale": ("kv_heads",)}
    elif cfg.qk_norm == "per_head":
        attn["q_norm"] = {"scale": ("head_dim",)}
        attn["k_norm"] = {"scale": ("head_dim",)}
    if layer_type == "msa":
        attn["index_q_proj"] = ("embed", "index_heads")
        attn["index_k_proj"] = ("embed", "index_dim")
        attn["index_q_norm"] = {"scale": ("index_dim",)}
        attn["index_k_norm"] = {"scale": ("index_dim",)}
    if mlp_type == "moe":
        mlp: dict[str, Any] = {
            "router": ("embed", "experts_router"), "router_bias": ("experts_router",),
            "wi": ("experts", "embed_expert", "mlp_expert"), "wo": ("experts", "mlp_expert", "embed_expert"),
        }
        if cfg.shared_intermediate_size:
            mlp["shared_wi"] = ("embed", "mlp")
            mlp["shared_wo"] = ("mlp", "embed")
    else:
        mlp = {"wi": ("embed", "mlp"), "wo": ("mlp", "embed")}
    return {"input_norm": dict(norm), "attn": attn, "post_attn_norm": dict(norm), "mlp": mlp}


def param_axes(cfg: ModelConfig) -> dict[str, Any]:
    """The params tree with a tuple of logical axis names in place of each leaf."""
    segs = []
    for s in layer_segments(cfg):
        la = layer_axes(cfg, s.layer_type, s.mlp_type)
        segs.append(jax.tree.map(lambda a: ("layers",) + a, la, is_leaf=lambda x: isinstance(x, tuple)))
    out: dict[str, Any] = {
        "embed": {"embedding": ("vocab", "embed")},
        "segments": segs,
        "final_norm": {"scale": ("norm",)},
    }
    if not cfg.tie_word_embeddings:
        out["lm_head"] = ("embed", "vocab")
    if cfg.num_mtp_modules:
        out["mtp"] = [_mtp_axes(cfg) for _ in range(cfg.num_mtp_modules)]
    return out


def _mtp_axes(cfg):
    lt, mt = mtp_layer_kinds(cfg)
    return {"enorm": {"scale": ("norm",)}, "hnorm": {"scale": ("norm",)}, "eh_proj": ("embed2", "embed"),
            "layer": layer_axes(cfg, lt, mt), "final_norm": {"scale": ("norm",)}}


def mtp_layer_kinds(cfg: ModelConfig) -> tuple[str, str]:
    """MTP modules use the model's last layer kind (M3: an MSA + MoE layer)."""
    return cfg.layer_types[-1], cfg.mlp_types[-1]


def mtp_compute_kinds(cfg: ModelConfig) -> tuple[ModelConfig, str, str]:
    """(config, attention kind, MLP kind) the MTP modules compute with: their params' kinds
    (``mtp_layer_kinds``), or with ``cfg.mtp_attention_window`` = W a ``sliding`` attention of W tokens over
    the same weights (an MSA layer's index branch then goes unused)."""
    lt, mt = mtp_layer_kinds(cfg)
    if cfg.mtp_attention_window is None:
        return cfg, lt, mt
    return dataclasses.replace(cfg, sliding_window=cfg.mtp_attention_window), "sliding", mt


# ----------------------------------------------------------------------------- init
def _normal(key, shape, std, dtype):
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def _norm_init(cfg: ModelConfig, n: int, dtype) -> dict[str, jax.Array]:
    # Stored as the checkpoint stores it: "rms" multiplies by w (init 1); "gemma" by (1 + w) (init 0).
    return {"scale": (jnp.zeros if cfg.norm_kind == "gemma" else jnp.ones)((n,), dtype)}


def init_layer_params(cfg: ModelConfig, key: jax.Array, layer_type: str, mlp_type: str) -> dict[str, Any]:
    """Random params of one decoder layer (normal(0, initializer_range) weights)."""
    pd = dtype_of(cfg.param_dtype)
    std = cfg.initializer_range
    H = cfg.hidden_size
    ks = iter(jax.random.split(key, 16))
    attn: dict[str, Any] = {
        "q_proj": _normal(next(ks), (H, cfg.q_dim), std, pd),
        "k_proj": _normal(next(ks), (H, cfg.kv_dim), std, pd),
        "v_proj": _normal(next(ks), (H, cfg.kv_dim), std, pd),
        "o_proj": _normal(next(ks), (cfg.q_dim, H), std, pd),
    }
    if cfg.qk_norm == "full":
        attn["q_norm"] = _norm_init(cfg, cfg.q_dim, pd)
        attn["k_norm"] = _norm_init(cfg, cfg.kv_dim, pd)
    elif cfg.qk_norm == "per_head":
        attn["q_norm"] = _norm_init(cfg, cfg.head_dim, pd)
        attn["k_norm"] = _norm_init(cfg, cfg.head_dim, pd)
    if layer_type == "msa":
        attn.update(_index_params(cfg, next(ks)))
    if mlp_type == "moe":
        E, I = cfg.num_experts, cfg.moe_intermediate_size
        mlp: dict[str, Any] = {
            "router": _normal(next(ks), (H, E), std, jnp.float32),
            "router_bias": jnp.zeros((E,), jnp.float32),
            "wi": _normal(next(ks), (E, H, 2 * I), std, pd),
            "wo": _normal(next(ks), (E, I, H), std, pd),
        }
        if cfg.shared_intermediate_size:
            Is = cfg.shared_intermediate_size
            mlp["shared_wi"] = _normal(next(ks), (H, 2 * Is), std, pd)
            mlp["shared_wo"] = _normal(next(ks), (Is, H), std, pd)
    else:
        I = cfg.dense_intermediate_size
        mlp = {"wi": _normal(next(ks), (H, 2 * I), std, pd), "wo": _normal(next(ks), (I, H), std, pd)}
    return {"input_norm": _norm_init(cfg, H, pd), "attn": attn, "post_attn_norm": _norm_init(cfg, H, pd),
            "mlp": mlp}


def _index_params(cfg: ModelConfig, key: jax.Array) -> dict[str, Any]:
    pd = dtype_of(cfg.param_dtype)
    k1, k2 = jax.random.split(key)
    H, Hi, Di = cfg.hidden_size, cfg.index_num_heads or cfg.num_kv_heads, cfg.index_head_dim
    return {
        "index_q_proj": _normal(k1, (H, Hi * Di), cfg.initializer_range, pd),
        "index_k_proj": _normal(k2, (H, Di), cfg.initializer_range, pd),
        "index_q_norm": _norm_init(cfg, Di, pd),
        "index_k_norm": _norm_init(cfg, Di, pd),
    }


def init_params(cfg: ModelConfig, key: jax.Array) -> dict[str, Any]:
    """Random params for ``cfg`` (see docs/ARCHITECTURE.md for the layout)."""
    pd = dtype_of(cfg.param_dtype)
    k_emb, k_head, k_layers, k_mtp = jax.random.split(key, 4)
    segs = []
    layer_keys = jax.random.split(k_layers, cfg.num_layers)
    for s in layer_segments(cfg):
        keys = layer_keys[s.start:s.start + s.length]
        segs.append(jax.vmap(lambda k, s=s: init_layer_params(cfg, k, s.layer_type, s.mlp_type))(keys))
    params: dict[str, Any] = {
        "embed": {"embedding": _normal(k_emb, (cfg.vocab_size, cfg.hidden_size), cfg.initializer_range, pd)},
        "segments": segs,
        "final_norm": _norm_init(cfg, cfg.hidden_size, pd),
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = _normal(k_head, (cfg.hidden_size, cfg.vocab_size), cfg.initializer_range, pd)
    if cfg.num_mtp_modules:
        lt, mt = mtp_layer_kinds(cfg)
        mods = []
        for mk in jax.random.split(k_mtp, cfg.num_mtp_modules):
            a, b = jax.random.split(mk)
            H = cfg.hidden_size
            mods.append({"enorm": _norm_init(cfg, H, pd), "hnorm": _norm_init(cfg, H, pd),
                         "eh_proj": _normal(a, (2 * H, H), cfg.initializer_range, pd),
                         "layer": init_layer_params(cfg, b, lt, mt), "final_norm": _norm_init(cfg, H, pd)})
        params["mtp"] = mods
    return params


def abstract_params(cfg: ModelConfig) -> dict[str, Any]:
    """ShapeDtypeStructs of the params (no memory is allocated): ``jax.eval_shape`` of init."""
    return jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))


def count_params(tree: Any) -> int:
    """Number of scalars in a params (or abstract params) tree."""
    return sum(int(x.size) for x in jax.tree.leaves(tree))


def add_index_params(params: dict[str, Any], old_cfg: ModelConfig, new_cfg: ModelConfig,
                     key: jax.Array) -> dict[str, Any]:
    """Re-stack ``params`` of ``old_cfg`` into the segments of ``new_cfg`` (e.g. after ``with_msa``),
    initialising index projections/norms for layers that became "msa". Used to turn a dense
    checkpoint into an MSA one ("sparse continued pre-training").

    Raises ValueError when the two configs differ in anything but layer_types / index fields.
    """
    keep = {f.name for f in dataclasses.fields(ModelConfig)} - {
        "layer_types", "index_num_heads", "index_head_dim", "index_block_size", "index_topk",
        "index_init_blocks", "index_local_blocks", "index_rope", "msa_impl", "sliding_window"}
    diff = [n for n in sorted(keep) if getattr(old_cfg, n) != getattr(new_cfg, n)]
    if diff:
        raise ValueError(f"add_index_params: configs differ in {diff}; only layer types / index fields may change")
    n_mtp = len(params.get("mtp", ()))
    keys = jax.random.split(key, new_cfg.num_layers + n_mtp)

    def convert(lp: dict[str, Any], layer_type: str, k: jax.Array) -> dict[str, Any]:
        lp = dict(lp)
        attn = dict(lp["attn"])
        if layer_type == "msa" and "index_q_proj" not in attn:
            attn.update(_index_params(new_cfg, k))
        if layer_type != "msa":
            for n in ("index_q_proj", "index_k_proj", "index_q_norm", "index_k_norm"):
                attn.pop(n, None)
        lp["attn"] = attn
        return lp

    new_layers = [convert(lp, new_cfg.layer_types[i], keys[i])
                  for i, lp in enumerate(unstack_layers(params, old_cfg))]
    out = dict(params)
    out["segments"] = stack_layers(new_layers, new_cfg)
    if n_mtp:   # MTP modules take the last layer's kind (mtp_layer_kinds), which with_msa may change
        lt, _ = mtp_layer_kinds(new_cfg)
        out["mtp"] = [{**m, "layer": convert(m["layer"], lt, keys[new_cfg.num_layers + j])}
                      for j, m in enumerate(params["mtp"])]
    return out


def is_split(segment_params) -> bool:
    """Whether one entry of ``params["segments"]`` holds split layers (a list of per-layer trees,
    ``split_layers``) rather than stacked ones (a tree whose leaves lead with the layer axis)."""
    return isinstance(segment_params, (list, tuple))


def layer_params(segment_params, j: int):
    """Layer ``j`` of a segment's params (no leading axis), from either layout (``is_split``)."""
    if is_split(segment_params):
        return segment_params[j]
    return jax.tree.map(lambda x: x[j], segment_params)


def layers_layout(params: dict[str, Any]) -> str:
    """``"split"`` when every segment holds split layers, ``"stacked"`` when none does, else ``"mixed"``."""
    split = [is_split(sp) for sp in params["segments"]]
    return "split" if all(split) else ("stacked" if not any(split) else "mixed")


def _split_leaf(x, length: int):
    """``[L, ...] -> L`` arrays ``[...]`` (one jitted program; each output its own buffer), sharded as ``x``
    minus its leading axis when ``x`` has a ``NamedSharding``."""
    sh = getattr(x, "sharding", None)
    out = None
    if isinstance(sh, jax.sharding.NamedSharding):
        spec = tuple(sh.spec) + (None,) * (x.ndim - len(sh.spec))
        out = jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec(*spec[1:]))
        out = (out,) * length
    return jax.jit(lambda a: tuple(a[j] for j in range(length)), out_shardings=out)(x)


def split_layers(params: dict[str, Any], cfg: ModelConfig, *, delete_stacked: bool = False) -> dict[str, Any]:
    """Params with every segment's stacked layers split into a list of per-layer trees (module docstring).

    Args:
      params: a params tree (either layout; split segments are kept as they are); a stacked leaf is
        ``[L_seg, ...]`` of any dtype (``Fp8Weight`` leaves split through their arrays).
      cfg: its config (``layer_segments`` gives each segment's ``L_seg``).
      delete_stacked: delete each stacked device array once its layers are split out (the caller must own
        ``params`` and not use it again), so the device needs room for one extra leaf at a time, not a
        second copy of the decoder weights.
    Returns: the same tree with ``"segments"`` a list (per segment) of ``L_seg`` per-layer trees (leaves
      ``[...]``, same dtypes, ``NamedSharding`` kept minus the layer axis); every other entry shared with
      ``params``. Values are unchanged.
    Raises: IndexError (from indexing) when a leaf's leading axis is shorter than its segment.
    """
    segs = []
    for s, sp in zip(layer_segments(cfg), params["segments"]):
        if is_split(sp):
            segs.append(list(sp))
            continue
        leaves, tree = jax.tree.flatten(sp)
        parts = []
        for x in leaves:
            parts.append(_split_leaf(x, s.length) if isinstance(x, jax.Array) else tuple(x[j] for j in range(s.length)))
            if delete_stacked and isinstance(x, jax.Array):
                x.delete()
        segs.append([jax.tree.unflatten(tree, [p[j] for p in parts]) for j in range(s.length)])
    return {**params, "segments": segs}


def unstack_layers(params: dict[str, Any], cfg: ModelConfig) -> list[dict[str, Any]]:
    """Per-layer param dicts (no leading axis), in layer order (either layout, ``is_split``)."""
    out = []
    for s, sp in zip(layer_segments(cfg), params["segments"]):
        for j in range(s.length):
            out.append(layer_params(sp, j))
    return out


def stack_layers(layers: list[dict[str, Any]], cfg: ModelConfig) -> list[dict[str, Any]]:
    """Inverse of ``unstack_layers``: stack per-layer dicts into ``cfg``'s segments."""
    if len(layers) != cfg.num_layers:
        raise ValueError(f"stack_layers: got {len(layers)} layers, config has {cfg.num_layers}")
    return [jax.tree.map(lambda *xs: jnp.stack(xs), *layers[s.start:s.start + s.length])
            for s in layer_segments(cfg)]
