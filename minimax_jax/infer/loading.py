"""Find, check and load a checkpoint and its tokenizer for inference.

Accepted checkpoint directories:

* ours (``python -m minimax_jax.convert`` output): ``config.yaml`` + ``params/`` (orbax);
* a Hugging Face directory: ``config.json`` + ``*.safetensors``; converted on the fly into a
  temporary directory (or ``convert_dir`` when given, kept for the next run) and loaded from there.

Before restoring, every stored parameter leaf is compared with the shapes the config implies and
ALL mismatches are listed in one ``CheckpointMismatch`` (not just the first). The tokenizer is
``tokenizer.json`` in the checkpoint directory unless a path is given.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import tempfile
from typing import Any, Callable

from minimax_jax.config import ModelConfig
from minimax_jax.infer.attention_mode import apply_attention_mode, check_attention_mode, describe_attention_mode
from minimax_jax.infer.errors import CheckpointMismatch, CheckpointNotFound, Fp8WeightsUnavailable, TokenizerNotFound

__all__ = ["DEFAULT_CHECKPOINT", "LoadedModel", "checkpoint_kind", "find_mismatches", "load_model",
           "load_tokenizer_for", "peek_config", "resolve_checkpoint", "check_tokenizer_fits", "check_weights_dtype"]

#: Shipped demo checkpoint directory used when no ``--checkpoint`` is given.
DEFAULT_CHECKPOINT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                  "checkpoints", "demo")
TOKENIZER_FILE = "tokenizer.json"


@dataclasses.dataclass
class LoadedModel:
    """A ready model: ``cfg``, ``params`` tree, ``tokenizer`` (``tokenizers.Tokenizer``), where it came
    from (``checkpoint_dir``, ``source``: "orbax" or "hf (converted to DIR)"), optional ``mesh``/``rules``,
    and the ``attention`` mode it was loaded with (``minimax_jax.infer.attention_mode``;
    ``attention_note`` says what that did to this checkpoint)."""

    cfg: ModelConfig
    params: Any
    tokenizer: Any
    checkpoint_dir: str
    source: str
    mesh: Any = None
    rules: Any = None
    attention: str = "as_trained"
    attention_note: str = ""


def resolve_checkpoint(checkpoint_dir: str | None) -> str:
    """Absolute checkpoint path; None means ``DEFAULT_CHECKPOINT``.

    Raises: CheckpointNotFound when no directory is given and the demo checkpoint is missing.
    """
    if checkpoint_dir is None:
        if not os.path.isdir(DEFAULT_CHECKPOINT):
            raise CheckpointNotFound(
                f"no --checkpoint given and the default demo checkpoint {DEFAULT_CHECKPOINT} is missing; "
                "pass --checkpoint DIR (a converted checkpoint or a Hugging Face directory)")
        checkpoint_dir = DEFAULT_CHECKPOINT
    return os.path.abspath(checkpoint_dir)


def peek_config(checkpoint_dir: str) -> ModelConfig:
    """The config of a checkpoint (ours: config.yaml; HF: config.json) without loading parameters."""
    if checkpoint_kind(checkpoint_dir) == "orbax":
        return ModelConfig.from_yaml(os.path.join(checkpoint_dir, "config.yaml"))
    return ModelConfig.from_hf_config(checkpoint_dir)


def checkpoint_kind(directory: str) -> str:
    """``"orbax"`` (ours) or ``"hf"`` (config.json + safetensors).

    Raises: CheckpointNotFound naming what was looked for.
    """
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise CheckpointNotFound(f"checkpoint {directory!r} is a file; pass the checkpoint directory "
                                 f"(config.yaml + params/, or config.json + *.safetensors)")
    if not os.path.isdir(directory):
        raise CheckpointNotFound(f"checkpoint directory {directory!r} does not exist")
    if os.path.isfile(os.path.join(directory, "config.yaml")) and os.path.isdir(os.path.join(directory, "params")):
        return "orbax"
    if os.path.isfile(os.path.join(directory, "config.json")) and glob.glob(os.path.join(directory, "*.safetensors")):
        return "hf"
    raise CheckpointNotFound(
        f"{directory!r} is not a checkpoint: expected config.yaml + params/ (exported from a training run with "
        "`python -m minimax_jax.train.export --run_dir RUN --dst DIR`, or converted with `python -m minimax_jax.convert`) "
        "or config.json + *.safetensors (Hugging Face)")


def find_mismatches(directory: str, cfg: ModelConfig) -> list[tuple[str, str, str]]:
    """Every leaf whose stored shape differs from ``abstract_params(cfg)`` (FP8 leaves as stored,
    ``minimax_jax.convert.load.stored_abstract``).

    Returns: ``[(leaf path, expected, stored)]`` where expected/stored is a shape or "absent".
    """
    import jax

    from minimax_jax.convert.load import checkpoint_metadata, stored_abstract

    stored = {jax.tree_util.keystr(k): v for k, v in
              jax.tree_util.tree_flatten_with_path(checkpoint_metadata(directory))[0]}
    want = {jax.tree_util.keystr(k): v for k, v in
            jax.tree_util.tree_flatten_with_path(stored_abstract(directory, cfg)[0])[0]}
    out = []
    for k in sorted(set(stored) | set(want)):
        w = list(want[k].shape) if k in want else "absent"
        s = list(stored[k].shape) if k in stored else "absent"
        if w != s:
            out.append((f"params{k}", str(w), str(s)))
    return out


def load_tokenizer_for(checkpoint_dir: str, tokenizer_path: str | None = None):
    """The ``tokenizers.Tokenizer`` of a checkpoint (``checkpoint_dir/tokenizer.json``) or of
    ``tokenizer_path`` (a file or a directory holding ``tokenizer.json``).

    Raises: TokenizerNotFound naming the exact file looked for (also when it is not a valid
      ``tokenizers`` JSON file).
    """
    from tokenizers import Tokenizer

    path = tokenizer_path or checkpoint_dir
    if os.path.isdir(path):
        path = os.path.join(path, TOKENIZER_FILE)
    if not os.path.isfile(path):
        hint = "" if tokenizer_path else " (or pass --tokenizer PATH)"
        raise TokenizerNotFound(f"no tokenizer: looked for {os.path.abspath(path)}{hint}")
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception for malformed JSON
        raise TokenizerNotFound(f"{os.path.abspath(path)} is not a valid tokenizer.json ({e})") from e


def check_tokenizer_fits(tokenizer, cfg: ModelConfig, where: str) -> None:
    """Raise TokenizerNotFound when the tokenizer's largest id (added tokens included) is >= ``cfg.vocab_size``."""
    top = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)
    if top >= cfg.vocab_size:
        raise TokenizerNotFound(f"tokenizer {where} has ids up to {top} but the model's vocab_size is "
                                f"{cfg.vocab_size:,}: the model has no embedding for ids >= {cfg.vocab_size}; "
                                f"pass a tokenizer of at most {cfg.vocab_size:,} ids (--tokenizer)")


def _mesh_and_rules(mesh_spec: str | None, rules_name: str):
    if not mesh_spec:
        return None, None
    from minimax_jax.sharding import load_rules, make_mesh

    return make_mesh(mesh_spec), load_rules(rules_name)


def load_model(checkpoint_dir: str | None = None, *, tokenizer_path: str | None = None, dtype: str | None = None,
               mesh: str | None = None, rules: str = "default", convert_dir: str | None = None,
               attention: str = "as_trained", log: Callable[[str], None] = print, verify: bool = True,
               weights_dtype: str | None = None) -> LoadedModel:
    """Load a checkpoint (ours or HF, see module doc) and its tokenizer, with the decoder layers split for
    inference (``minimax_jax.model.params.split_layers``: ``params["segments"][s]`` is a list of per-layer trees).

    Args:
      checkpoint_dir: directory; None means ``DEFAULT_CHECKPOINT`` (``checkpoints/demo``).
      tokenizer_path: tokenizer.json (or its directory) overriding the checkpoint's.
      dtype: cast floating params on restore ("float32", "bfloat16"); also the conversion dtype of
        an HF directory (default "bfloat16").
      mesh: mesh spec text (``minimax_jax.sharding.MeshSpec.parse``, e.g. "fsdp=2,tensor=2");
        params are restored sharded by ``rules`` (a preset name or YAML path).
      convert_dir: where to keep the conversion of an HF directory (default: a temporary directory
        deleted after loading).
      attention: "as_trained" (default) or "dense": run the MSA layers as full attention
        (``minimax_jax.infer.attention_mode.apply_attention_mode``; the indexer weights are dropped).
      log: receives one-line progress messages.
      verify: check our checkpoint's tensors against its checksum manifest (``load_checkpoint``).
      weights_dtype: None, or ``"fp8"``: keep FP8 layer weights in FP8 (``minimax_jax.ops.moe.Fp8Weight``,
        dequantised inside the jitted step): ours must hold them (``fp8_weights.json``), an HF directory must be
        an FP8 checkpoint (converted keeping FP8). None dequantises an FP8 checkpoint of ours on load.
    Raises: CheckpointNotFound, CheckpointMismatch (all mismatched leaves), TokenizerNotFound,
      Fp8WeightsUnavailable (``weights_dtype="fp8"`` for a checkpoint without FP8 weights),
      ConfigError / CheckpointError from the converter (ChecksumMismatch naming a corrupt tensor),
      ValueError for an unknown ``attention``.
    """
    check_attention_mode(attention)   # before any heavy work
    if weights_dtype not in (None, "fp8"):
        raise ValueError(f"weights_dtype must be None or 'fp8', got {weights_dtype!r}")
    model = _load_any(checkpoint_dir, tokenizer_path, dtype, mesh, rules, convert_dir, log, verify, weights_dtype)
    note = describe_attention_mode(model.cfg, attention)
    cfg, params = apply_attention_mode(model.cfg, model.params, attention)
    if cfg is not model.cfg and model.mesh is not None:
        import jax

        from minimax_jax.model import params_shardings

        params = jax.device_put(params, params_shardings(cfg, model.mesh, model.rules))
    if attention != "as_trained":
        log(f"attention: {note}")
    # Inference reads layer j's weights as their own buffers: the decode step would otherwise copy them out of
    # the stacked segments in every step (minimax_jax.model.params). The stacked arrays are ours (restored
    # here), deleted leaf by leaf, so the device holds one extra leaf at a time, not a second copy.
    from minimax_jax.model.params import split_layers

    model = dataclasses.replace(model, params=None)
    params = split_layers(params, cfg, delete_stacked=True)
    return dataclasses.replace(model, cfg=cfg, params=params, attention=attention, attention_note=note)


def check_weights_dtype(checkpoint_dir: str, weights_dtype: str | None) -> None:
    """Raise Fp8WeightsUnavailable when ``weights_dtype="fp8"`` meets a checkpoint without FP8 weights (ours:
    no ``fp8_weights.json``; HF: no ``weight_scale_inv`` tensor); reads headers only."""
    if weights_dtype != "fp8":
        return
    if checkpoint_kind(checkpoint_dir) == "orbax":
        from minimax_jax.convert.fp8_keep import FP8_FILE, read_blocks

        if not read_blocks(checkpoint_dir):
            raise Fp8WeightsUnavailable(
                f"--weights_dtype fp8: checkpoint {checkpoint_dir} holds no FP8 weights (no {FP8_FILE}); convert an "
                "FP8 Hugging Face checkpoint with `python -m minimax_jax.convert --weights_dtype fp8`, or drop "
                "--weights_dtype")
        return
    from minimax_jax.convert.safetensors_io import SafetensorsReader

    if not any(n.endswith("_scale_inv") for n in SafetensorsReader(checkpoint_dir).names()):
        raise Fp8WeightsUnavailable(f"--weights_dtype fp8: {checkpoint_dir} is not an FP8 checkpoint (no "
                                    "weight_scale_inv tensors); drop --weights_dtype")


def _check_earlier_conversion(convert_dir, checkpoint_dir, dtype, weights_dtype):
    """Raise ConversionMismatch unless ``convert_dir`` holds this tool's conversion of ``checkpoint_dir`` at
    ``dtype`` / ``weights_dtype`` (its ``conversion.json``), so a reused folder never loads another model."""
    import json

    from minimax_jax.convert.atomic_dir import REPORT_FILE
    from minimax_jax.infer.errors import ConversionMismatch

    path = os.path.join(convert_dir, REPORT_FILE)
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, ValueError):
        raise ConversionMismatch(f"--convert_dir {convert_dir} exists but is not a conversion written by this tool "
                                 f"(no readable {REPORT_FILE}); give a new --convert_dir or remove it") from None
    want = {"source": os.path.abspath(checkpoint_dir), "dtype": dtype, "weights_dtype": weights_dtype}
    got = {k: report.get(k, report.get("dtype") if k == "weights_dtype" else None) for k in want}
    diff = [f"{k} {got[k]!r} (this call: {want[k]!r})" for k in want if got[k] != want[k]]
    if diff:
        raise ConversionMismatch(f"--convert_dir {convert_dir} holds a different conversion: {'; '.join(diff)}; "
                                 "give a new --convert_dir or remove it")


def _load_any(checkpoint_dir, tokenizer_path, dtype, mesh, rules, convert_dir, log, verify=True,
              weights_dtype=None) -> LoadedModel:
    checkpoint_dir = resolve_checkpoint(checkpoint_dir)
    kind = checkpoint_kind(checkpoint_dir)
    check_weights_dtype(checkpoint_dir, weights_dtype)
    tokenizer = load_tokenizer_for(checkpoint_dir, tokenizer_path)  # fail fast, before any heavy work
    mesh_obj, rules_obj = _mesh_and_rules(mesh, rules)
    if kind == "hf":
        from minimax_jax.convert import convert_hf_to_orbax

        conv_dtype = dtype if dtype in ("float32", "bfloat16") else "bfloat16"
        what = conv_dtype + (", FP8 layer weights kept" if weights_dtype == "fp8" else "")
        if convert_dir and os.path.isdir(convert_dir):
            _check_earlier_conversion(convert_dir, checkpoint_dir, conv_dtype, weights_dtype or conv_dtype)
            log(f"using the earlier conversion in {convert_dir}")
            check_weights_dtype(convert_dir, weights_dtype)
            return _load_orbax(convert_dir, checkpoint_dir, tokenizer, dtype, mesh_obj, rules_obj,
                               f"hf (converted earlier to {convert_dir})", verify, weights_dtype)
        if convert_dir:
            log(f"converting Hugging Face checkpoint {checkpoint_dir} -> {convert_dir} ({what})")
            convert_hf_to_orbax(checkpoint_dir, convert_dir, conv_dtype, progress=False, weights_dtype=weights_dtype)
            return _load_orbax(convert_dir, checkpoint_dir, tokenizer, dtype, mesh_obj, rules_obj,
                               f"hf (converted to {convert_dir})", verify, weights_dtype)
        with tempfile.TemporaryDirectory(prefix="minimax_infer_convert_") as tmp:
            dst = os.path.join(tmp, "ckpt")
            log(f"converting Hugging Face checkpoint {checkpoint_dir} on the fly ({what}, temporary)")
            convert_hf_to_orbax(checkpoint_dir, dst, conv_dtype, progress=False, weights_dtype=weights_dtype)
            return _load_orbax(dst, checkpoint_dir, tokenizer, dtype, mesh_obj, rules_obj,
                               "hf (converted on the fly)", verify, weights_dtype)
    return _load_orbax(checkpoint_dir, checkpoint_dir, tokenizer, dtype, mesh_obj, rules_obj, "orbax", verify,
                       weights_dtype)


def _load_orbax(directory, origin, tokenizer, dtype, mesh, rules, source, verify=True,
                weights_dtype=None) -> LoadedModel:
    import jax

    from minimax_jax.convert.atomic_dir import read_config
    from minimax_jax.convert.load import load_checkpoint

    cfg = read_config(directory)
    bad = find_mismatches(directory, cfg)
    if bad:
        lines = "\n".join(f"  {leaf}: config expects {w}, checkpoint has {s}" for leaf, w, s in bad)
        raise CheckpointMismatch(f"checkpoint {directory} does not match its config.yaml "
                                 f"({len(bad)} parameters):\n{lines}", bad)
    cfg, params = load_checkpoint(directory, cfg, mesh=mesh, rules=rules, dtype=dtype, verify=verify,
                                  weights_dtype=weights_dtype)
    if dtype:
        cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
    params = jax.block_until_ready(params)  # the temporary conversion may be deleted after this
    return LoadedModel(cfg, params, tokenizer, origin, source, mesh, rules)
