"""Training configuration: YAML sections, ``--set`` overrides and validation before compiling.

A training YAML (``configs/train/*.yaml``) has these sections; every key is listed in the section
dataclasses below (defaults in code)::

    model:      name: tiny-m2 | path/to/config.yaml | HF dir   (plus any ModelConfig field to override)
    data:       kind: grain | synthetic | trajectory  (plus the fields of that kind; see DataSection)
    optim:      AdamW, clipping, accumulation, loss weights, freezing        (OptimConfig)
    schedule:   warmup + cosine | wsd | constant                              (ScheduleConfig)
    checkpoint: orbax CheckpointManager cadence / retention                   (CheckpointConfig)
    run:        run_dir, steps, logging, precision, remat, seed             (RunConfig)
    mesh:       "data=1" style MeshSpec string (minimax_jax.sharding)
    msa:        indexer warm-up steps, KL coefficient                       (MSAConfig)
    init:       scratch | checkpoint | sparse_cpt                           (InitConfig)

``load_train_config(path, overrides)`` reads the YAML, applies ``section.key=value`` overrides (values
parsed as YAML scalars/lists), rejects unknown sections/keys naming the valid ones, and validates
every field it can without touching devices. ``validate_against(tc, model_cfg, num_devices)``
checks what needs the model and the device count (sequence length vs max positions, mesh size,
batch divisibility) and is called before anything is compiled.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any, Mapping, Sequence

import yaml

__all__ = ["TrainConfigError", "TrainConfig", "OptimConfig", "ScheduleConfig", "CheckpointConfig", "RunConfig",
           "MSAConfig", "InitConfig", "DataSection", "load_train_config", "apply_overrides", "validate_against",
           "valid_keys"]

SCHEDULES = ("cosine", "wsd", "constant")
INIT_MODES = ("scratch", "checkpoint", "sparse_cpt")
REMAT = ("none", "full", "dots", "dots_kernels")
DATA_KINDS = ("grain", "synthetic", "trajectory")
DTYPES = ("float32", "bfloat16", "float16")
SEED_MAX = 2 ** 32 - 1          # the largest seed: the RNGs take 32-bit unsigned seeds


class TrainConfigError(ValueError):
    """A training configuration is invalid; the message names the field and the valid choices."""


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW + clipping + accumulation + loss terms.

    Attributes:
      lr: peak learning rate (> 0).
      b1, b2, eps: Adam moments / epsilon.
      weight_decay: decoupled decay; never applied to norms, biases, the router or its bias, or
        any 1-D leaf (see ``minimax_jax.train.optimizer.decay_mask``).
      clip_norm: global-norm clipping threshold (0 = off).
      grad_accum: micro-batches per step (the data batch is split into this many micro-batches).
      z_loss: coefficient of ``mean(logsumexp(logits)^2)`` (0 = off).
      mtp_weights: per-depth MTP loss weights; one number (same for every depth) or a list with
        one entry per MTP module. Ignored when the model has no MTP modules.
      mtp_targets: ``data`` (the MTP modules learn the data's future tokens) or ``self`` (they learn the
        main model's own greedy tokens at those positions: self-distillation for speculative decoding,
        whose drafts are accepted when they match the main model's greedy choice).
      router_bias_rate: aux-loss-free balancing step: ``bias += rate * sign(mean_load - load)``.
      aux_loss: coefficient of an optional MoE balance loss; needs the forward to report
        ``aux["moe_aux_loss"]`` (e.g. ``minimax_jax.ops.moe.load_balancing_loss`` summed over layers).
      freeze: regexes over '/'-joined param paths (e.g. ``segments/0/attn/.*``); matching leaves
        are not trained, and a matching ``router_bias`` is not moved by the balancing rule either (the
        optimizer never trains router biases).
      mu_dtype: dtype of Adam's first moment (``optax.adamw(mu_dtype=)``): null = the parameters'
        dtype, or ``bfloat16`` to halve its memory and traffic (the second moment stays float32: its
        small values underflow in bf16). On the 1.9B-parameter bench model the optimizer update is
        ~9 ms of a 156 ms step (BENCHMARKS.md, training step run 12).
    """

    lr: float = 3e-4
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    grad_accum: int = 1
    z_loss: float = 0.0
    mtp_weights: Any = 0.3
    mtp_targets: str = "data"
    router_bias_rate: float = 1e-3
    aux_loss: float = 0.0
    freeze: tuple[str, ...] = ()
    mu_dtype: str | None = None


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
    """Learning-rate schedule (optax).

    Attributes:
      kind: ``cosine`` (linear warm-up then cosine to ``min_lr_ratio * lr``), ``wsd`` (warm-up,
        stable, then linear decay over the last ``decay_fraction`` of the steps) or ``constant``.
      warmup_steps: linear warm-up length from 0.
      decay_steps: steps of the cosine decay (None = ``run.steps - warmup``).
      min_lr_ratio: final lr as a fraction of ``optim.lr``.
      decay_fraction: WSD only; fraction of the total steps spent decaying.
    """

    kind: str = "cosine"
    warmup_steps: int = 100
    decay_steps: int | None = None
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """orbax ``CheckpointManager`` settings.

    Attributes:
      every: save every N steps (0 = only the final / SIGTERM save).
      keep: number of most recent checkpoints kept.
      async_save: write checkpoints in the background (orbax async checkpointing).
      resume: resume from the newest readable checkpoint of ``run.run_dir`` when there is one.
      save_on_sigterm: on SIGTERM, finish the current step, save, and exit cleanly.
    """

    every: int = 1000
    keep: int = 3
    async_save: bool = True
    resume: bool = True
    save_on_sigterm: bool = True


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Loop, logging, precision and memory settings.

    Attributes:
      run_dir: output directory (checkpoints/, tensorboard/, metrics.jsonl, config.yaml).
      steps: total optimizer steps, spanned by the learning-rate schedule; a resume with another value must keep the
        learning rates of the steps already trained, else it is refused (how to extend a run: README, "Train").
      seed: RNG seed (params init and the step RNG), an integer in [0, 2^32 - 1].
      log_every: log metrics every N steps (console, TensorBoard, metrics.jsonl).
      eval_every: evaluate held-out loss every N steps (0 = never); needs ``eval_sources``.
      eval_batches: batches per evaluation.
      eval_sources: held-out data paths (same tokenizer/seq_len/batch_size as ``data``).
      compute_dtype: activations / matmul dtype (overrides the model's ``dtype``).
      param_dtype: master parameter dtype (overrides ``param_dtype``; float32 = fp32 master weights).
      remat: ``none`` | ``full`` | ``dots`` | ``dots_kernels`` (forward's ``remat=``).
      logits_chunk: tokens per slice of the lm head + cross-entropy (training and eval loss); 0 =
        materialise the whole ``[B, T, V]`` float32 logits. Long rows with a large vocabulary need it
        (M3's 200K vocabulary at 64K tokens: 52 GB of logits per row); costs one more lm-head matmul.
      progress: show a tqdm progress bar (loss, tokens/s, ETA).
      tensorboard: write TensorBoard scalars under ``run_dir/tensorboard``.
      peak_tflops: per-device peak for MFU (None = guess from the device kind; 0 = do not report).
      recall_every: every N steps log ``indexer_recall``: the share of dense attention's top blocks
        the MSA indexer selects (``minimax_jax.eval.recall``) on the first row of the batch; MSA
        models, single-process runs only (0 = off; it runs eagerly: keep it rare).
      stop_after: stop (with a checkpoint) after this many steps of THIS process (tests/debugging; 0 = off).
    """

    run_dir: str = "runs/default"
    steps: int = 1000
    seed: int = 0
    log_every: int = 10
    eval_every: int = 0
    eval_batches: int = 4
    eval_sources: tuple[str, ...] = ()
    compute_dtype: str | None = None
    param_dtype: str | None = None
    remat: str = "none"
    logits_chunk: int = 0
    progress: bool = True
    tensorboard: bool = True
    peak_tflops: float | None = None
    recall_every: int = 0
    stop_after: int = 0


@dataclasses.dataclass(frozen=True)
class MSAConfig:
    """MSA indexer training (MSA_SPEC.md section 4).

    Attributes:
      indexer_warmup_steps: first N steps use dense attention and the dense KL (whole causal history).
      kl_coeff: weight of the indexer KL (normalised by ``aux["indexer_kl_count"]``).
      freeze_backbone_in_warmup: during the warm-up only the index projections/norms are trained.
      warmup_lr: lr of the warm-up phase (None = ``optim.lr``); the main schedule starts after it.
      warmup_schedule: after the ramp ``constant`` (warmup_lr) or ``cosine`` (to min_lr_ratio of it at its end).
      layers: ``sparse_cpt`` only: layers turned into MSA (``all_full`` or a list of indices).
      index: ``sparse_cpt`` only: ``index_*`` ModelConfig overrides for ``with_msa`` (e.g. block size).
    """

    indexer_warmup_steps: int = 0
    kl_coeff: float = 1.0
    freeze_backbone_in_warmup: bool = True
    warmup_lr: float | None = None
    warmup_schedule: str = "constant"
    layers: Any = "all_full"
    index: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class InitConfig:
    """Where the parameters come from.

    Attributes:
      mode: ``scratch`` (random init of ``model``), ``checkpoint`` (a converted checkpoint dir read by
        ``minimax_jax.convert.load_checkpoint``) or ``sparse_cpt`` (a dense checkpoint turned into MSA
        with ``cfg.with_msa`` + ``add_index_params``, then indexer warm-up, then sparse training).
      path: checkpoint directory for ``checkpoint`` / ``sparse_cpt``.
    """

    mode: str = "scratch"
    path: str | None = None


@dataclasses.dataclass(frozen=True)
class DataSection:
    """The ``data`` section: ``kind`` plus the pipeline's fields.

    ``kind: grain`` passes every other key to ``minimax_jax.data.pipeline.DataConfig`` (sources,
    tokenizer, seq_len, batch_size, ...). ``kind: synthetic`` needs only ``seq_len``, ``batch_size``,
    ``seed`` (uniform random tokens in packed rows of random-length documents; no grain, no
    tokenizer; for benchmarks and smoke tests). ``kind: trajectory`` passes the other keys to
    ``minimax_jax.data.trajectories.TrajectoryConfig`` (agent trajectories merged into prefix trees).

    Attributes:
      kind: ``grain`` (text files through a tokenizer), ``synthetic`` (random tokens; nothing learnable) or
        ``trajectory`` (JSONL conversations / token ids, prefix-tree merged).
      fields: the section's other keys.

    Synthetic keys:
      seq_len: tokens per training row.
      batch_size: GLOBAL batch size (rows).
      seed: data seed, an integer in [0, 2^32 - 1] (evaluation batches use ``seed + 1000003``).
      mean_doc_len: mean length of the random documents packed into a row (0 = ``seq_len // 2``).
    """

    kind: str = "grain"
    fields: dict = dataclasses.field(default_factory=dict)

    SYNTHETIC_KEYS = ("seq_len", "batch_size", "seed", "mean_doc_len")

    @property
    def seq_len(self) -> int:
        return int(self.fields.get("seq_len", 0))

    @property
    def batch_size(self) -> int:
        return int(self.fields.get("batch_size", 0))


SECTIONS = {"optim": OptimConfig, "schedule": ScheduleConfig, "checkpoint": CheckpointConfig, "run": RunConfig,
            "msa": MSAConfig, "init": InitConfig}
TOP_LEVEL = ("model", "data", "mesh") + tuple(SECTIONS)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The whole training configuration (see module docstring).

    Attributes:
      model: a config name in ``configs/`` (e.g. ``tiny-m3``), a YAML path or an HF checkpoint dir; or a
        mapping of ``name`` (the same; null = the ModelConfig defaults) plus ModelConfig fields overriding it.
      data: where the tokens come from (``kind`` plus its keys).
      mesh: device mesh as a MeshSpec string over the axes data, fsdp, expert, sequence, tensor
        (e.g. ``fsdp=2,tensor=4``; one axis may be -1 = the remaining devices).
      optim, schedule, checkpoint, run, msa, init: the sections of the same names.
      source_path: the YAML file read (set by ``load_train_config``).
    """

    model: dict
    data: DataSection
    mesh: str = "data=-1"
    optim: OptimConfig = OptimConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    run: RunConfig = RunConfig()
    msa: MSAConfig = MSAConfig()
    init: InitConfig = InitConfig()
    source_path: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain dict in the YAML layout (written to ``run_dir/config.yaml``)."""
        d: dict[str, Any] = {"model": dict(self.model), "data": {"kind": self.data.kind, **self.data.fields},
                             "mesh": self.mesh}
        for name in SECTIONS:
            sec = dataclasses.asdict(getattr(self, name))
            d[name] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in sec.items()}
        return d


# ----------------------------------------------------------------------------- keys
def _model_keys() -> list[str]:
    from minimax_jax.config import ModelConfig

    return ["name"] + sorted(f.name for f in dataclasses.fields(ModelConfig))


def _data_keys(kind: str) -> list[str]:
    if kind == "synthetic":
        return ["kind", *DataSection.SYNTHETIC_KEYS]
    if kind == "trajectory":
        from minimax_jax.data.trajectories import TrajectoryConfig

        return ["kind"] + sorted(f.name for f in dataclasses.fields(TrajectoryConfig))
    try:
        from minimax_jax.data.pipeline import DataConfig
    except ImportError as e:  # grain missing (e.g. the GPU image): only synthetic data works
        raise TrainConfigError(f"data.kind=grain needs the grain package ({e}); install grain or use "
                               "data.kind=synthetic") from None
    return ["kind"] + sorted(f.name for f in dataclasses.fields(DataConfig))


def valid_keys(section: str, data_kind: str = "grain") -> list[str]:
    """Valid keys of a section (``model`` and ``data`` included)."""
    if section == "model":
        return _model_keys()
    if section == "data":
        return _data_keys(data_kind)
    if section == "mesh":
        return []
    if section not in SECTIONS:
        raise TrainConfigError(f"unknown section {section!r}; valid sections: {list(TOP_LEVEL)}")
    return [f.name for f in dataclasses.fields(SECTIONS[section])]


# ----------------------------------------------------------------------------- YAML
class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-3`` (no dot) as a float, as people write learning rates."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"""),
    list("-+0123456789"))


def _yaml_load(text_or_file) -> Any:
    return yaml.load(text_or_file, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def _yaml_problem(e: Exception) -> str:
    """One line for a YAML parse error: the problem and where (1-based line / column)."""
    mark = getattr(e, "problem_mark", None)
    what = getattr(e, "problem", None) or str(e).splitlines()[0]
    return f"{what} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else what


# ----------------------------------------------------------------------------- overrides
def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` (or ``mesh=...``) overrides to a raw YAML dict (a new dict).

    Raises TrainConfigError for malformed items, unknown sections or keys (listing the valid ones).
    """
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    for item in overrides:
        if "=" not in item:
            raise TrainConfigError(f"override {item!r} is not section.key=value")
        path, _, text = item.partition("=")
        path = path.strip()
        try:
            value = _yaml_load(text)
        except yaml.YAMLError as e:        # one line: the problem and where, not PyYAML's multi-line report
            raise TrainConfigError(f"override {item!r}: cannot parse {text!r} as YAML ({_yaml_problem(e)})") from None
        if path == "mesh":
            out["mesh"] = str(value)
            continue
        if "." not in path:
            raise TrainConfigError(f"override {item!r}: expected section.key=value with a section in "
                                   f"{list(TOP_LEVEL)}")
        section, _, key = path.partition(".")
        if section not in TOP_LEVEL or section == "mesh":
            raise TrainConfigError(f"override {item!r}: unknown section {section!r}; valid sections: "
                                   f"{list(TOP_LEVEL)}")
        sec = out.get(section)
        if sec is None or isinstance(sec, str):
            sec = {"name": sec} if (section == "model" and isinstance(sec, str)) else {}
        data_kind = (value if key == "kind" else sec.get("kind", "grain")) if section == "data" else "grain"
        keys = valid_keys(section, data_kind)
        if key not in keys:
            raise TrainConfigError(f"override {item!r}: unknown key {key!r} in section {section!r}; "
                                   f"valid keys: {keys}")
        sec[key] = value
        out[section] = sec
    return out


# ----------------------------------------------------------------------------- build + validate
def _build_section(name: str, d: Any) -> Any:
    cls = SECTIONS[name]
    if d is None:
        return cls()
    if not isinstance(d, Mapping):
        raise TrainConfigError(f"section {name!r} must be a mapping, got {type(d).__name__}")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(d) - set(names))
    if unknown:
        raise TrainConfigError(f"unknown key(s) {unknown} in section {name!r}; valid keys: {names}")
    kw = dict(d)
    for f in dataclasses.fields(cls):
        if f.name in kw and isinstance(f.default, tuple) and kw[f.name] is not None:
            v = kw[f.name]
            kw[f.name] = (v,) if isinstance(v, str) else tuple(v)
    return cls(**kw)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise TrainConfigError(msg)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate(tc: TrainConfig) -> None:
    """Device- and model-independent checks. Raises TrainConfigError naming the field."""
    o, s, c, r, m, i = tc.optim, tc.schedule, tc.checkpoint, tc.run, tc.msa, tc.init
    _check(_is_num(o.lr) and o.lr > 0, f"optim.lr must be a positive number, got {o.lr!r}")
    for n in ("b1", "b2"):
        v = getattr(o, n)
        _check(_is_num(v) and 0 <= v < 1, f"optim.{n} must be in [0, 1), got {v!r}")
    _check(_is_num(o.eps) and o.eps > 0, f"optim.eps must be > 0, got {o.eps!r}")
    for n in ("weight_decay", "clip_norm", "z_loss", "router_bias_rate", "aux_loss"):
        v = getattr(o, n)
        _check(_is_num(v) and v >= 0, f"optim.{n} must be a number >= 0, got {v!r}")
    _check(_is_int(o.grad_accum) and o.grad_accum >= 1, f"optim.grad_accum must be an int >= 1, got {o.grad_accum!r}")
    _check(o.mu_dtype in (None, "float32", "bfloat16"),
           f"optim.mu_dtype must be null, float32 or bfloat16, got {o.mu_dtype!r}")
    w = o.mtp_weights
    ws = [w] if not isinstance(w, (list, tuple)) else list(w)
    _check(all(_is_num(x) and x >= 0 for x in ws), f"optim.mtp_weights must be numbers >= 0, got {w!r}")
    _check(o.mtp_targets in ("data", "self"), f"optim.mtp_targets must be data or self, got {o.mtp_targets!r}")
    for pat in o.freeze:
        try:
            re.compile(pat)
        except re.error as e:
            raise TrainConfigError(f"optim.freeze pattern {pat!r} is not a valid regex: {e}") from None
    _check(s.kind in SCHEDULES, f"schedule.kind must be one of {SCHEDULES}, got {s.kind!r}")
    _check(_is_int(s.warmup_steps) and s.warmup_steps >= 0, f"schedule.warmup_steps must be an int >= 0, got {s.warmup_steps!r}")
    _check(s.decay_steps is None or (_is_int(s.decay_steps) and s.decay_steps > 0),
           f"schedule.decay_steps must be a positive int or null, got {s.decay_steps!r}")
    _check(_is_num(s.min_lr_ratio) and 0 <= s.min_lr_ratio <= 1, "schedule.min_lr_ratio must be in [0, 1]")
    _check(_is_num(s.decay_fraction) and 0 < s.decay_fraction <= 1, "schedule.decay_fraction must be in (0, 1]")
    _check(_is_int(c.every) and c.every >= 0, f"checkpoint.every must be an int >= 0, got {c.every!r}")
    _check(_is_int(c.keep) and c.keep >= 1, f"checkpoint.keep must be an int >= 1, got {c.keep!r}")
    _check(isinstance(r.run_dir, str) and r.run_dir, "run.run_dir must be a non-empty path")
    _check(_is_int(r.steps) and r.steps >= 1, f"run.steps must be an int >= 1, got {r.steps!r}")
    for name, v in (("run.seed", r.seed), ("data.seed", tc.data.fields.get("seed", 0))):
        _check(_is_int(v) and 0 <= v <= SEED_MAX, f"{name} must be an integer in [0, {SEED_MAX}], got {v!r}")
    _check(_is_int(r.log_every) and r.log_every >= 1, "run.log_every must be an int >= 1")
    _check(_is_int(r.eval_every) and r.eval_every >= 0, "run.eval_every must be an int >= 0")
    _check(r.eval_every == 0 or bool(r.eval_sources), "run.eval_every > 0 needs run.eval_sources")
    _check(_is_int(r.eval_batches) and r.eval_batches >= 1, "run.eval_batches must be an int >= 1")
    for n in ("compute_dtype", "param_dtype"):
        v = getattr(r, n)
        _check(v is None or v in DTYPES, f"run.{n} must be one of {DTYPES} or null, got {v!r}")
    _check(r.remat in REMAT, f"run.remat must be one of {REMAT}, got {r.remat!r}")
    _check(_is_int(r.logits_chunk) and r.logits_chunk >= 0,
           f"run.logits_chunk must be an int >= 0 (0 = whole logits), got {r.logits_chunk!r}")
    _check(r.peak_tflops is None or (_is_num(r.peak_tflops) and r.peak_tflops >= 0), "run.peak_tflops must be >= 0")
    _check(_is_int(r.stop_after) and r.stop_after >= 0, "run.stop_after must be an int >= 0")
    _check(_is_int(r.recall_every) and r.recall_every >= 0, "run.recall_every must be an int >= 0")
    _check(_is_int(m.indexer_warmup_steps) and m.indexer_warmup_steps >= 0, "msa.indexer_warmup_steps must be >= 0")
    _check(_is_num(m.kl_coeff) and m.kl_coeff >= 0, f"msa.kl_coeff must be >= 0, got {m.kl_coeff!r}")
    _check(m.warmup_lr is None or (_is_num(m.warmup_lr) and m.warmup_lr > 0), "msa.warmup_lr must be > 0 or null")
    _check(m.warmup_schedule in ("constant", "cosine"), f"msa.warmup_schedule must be constant or cosine: {m.warmup_schedule!r}")
    _check(isinstance(m.index, Mapping) and all(str(k).startswith("index_") for k in m.index),
           f"msa.index must map index_* ModelConfig fields, got {m.index!r}")
    _check(i.mode in INIT_MODES, f"init.mode must be one of {INIT_MODES}, got {i.mode!r}")
    _check(i.mode == "scratch" or bool(i.path), f"init.mode={i.mode} needs init.path (a checkpoint directory)")
    _check(i.mode != "scratch" or not i.path, f"init.path={i.path!r} is set but init.mode is 'scratch' (the path "
           f"would be ignored); set init.mode=checkpoint or sparse_cpt, or drop init.path")
    _check(tc.data.kind in DATA_KINDS, f"data.kind must be one of {DATA_KINDS}, got {tc.data.kind!r}")
    _check(tc.data.seq_len >= 1 and tc.data.batch_size >= 1, "data.seq_len and data.batch_size must be >= 1")
    _check(tc.data.batch_size % o.grad_accum == 0,
           f"data.batch_size ({tc.data.batch_size}) must be divisible by optim.grad_accum ({o.grad_accum})")
    from minimax_jax.sharding import MeshSpec, ShardingError

    try:
        MeshSpec.parse(tc.mesh)
    except ShardingError as e:
        raise TrainConfigError(f"mesh: {e}") from None


def from_dict(raw: Mapping[str, Any], source_path: str | None = None) -> TrainConfig:
    """Build and validate a TrainConfig from a raw YAML mapping."""
    unknown = sorted(set(raw) - set(TOP_LEVEL))
    if unknown:
        raise TrainConfigError(f"unknown section(s) {unknown}; valid sections: {list(TOP_LEVEL)}")
    model = raw.get("model")
    if model is None:
        raise TrainConfigError("section 'model' is required (a config name/path, or a mapping with 'name' "
                               "and/or ModelConfig fields)")
    model = {"name": model} if isinstance(model, str) else dict(model)
    bad = sorted(set(model) - set(_model_keys()))
    if bad:
        raise TrainConfigError(f"unknown key(s) {bad} in section 'model'; valid keys: {_model_keys()}")
    data = dict(raw.get("data") or {})
    kind = data.pop("kind", "grain")
    if kind not in DATA_KINDS:
        raise TrainConfigError(f"data.kind must be one of {DATA_KINDS}, got {kind!r}")
    bad = sorted(set(data) - set(_data_keys(kind)))
    if bad:
        raise TrainConfigError(f"unknown key(s) {bad} in section 'data' (kind={kind}); valid keys: {_data_keys(kind)}")
    if kind == "grain":
        from minimax_jax.data.pipeline import DataConfig, DataConfigError

        required = [f.name for f in dataclasses.fields(DataConfig)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        absent = [k for k in required if k not in data]
        if absent:
            raise TrainConfigError(f"section 'data' (kind=grain) needs {absent} (set them in the YAML or with "
                                   f"--set data.<key>=...; or use data.kind=synthetic)")
        try:
            DataConfig.from_dict(data)
        except (DataConfigError, TypeError) as e:
            raise TrainConfigError(f"data: {e}") from None
    elif kind == "trajectory":
        from minimax_jax.data.trajectories import TrajectoryConfig, TrajectoryError

        try:
            TrajectoryConfig.from_dict(data)
        except (TrajectoryError, TypeError) as e:
            raise TrainConfigError(f"data (kind=trajectory): {e}") from None
    sections = {n: _build_section(n, raw.get(n)) for n in SECTIONS}
    tc = TrainConfig(model=model, data=DataSection(kind, data), mesh=str(raw.get("mesh", "data=-1")),
                     source_path=source_path, **sections)
    validate(tc)
    return tc


def load_train_config(path: str | os.PathLike, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read a training YAML, apply overrides, validate (see module docstring)."""
    p = os.fspath(path)
    if not os.path.exists(p):
        raise TrainConfigError(f"training config {p!r} does not exist")
    if not os.path.isfile(p):
        raise TrainConfigError(f"training config {p!r} is not a file (a directory?); pass a YAML file")
    try:
        with open(p, encoding="utf-8") as f:
            raw = _yaml_load(f)
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise TrainConfigError(f"training config {p!r} is not valid YAML: {_yaml_problem(e)}") from None
    if raw is None:
        raise TrainConfigError(f"training config {p!r} is empty; expected a mapping of sections {list(TOP_LEVEL)}")
    if not isinstance(raw, dict):
        raise TrainConfigError(f"{p}: expected a mapping of sections {list(TOP_LEVEL)}")
    return from_dict(apply_overrides(raw, overrides), source_path=p)


def validate_against(tc: TrainConfig, model_cfg, num_devices: int, num_processes: int = 1,
                     backend: str | None = None):
    """Checks needing the model config and the devices; returns the resolved ``MeshSpec``.

    ``backend``: the JAX backend the run will use (``jax.default_backend()``); when given, a model
    implementation chosen explicitly that cannot run there (``model.attention_impl=cudnn_packed`` on a
    CPU, ...) is refused here, before anything is built.

    Raises TrainConfigError: an implementation for another backend, ``run.run_dir`` an existing file, sequence longer than ``max_position_embeddings``, a mesh that needs more
    devices than exist (or does not divide them), a batch not divisible by the data-parallel size,
    MTP weights of the wrong length, MSA settings on a model without MSA layers.
    """
    from minimax_jax.config import implementation_backends
    from minimax_jax.sharding import MeshSpec, ShardingError

    if backend is not None:
        for choice, backends in implementation_backends(model_cfg).items():
            _check(backend in backends, f"{choice} runs only on {'/'.join(backends)}, but this run's JAX backend is "
                                        f"{backend!r} (use 'auto', or an *_interpret implementation on a CPU)")
    _check(not os.path.exists(tc.run.run_dir) or os.path.isdir(tc.run.run_dir),
           f"run.run_dir {tc.run.run_dir!r} exists and is not a directory")
    L = tc.data.seq_len
    _check(L <= model_cfg.max_position_embeddings,
           f"data.seq_len ({L}) exceeds the model's max_position_embeddings ({model_cfg.max_position_embeddings})")
    spec = MeshSpec.parse(tc.mesh)
    fixed = math.prod(v for v in spec.sizes() if v != -1)
    _check(fixed <= num_devices, f"mesh {tc.mesh!r} needs {fixed} devices but only {num_devices} are available")
    try:
        resolved = spec.resolve(num_devices if (-1 in spec.sizes() or num_processes > 1) else fixed)
    except ShardingError as e:
        raise TrainConfigError(f"mesh {tc.mesh!r}: {e}") from None
    dp = resolved.data * resolved.fsdp * resolved.expert
    micro = tc.data.batch_size // tc.optim.grad_accum
    _check(micro % dp == 0, f"the micro-batch (data.batch_size / optim.grad_accum = {micro}) must be divisible "
                            f"by the data-parallel size data*fsdp*expert = {dp} of mesh {resolved}")
    if resolved.sequence > 1:
        _check(L % resolved.sequence == 0, f"data.seq_len ({L}) must be divisible by mesh sequence={resolved.sequence}")
    w = tc.optim.mtp_weights
    if isinstance(w, (list, tuple)) and model_cfg.num_mtp_modules:
        _check(len(w) == model_cfg.num_mtp_modules,
               f"optim.mtp_weights has {len(w)} entries but the model has {model_cfg.num_mtp_modules} MTP modules")
    if tc.msa.indexer_warmup_steps:
        _check(model_cfg.has_msa, "msa.indexer_warmup_steps > 0 but the model has no 'msa' layers")
    return resolved
