"""Typed, validated model configuration for MiniMax-M2 / MiniMax-M3 style models.

One dataclass, ``ModelConfig``, describes every supported architecture through fields, never
through model names. It loads from our YAML (``configs/*.yaml``) and from a Hugging Face
``config.json`` in both styles the M2 family uses (hub style with ``rotary_dim``; HF-native style
with ``rope_parameters.partial_rotary_factor``) and the M3 text style (``layer_types``,
``mlp_layer_types``, ``index_*``). Sources: transformers ``MiniMaxM2Config`` and
``MiniMaxM3VLTextConfig`` (>= 5.24); ``../shared/docs/MODEL_FACTS.md``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

import yaml

__all__ = ["ConfigError", "ModelConfig", "load_config"]

LAYER_TYPES = ("full", "msa", "sliding")
MLP_TYPES = ("moe", "dense")
NORM_KINDS = ("rms", "gemma")
QK_NORMS = ("full", "per_head", "none")
ACTIVATIONS = ("silu", "swigluoai")
DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A configuration is unknown, inconsistent or malformed; the message names the field."""


#: ModelConfig field -> the registered op whose ``implementation=`` names it takes (the MSA ops share one set).
IMPLEMENTATION_FIELDS = {"attention_impl": "attention", "sliding_attention_impl": "attention", "moe_impl": "moe",
                         "msa_impl": "msa_attention"}
#: Implementation names before the one naming scheme (minimax_jax.ops.registry) -> what they are now.
RENAMED = {"attention": {"pallas_flash": "pallas_flash_gpu or pallas_flash_tpu"},
           "moe": {"dense": "xla_dense", "ragged": "xla_ragged", "capacity": "xla_capacity"},
           "msa_attention": {"pallas_interpret": "pallas_tpu_interpret"}}


def _registry():
    """``minimax_jax.ops.registry`` with every op registered. Imported on first use: importing this
    module stays free of jax (``minimax_jax.convert`` reads configs without it)."""
    import minimax_jax.ops  # noqa: F401, PLC0415  (registers every op's implementations)
    from minimax_jax.ops import registry  # noqa: PLC0415

    return registry


def implementation_backends(cfg) -> dict[str, tuple[str, ...]]:
    """The config's explicitly chosen implementations that run only on some backends:
    ``{"model.<field>=<name>": (backends...)}`` (``"auto"`` and portable ones are left out)."""
    out = {}
    for field, op in IMPLEMENTATION_FIELDS.items():
        if getattr(cfg, field) == "auto":
            continue
        impl = _registry().get_op(op).implementations.get(getattr(cfg, field))
        if impl is not None and impl.platforms is not None:
            out[f"model.{field}={impl.name}"] = impl.platforms
    return out


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of an M2/M3-style decoder (every field with its default: docs/CONFIG.md).

    Attributes:
      vocab_size: token ids the embedding and the lm head cover; a tokenizer's ids must be below it.
      hidden_size: width of the residual stream.
      num_layers: decoder layers.
      num_heads: query heads per attention layer.
      num_kv_heads: key / value heads (GQA); ``num_heads`` must be a multiple of it.
      head_dim: width of one attention head.
      rotary_dim: leading dims of each head rotated by RoPE (partial NeoX RoPE); even, <= ``head_dim``.
      rope_theta: RoPE base frequency.
      max_position_embeddings: longest sequence (in tokens) the model accepts.
      rms_norm_eps: epsilon of every RMS norm.
      norm_kind: ``rms`` (y = x_hat * w, M2) or ``gemma`` (y = x_hat * (1 + w), M3).
      qk_norm: ``full`` (M2: over the whole projected q / k width), ``per_head`` (M3: one
        ``[head_dim]`` weight) or ``none``.
      layer_types: attention of each layer: ``full``, ``msa`` or ``sliding``. A list, one string for
        every layer, or ``{prefix: [...], pattern: [...]}`` (the prefix, then the pattern repeated);
        empty = every layer ``full``.
      mlp_types: MLP of each layer: ``moe`` or ``dense``, in the same forms; empty = every layer ``moe``.
      sliding_window: tokens a query sees in ``sliding`` layers (itself included); needed by them.
      mlp_activation: ``silu`` (SwiGLU, M2) or ``swigluoai`` (M3: clamped, ``swiglu_alpha`` slope).
      swiglu_alpha: ``swigluoai`` sigmoid slope.
      swiglu_limit: ``swigluoai`` clamp limit of the gate and up projections.
      dense_intermediate_size: hidden width of the ``dense`` MLP layers.
      num_experts: routed experts per MoE layer.
      num_experts_per_tok: experts each token is routed to (top-k).
      moe_intermediate_size: hidden width of one routed expert.
      shared_intermediate_size: hidden width of the shared expert every token uses (0 = none).
      routed_scaling_factor: multiplies the sum of the routed experts' outputs (M2 1.0, M3 2.0).
      index_num_heads: MSA index-query heads; 0 = ``num_kv_heads`` (the only valid value with ``msa`` layers).
      index_head_dim: width of the MSA index query / key heads (even).
      index_block_size: MSA key block size in tokens (the unit the indexer selects).
      index_topk: MSA blocks each query attends, the initial and local blocks included.
      index_init_blocks: MSA blocks at the start of the sequence every query attends (0 in M3).
      index_local_blocks: MSA blocks nearest each query that it always attends (>= 1; 1 in M3).
      index_rope: apply the partial RoPE to the MSA index queries and keys.
      num_mtp_modules: multi-token-prediction modules (0 = none).
      mtp_attention_window: None, or W: the MTP modules attend over a sliding window of their last W tokens
        (itself included) instead of their layer kind's attention, in training and drafting alike; drafts then
        equal the trained computation when the drafting window (``infer.py --mtp_window``) holds at least
        num_draft * (W - 1) + 1 tokens (depth d reads d windows back).
      tie_word_embeddings: the lm head reuses the embedding matrix.
      bos_token_id: id of the tokenizer's begin-of-sequence token (null = none).
      eos_token_id: id of the end-of-sequence token; generation stops on it (null = none).
      pad_token_id: id of the padding token (null = none).
      initializer_range: standard deviation of the normal init of weights trained from scratch.
      dtype: activation / compute dtype: ``float32``, ``bfloat16`` or ``float16``.
      param_dtype: parameter dtype (same choices).
      attention_impl: implementation of the attention op in ``full`` layers (``auto`` picks per backend).
      sliding_attention_impl: implementation of the attention op in ``sliding`` layers (no flash
        kernel has a window).
      moe_impl: implementation of the MoE op (``auto`` picks per backend and problem size).
      msa_impl: implementation of the MSA ops (selection, sparse attention, indexer KL).
    """

    vocab_size: int = 200064
    hidden_size: int = 3072
    num_layers: int = 62
    num_heads: int = 48
    num_kv_heads: int = 8
    head_dim: int = 128
    rotary_dim: int = 64
    rope_theta: float = 5_000_000.0
    max_position_embeddings: int = 196_608
    rms_norm_eps: float = 1e-6
    norm_kind: str = "rms"
    qk_norm: str = "full"
    layer_types: tuple[str, ...] = ()
    mlp_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    mlp_activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    dense_intermediate_size: int = 0
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 1536
    shared_intermediate_size: int = 0
    routed_scaling_factor: float = 1.0
    index_num_heads: int = 0
    index_head_dim: int = 128
    index_block_size: int = 128
    index_topk: int = 16
    index_init_blocks: int = 0
    index_local_blocks: int = 1
    index_rope: bool = True
    num_mtp_modules: int = 0
    mtp_attention_window: int | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 200034
    eos_token_id: int | None = 200020
    pad_token_id: int | None = None
    initializer_range: float = 0.02
    dtype: str = "bfloat16"
    param_dtype: str = "bfloat16"
    attention_impl: str = "auto"
    sliding_attention_impl: str = "auto"
    moe_impl: str = "auto"
    msa_impl: str = "auto"

    def __post_init__(self):
        # Normalise list-like fields to tuples so the config stays hashable (jit static arg).
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full",) * self.num_layers)
        if not self.mlp_types:
            object.__setattr__(self, "mlp_types", ("moe",) * self.num_layers)
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "mlp_types", tuple(self.mlp_types))
        if self.index_num_heads == 0 and "msa" in self.layer_types:
            object.__setattr__(self, "index_num_heads", self.num_kv_heads)
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first inconsistent field."""
        positive = ["vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                    "max_position_embeddings"]
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})")
        if not (0 <= self.rotary_dim <= self.head_dim) or self.rotary_dim % 2:
            raise ConfigError(
                f"rotary_dim must be even and in [0, head_dim={self.head_dim}], got {self.rotary_dim}")
        if self.rope_theta <= 0:
            raise ConfigError(f"rope_theta must be > 0, got {self.rope_theta}")
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        for name, allowed in (("norm_kind", NORM_KINDS), ("qk_norm", QK_NORMS),
                              ("mlp_activation", ACTIVATIONS), ("dtype", DTYPES), ("param_dtype", DTYPES)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name, op in IMPLEMENTATION_FIELDS.items():
            value = getattr(self, name)
            if value == "auto":             # every op takes it: no need to import the registry (and jax)
                continue
            allowed = _registry().implementation_names(op)
            if value not in allowed:
                hint = f" ({value!r} was renamed to {RENAMED[op][value]})" if value in RENAMED.get(op, {}) else ""
                raise ConfigError(f"{name} must be one of {allowed}, got {value!r}{hint}")
        for name, allowed in (("layer_types", LAYER_TYPES), ("mlp_types", MLP_TYPES)):
            seq = getattr(self, name)
            if len(seq) != self.num_layers:
                raise ConfigError(f"{name} has {len(seq)} entries but num_layers is {self.num_layers}")
            bad = sorted({t for t in seq if t not in allowed})
            if bad:
                raise ConfigError(f"{name} has unknown entries {bad}; allowed: {allowed}")
        if "sliding" in self.layer_types and not (self.sliding_window and self.sliding_window > 0):
            raise ConfigError("sliding_window must be a positive integer when layer_types has 'sliding'")
        if "moe" in self.mlp_types:
            if self.num_experts <= 0 or self.moe_intermediate_size <= 0:
                raise ConfigError("num_experts and moe_intermediate_size must be > 0 for 'moe' layers")
            if not (1 <= self.num_experts_per_tok <= self.num_experts):
                raise ConfigError(
                    f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                    f"got {self.num_experts_per_tok}")
        if "dense" in self.mlp_types and self.dense_intermediate_size <= 0:
            raise ConfigError("dense_intermediate_size must be > 0 when mlp_types has 'dense'")
        if self.shared_intermediate_size < 0:
            raise ConfigError("shared_intermediate_size must be >= 0")
        if "msa" in self.layer_types:
            if self.index_num_heads != self.num_kv_heads:
                raise ConfigError(
                    f"index_num_heads ({self.index_num_heads}) must equal num_kv_heads ({self.num_kv_heads}): "
                    "MSA uses one index-query head per kv group")
            if self.index_head_dim <= 0 or self.index_head_dim % 2:
                raise ConfigError(f"index_head_dim must be a positive even integer, got {self.index_head_dim}")
            if self.index_rope and self.rotary_dim > self.index_head_dim:
                raise ConfigError(
                    f"rotary_dim ({self.rotary_dim}) > index_head_dim ({self.index_head_dim}) with index_rope")
            if self.index_block_size <= 0:
                raise ConfigError(f"index_block_size must be > 0, got {self.index_block_size}")
            if self.index_local_blocks < 1:
                raise ConfigError(f"index_local_blocks must be >= 1, got {self.index_local_blocks}")
            if self.index_init_blocks < 0:
                raise ConfigError(f"index_init_blocks must be >= 0, got {self.index_init_blocks}")
            if self.index_topk < self.index_local_blocks + self.index_init_blocks:
                raise ConfigError(
                    f"index_topk ({self.index_topk}) must be >= index_local_blocks + index_init_blocks "
                    f"({self.index_local_blocks + self.index_init_blocks})")
        v = self.num_mtp_modules
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ConfigError(f"num_mtp_modules must be an integer >= 0, got {v!r}")
        w = self.mtp_attention_window
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            raise ConfigError(f"mtp_attention_window must be null or an integer >= 1, got {w!r}")

    # ------------------------------------------------------------------ derived
    @property
    def group_size(self) -> int:
        """Query heads per kv head (GQA group size)."""
        return self.num_heads // self.num_kv_heads

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def has_msa(self) -> bool:
        return "msa" in self.layer_types

    @property
    def num_moe_layers(self) -> int:
        return sum(t == "moe" for t in self.mlp_types)

    def replace(self, **changes: Any) -> "ModelConfig":
        """Return a copy with fields changed (validated)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layer_types"] = list(self.layer_types)
        d["mlp_types"] = list(self.mlp_types)
        return d

    def with_msa(self, layers: list[int] | str = "all_full", **index_fields: Any) -> "ModelConfig":
        """Turn MSA on for chosen layers of any config ("MSA on M2").

        Args:
          layers: list of layer indices, or ``"all_full"`` for every layer that is "full" now.
          **index_fields: optional ``index_*`` overrides (block size, top-k, head dim...).
        Returns: a new config; its index weights must be initialised by the caller
          (``minimax_jax.model.params.add_index_params``).
        """
        if layers == "all_full":
            layers = [i for i, t in enumerate(self.layer_types) if t == "full"]
        lt = list(self.layer_types)
        for i in layers:
            if not 0 <= i < self.num_layers:
                raise ConfigError(f"with_msa: layer {i} out of range [0, {self.num_layers})")
            lt[i] = "msa"
        return self.replace(layer_types=tuple(lt), index_num_heads=self.num_kv_heads, **index_fields)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        """Build from our own field names; unknown keys raise ``ConfigError`` listing them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"unknown config field(s) {unknown}; valid fields: {sorted(names)}")
        kw = dict(d)
        for k in ("layer_types", "mlp_types"):
            if k in kw and kw[k] is not None:
                kw[k] = _expand_layer_list(kw[k], kw.get("num_layers", cls.num_layers), k)
        try:
            return cls(**kw)
        except TypeError as e:  # pragma: no cover - defensive
            raise ConfigError(str(e)) from e

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> "ModelConfig":
        """Load our YAML format (a mapping of ModelConfig fields, optionally under ``model:``)."""
        try:
            with open(path) as f:
                d = yaml.safe_load(f)
        except yaml.YAMLError as e:            # one line naming the file and the place, not a traceback
            mark = getattr(e, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            raise ConfigError(f"{path}: not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not a UTF-8 text file ({e.reason} at byte {e.start})") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{path}: expected a mapping of config fields")
        if "model" in d and isinstance(d["model"], dict):
            d = d["model"]
        return cls.from_dict(d)

    @classmethod
    def from_hf_config(cls, src: str | os.PathLike | Mapping[str, Any], **overrides: Any) -> "ModelConfig":
        """Load a Hugging Face ``config.json`` (M2 hub style, HF-native style, or M3 / M3-VL text).

        Args:
          src: a dict, a path to ``config.json``, or a checkpoint directory holding it.
          **overrides: our field names to override (e.g. dtype).
        Raises: ConfigError (naming the file or field) for a file that is not a JSON object, unsupported model
          types, missing fields, or a field of the wrong type (an integer field given a string or a
          non-integral number).
        """
        if not isinstance(src, Mapping):
            p = os.fspath(src)
            if os.path.isdir(p):
                p = os.path.join(p, "config.json")
            if not os.path.exists(p):
                ours = os.path.isfile(os.path.join(os.path.dirname(p), "config.yaml"))
                hint = (" (this folder holds a minimax-jax checkpoint, config.yaml: to write safetensors from it, "
                        "add --export)") if ours else ""
                raise ConfigError(f"config.json not found at {p}{hint}")
            try:
                with open(p, encoding="utf-8") as f:
                    src = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{p}: not valid JSON (line {e.lineno}, column {e.colno}): {e.msg}") from None
            except UnicodeDecodeError as e:
                raise ConfigError(f"{p}: not a UTF-8 text file ({e.reason} at byte {e.start})") from None
            if not isinstance(src, Mapping):
                raise ConfigError(f"{p}: expected a JSON object of config fields, got {type(src).__name__}")
        hf = dict(src)
        if "text_config" in hf:  # M3-VL wrapper: use the text tower
            hf = dict(hf["text_config"])
        mt = hf.get("model_type", "")
        if mt not in ("minimax_m2", "minimax_m3_vl_text", "minimax_m3", "minimax_m3_vl", ""):
            raise ConfigError(f"unsupported model_type {mt!r}")
        is_m3 = mt.startswith("minimax_m3") or "index_topk_blocks" in hf or "mlp_layer_types" in hf
        num_layers = _int(_need(hf, "num_hidden_layers"), "num_hidden_layers")
        hidden, heads = _int(_need(hf, "hidden_size"), "hidden_size"), _int(_need(hf, "num_attention_heads"),
                                                                           "num_attention_heads")
        if heads <= 0:
            raise ConfigError(f"HF config field 'num_attention_heads' must be positive, got {heads}")
        head_dim = _int(hf["head_dim"], "head_dim") if hf.get("head_dim") else hidden // heads
        rope = hf.get("rope_parameters") or {}
        rotary_dim = hf.get("rotary_dim")
        if rotary_dim is None:
            factor = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
            rotary_dim = int(round(head_dim * _float(factor, "partial_rotary_factor")))
        theta = rope.get("rope_theta", hf.get("rope_theta", 5_000_000.0))
        if rope.get("rope_type", "default") not in ("default", None):
            raise ConfigError(f"unsupported rope_type {rope.get('rope_type')!r}")
        layer_types = hf.get("layer_types") or ["full_attention"] * num_layers
        lt_map = {"full_attention": "full", "minimax_m3_sparse": "msa", "sliding_attention": "sliding",
                  "full": "full", "msa": "msa", "sliding": "sliding"}
        try:
            layer_types = tuple(lt_map[t] for t in layer_types)
        except KeyError as e:
            raise ConfigError(f"layer_types has unknown entry {e.args[0]!r}") from None
        mlp_types = hf.get("mlp_layer_types") or ["sparse"] * num_layers
        mlp_map = {"sparse": "moe", "dense": "dense", "moe": "moe"}
        try:
            mlp_types = tuple(mlp_map[t] for t in mlp_types)
        except KeyError as e:
            raise ConfigError(f"mlp_layer_types has unknown entry {e.args[0]!r}") from None
        eos = hf.get("eos_token_id")
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
        mtp = 0
        if is_m3:
            mtp = _int(hf.get("num_mtp_modules", hf.get("num_nextn_predict_layers", 0)) or 0, "num_mtp_modules")
        kw: dict[str, Any] = dict(
            vocab_size=_int(_need(hf, "vocab_size"), "vocab_size"),
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=_int(hf.get("num_key_value_heads") or heads, "num_key_value_heads"),
            head_dim=head_dim,
            rotary_dim=_int(rotary_dim, "rotary_dim"),
            rope_theta=_float(theta, "rope_theta"),
            max_position_embeddings=_int(hf.get("max_position_embeddings", 196_608), "max_position_embeddings"),
            rms_norm_eps=_float(hf.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
            norm_kind="gemma" if is_m3 else "rms",
            qk_norm="per_head" if is_m3 else "full",
            layer_types=layer_types,
            mlp_types=mlp_types,
            sliding_window=hf.get("sliding_window"),
            mlp_activation="swigluoai" if is_m3 else "silu",
            swiglu_alpha=_float(hf.get("swiglu_alpha", 1.702), "swiglu_alpha"),
            swiglu_limit=_float(hf.get("swiglu_limit", 7.0), "swiglu_limit"),
            dense_intermediate_size=_int(hf.get("dense_intermediate_size", 0) or 0, "dense_intermediate_size"),
            num_experts=_int(hf.get("num_local_experts", hf.get("num_experts", 0)) or 0, "num_local_experts"),
            num_experts_per_tok=_int(hf.get("num_experts_per_tok", 1), "num_experts_per_tok"),
            moe_intermediate_size=_int(hf.get("intermediate_size", 0), "intermediate_size"),
            shared_intermediate_size=_int(hf.get("shared_intermediate_size", 0) or 0,
                                          "shared_intermediate_size") if is_m3 else 0,
            routed_scaling_factor=_float(hf.get("routed_scaling_factor", 1.0), "routed_scaling_factor"),
            index_num_heads=_int(hf.get("index_n_heads", 0), "index_n_heads") if "msa" in layer_types else 0,
            index_head_dim=_int(hf.get("index_head_dim", 128), "index_head_dim"),
            index_block_size=_int(hf.get("index_block_size", 128), "index_block_size"),
            index_topk=_int(hf.get("index_topk_blocks", 16), "index_topk_blocks"),
            index_local_blocks=_int(hf.get("index_local_blocks", 1), "index_local_blocks"),
            index_rope=True,
            num_mtp_modules=mtp,
            mtp_attention_window=hf.get("mtp_attention_window") if is_m3 else None,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos,
            pad_token_id=hf.get("pad_token_id"),
            initializer_range=_float(hf.get("initializer_range", 0.02), "initializer_range"),
        )
        if not kw["sliding_window"]:
            kw["sliding_window"] = None
        kw.update(overrides)
        return cls.from_dict(kw)

    def to_hf_config(self) -> dict[str, Any]:
        """Export as a Hugging Face config dict (M2 ``minimax_m2`` or M3 ``minimax_m3_vl_text``)."""
        is_m3 = self.norm_kind == "gemma"
        d: dict[str, Any] = dict(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim, max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps, num_local_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok, intermediate_size=self.moe_intermediate_size,
            tie_word_embeddings=self.tie_word_embeddings, bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id,
            initializer_range=self.initializer_range, rotary_dim=self.rotary_dim,
            rope_theta=self.rope_theta,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta,
                             "partial_rotary_factor": self.rotary_dim / self.head_dim},
        )
        if is_m3:
            inv = {"full": "full_attention", "msa": "minimax_m3_sparse", "sliding": "sliding_attention"}
            d.update(
                model_type="minimax_m3_vl_text", architectures=["MiniMaxM3VLForCausalLM"],
                layer_types=[inv[t] for t in self.layer_types],
                mlp_layer_types=["sparse" if t == "moe" else "dense" for t in self.mlp_types],
                dense_intermediate_size=self.dense_intermediate_size,
                shared_intermediate_size=self.shared_intermediate_size,
                routed_scaling_factor=self.routed_scaling_factor, swiglu_alpha=self.swiglu_alpha,
                swiglu_limit=self.swiglu_limit, index_n_heads=self.index_num_heads or self.num_kv_heads,
                index_head_dim=self.index_head_dim, index_block_size=self.index_block_size,
                index_topk_blocks=self.index_topk, index_local_blocks=self.index_local_blocks,
                num_mtp_modules=self.num_mtp_modules,
            )
            if self.mtp_attention_window is not None:       # ours (not a published field): kept on export
                d["mtp_attention_window"] = self.mtp_attention_window
        else:
            d.update(model_type="minimax_m2", architectures=["MiniMaxM2ForCausalLM"])
        return d

    # ------------------------------------------------------------------ counting
    def param_counts(self) -> dict[str, int]:
        """Parameter counts: ``total`` (everything, MTP included), ``active`` per token (embedding and
        lm_head included, MTP excluded), ``active_non_embedding`` (the figure model cards quote),
        ``mtp`` and ``embedding``."""
        H, V = self.hidden_size, self.vocab_size
        attn = H * self.q_dim + 2 * H * self.kv_dim + self.q_dim * H
        if self.qk_norm == "full":
            attn += self.q_dim + self.kv_dim
        elif self.qk_norm == "per_head":
            attn += 2 * self.head_dim
        idx = H * self.index_num_heads * self.index_head_dim + H * self.index_head_dim + 2 * self.index_head_dim
        expert = 3 * H * self.moe_intermediate_size
        shared = 3 * H * self.shared_intermediate_size
        dense = 3 * H * self.dense_intermediate_size
        total = active = 0
        for lt, mt in zip(self.layer_types, self.mlp_types):
            layer = attn + 2 * H + (idx if lt == "msa" else 0)
            if mt == "moe":
                router = H * self.num_experts + self.num_experts
                total += layer + router + self.num_experts * expert + shared
                active += layer + router + self.num_experts_per_tok * expert + shared
            else:
                total += layer + dense
                active += layer + dense
        emb = V * H + H + (0 if self.tie_word_embeddings else V * H)
        mtp_layer = attn + 2 * H + (idx if self.layer_types[-1] == "msa" else 0)
        if self.mlp_types[-1] == "moe":
            mtp_layer += H * self.num_experts + self.num_experts + self.num_experts * expert + shared
        else:
            mtp_layer += dense
        mtp = self.num_mtp_modules * (mtp_layer + 2 * H * H + 3 * H)
        return {"total": total + emb + mtp, "active": active + emb, "active_non_embedding": active,
                "mtp": mtp, "embedding": emb}


def _need(d: Mapping[str, Any], key: str) -> Any:
    if key not in d or d[key] is None:
        raise ConfigError(f"HF config is missing required field {key!r}")
    return d[key]


def _int(value: Any, key: str) -> int:
    """HF config field ``key`` as an int: an integer or an integral float (128.0); anything else is refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (isinstance(value, float) and not value.is_integer()):
        raise ConfigError(f"HF config field {key!r} must be an integer, got {value!r}")
    return int(value)


def _float(value: Any, key: str) -> float:
    """HF config field ``key`` as a float (a JSON number; not a string or a boolean)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"HF config field {key!r} must be a number, got {value!r}")
    return float(value)


def _expand_layer_list(value: Any, num_layers: int, name: str) -> tuple[str, ...]:
    """Accept an explicit list, or a compact spec ``{"first": {"dense": 3}, "rest": "moe"}``-like dict.

    Compact form: ``{"pattern": ["full", "msa"], "prefix": ["full", "full"]}`` repeats ``pattern``
    after ``prefix`` until ``num_layers`` entries exist.
    """
    if isinstance(value, str):
        return (value,) * num_layers
    if isinstance(value, Mapping):
        prefix = list(value.get("prefix", []))
        pattern = list(value.get("pattern", []))
        if not pattern:
            raise ConfigError(f"{name}: compact form needs a non-empty 'pattern'")
        out = prefix[:]
        while len(out) < num_layers:
            out.append(pattern[(len(out) - len(prefix)) % len(pattern)])
        return tuple(out[:num_layers])
    return tuple(value)


def load_config(path_or_name: str | os.PathLike) -> ModelConfig:
    """Load a config from a YAML path, an HF ``config.json``/checkpoint dir, or a name in ``configs/``."""
    p = os.fspath(path_or_name)
    if os.path.isdir(p) or p.endswith(".json"):
        return ModelConfig.from_hf_config(p)
    if os.path.exists(p):
        return ModelConfig.from_yaml(p)
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
    for cand in (os.path.join(here, p), os.path.join(here, p + ".yaml")):
        if os.path.exists(cand):
            return ModelConfig.from_yaml(cand)
    raise ConfigError(f"no config file or known config name {p!r} (looked in {here})")


def dtype_of(name: str):
    """Map a dtype name to a jnp dtype."""
    import jax.numpy as jnp

    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[name]

