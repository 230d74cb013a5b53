"""Export the params of a training run as a checkpoint ``infer.py`` loads (and optionally as HF
safetensors).

``python -m minimax_jax.train.export --run_dir RUN --dst CKPT [--dtype bfloat16]
[--tokenizer tokenizer.json] [--hf_dst HF_DIR --max_shard_mb 15] [--overwrite] [--no_verify] [--debug]``
restores the newest params of the run (checked against the checkpoint's checksums), writes ``CKPT``
(``config.yaml`` + orbax ``params/`` + checksum manifest + tokenizer) with
``minimax_jax.convert.save.save_checkpoint`` and, with ``--hf_dst``, exports that directory to the
hub layout with ``minimax_jax.convert.export_orbax_to_hf`` (small shards travel where file sizes are
capped). Every write is atomic; a destination that overlaps the run (or the tokenizer), that exists
without ``--overwrite``, or that export did not write is refused before anything is read (exit 2),
as is a tokenizer with ids >= the model's ``vocab_size``; a checkpoint that fails its checks exits 1
(``minimax_jax.exit_codes``).
"""

from __future__ import annotations

import json
import os
import sys

import orbax.checkpoint as ocp

from minimax_jax import cli_main
from minimax_jax.config import ModelConfig
from minimax_jax.convert.errors import (ChecksumMismatch, CheckpointError, CorruptFileError, DestinationError,
                                        DestinationExistsError, first_line)
from minimax_jax.train.checkpointing import ITEMS, Checkpointer

__all__ = ["latest_params", "export_run", "ExportMismatch", "TokenizerMismatch"]


class ExportMismatch(ValueError):
    """The run's restored params do not have the shapes its ``model_config.yaml`` implies."""


class TokenizerMismatch(ValueError):
    """The tokenizer to bundle has ids the model's vocabulary does not (or is not a tokenizer)."""


def latest_params(run_dir: str, *, verify: bool = True, warn=None) -> tuple[int, dict]:
    """Restore the params of the newest checkpoint under ``run_dir/checkpoints``.

    ``verify``: check the restored state against the step's checksum manifest (a step saved
    without one: one line to ``warn``, default stderr).
    Returns: ``(step, params)`` with numpy leaves as saved.
    Raises: FileNotFoundError when the run has no checkpoint; ChecksumMismatch naming a corrupt leaf.
    """
    ckpt = os.path.join(os.path.abspath(run_dir), "checkpoints")
    if not os.path.isdir(ckpt):
        raise FileNotFoundError(f"no checkpoint directory {ckpt}")
    ck = Checkpointer(ckpt, keep=None, async_save=False, verify=verify)
    try:
        steps = ck.all_steps()
        if not steps:
            raise FileNotFoundError(f"no checkpoint under {ckpt}")
        try:
            return steps[-1], ck.restore_state(steps[-1], warn=warn)["params"]
        except ChecksumMismatch:
            raise
        except Exception as e:  # noqa: BLE001 - tensorstore's error embeds the whole array spec: keep its root line
            raise CorruptFileError(
                f"checkpoint {ckpt}/{steps[-1]}: reading it failed, the files are truncated or corrupt "
                f"({first_line(e)}); move that step out of {ckpt} to export the one before it") from e
    finally:
        ck.close()


def export_run(run_dir: str, dst: str, *, dtype: str = "bfloat16", tokenizer: str | None = None,
               hf_dst: str | None = None, max_shard_mb: float = 15.0, overwrite: bool = False,
               verify: bool = True) -> dict:
    """Write the newest params of ``run_dir`` to ``dst`` (and ``hf_dst``); see module docstring.

    The model config is the run's resolved ``model_config.yaml`` (written by the training loop).
    ``overwrite`` replaces a ``dst`` / ``hf_dst`` an earlier export wrote (never anything else);
    ``verify``: check the run's checkpoint against its checksums.
    Returns: a summary dict (step, dst, hf export summary or None).
    Raises (all before anything is written): DestinationError / DestinationExistsError (``dst`` or
      ``hf_dst`` overlaps the run, the tokenizer or each other, exists without ``overwrite``, or is
      not an export); TokenizerMismatch (ids >= vocab_size); FileNotFoundError (no checkpoint /
      tokenizer); ExportMismatch (the params do not have the shapes ``model_config.yaml`` implies);
      ChecksumMismatch (a corrupt tensor in the run's checkpoint).
    """
    from minimax_jax.convert.atomic_dir import check_destination
    from minimax_jax.convert.save import save_checkpoint

    _check_run_dir(run_dir)
    if tokenizer is None:
        tokenizer = _run_tokenizer(run_dir)       # first: a missing tokenizer fails before any work
    elif not os.path.isfile(tokenizer):
        raise FileNotFoundError(f"tokenizer file {tokenizer} does not exist")
    sources = (run_dir, tokenizer)
    check_destination(dst, sources=sources, overwrite=overwrite, kind="orbax")
    if hf_dst:
        check_destination(hf_dst, sources=(*sources, dst), overwrite=overwrite, kind="hf")
    cfg = ModelConfig.from_yaml(os.path.join(run_dir, "model_config.yaml"))
    if tokenizer:
        _check_tokenizer(tokenizer, cfg)
    step, params = latest_params(run_dir, verify=verify)
    # Kernel choices are the training machine's (e.g. msa_impl=xla forced for a run); the exported
    # model must pick what suits the machine that loads it.
    cfg = cfg.replace(attention_impl="auto", sliding_attention_impl="auto", moe_impl="auto", msa_impl="auto")
    _check_shapes(params, cfg, run_dir, step)    # before anything is written at dst
    save_checkpoint(params, cfg, dst, dtype=dtype, tokenizer=tokenizer, overwrite=overwrite, sources=(run_dir,))
    hf = None
    if hf_dst:
        from minimax_jax.convert import export_orbax_to_hf

        hf = export_orbax_to_hf(dst, hf_dst, max_shard_bytes=int(max_shard_mb * 2 ** 20), overwrite=overwrite,
                                progress=False, verify=verify)
    return {"step": step, "dst": dst, "hf": hf, "tokenizer": tokenizer}


def _check_tokenizer(path: str, cfg: ModelConfig) -> None:
    """Raise TokenizerMismatch when ``path``'s largest id (added tokens included) is >= ``cfg.vocab_size``."""
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for malformed JSON
        raise TokenizerMismatch(f"{path} is not a valid tokenizer.json ({first_line(e)})") from e
    vocab = tok.get_vocab(with_added_tokens=True)
    top = max(vocab.values(), default=-1)
    if top >= cfg.vocab_size:
        raise TokenizerMismatch(
            f"tokenizer {path} has {len(vocab):,} tokens (ids up to {top}) but the model's vocab_size is "
            f"{cfg.vocab_size:,}: the model has no embedding for ids >= {cfg.vocab_size}; nothing was written; "
            f"pass a tokenizer of at most {cfg.vocab_size:,} ids (--tokenizer)")


def param_mismatches(params, cfg: ModelConfig) -> list[tuple[str, str, str]]:
    """``[(leaf path, config shape, params shape)]`` for every leaf of ``params`` whose shape differs
    from ``abstract_params(cfg)`` (a shape is "absent" when the leaf exists on one side only)."""
    import jax
    import numpy as np

    from minimax_jax.model import abstract_params

    def flat(tree):
        return {jax.tree_util.keystr(k): list(np.shape(v)) for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}

    got, want = flat(params), flat(abstract_params(cfg))
    out = []
    for k in sorted(set(got) | set(want)):
        w, g = want.get(k, "absent"), got.get(k, "absent")
        if w != g:
            out.append((f"params{k}", str(w), str(g)))
    return out


def _check_shapes(params, cfg: ModelConfig, run_dir: str, step: int) -> None:
    """Raise ExportMismatch (one line: up to 3 leaves, and the config fields that differ from the
    model the checkpoint was saved with) when ``params`` do not fit ``cfg``."""
    bad = param_mismatches(params, cfg)
    if not bad:
        return
    shown = "; ".join(f"{leaf}: config {w}, checkpoint {g}" for leaf, w, g in bad[:3])
    more = f"; and {len(bad) - 3} more" if len(bad) > 3 else ""
    path = os.path.join(run_dir, "model_config.yaml")
    saved = _saved_model_config(run_dir, step)
    mine = cfg.to_dict()
    fields = {k: v for k, v in (saved or {}).items() if k in mine and mine[k] != v and not k.endswith("_impl")}
    why = (f"the checkpoint was saved with {', '.join(f'{k}={v!r}' for k, v in fields.items())}: put "
           f"{'that value' if len(fields) == 1 else 'those values'} back in model_config.yaml") if fields else \
        "restore the run's original model_config.yaml"
    raise ExportMismatch(f"the params of checkpoint step {step} do not match {path} ({len(bad)} parameters: "
                         f"{shown}{more}); nothing was written; {why} and export again")


def _saved_model_config(run_dir: str, step: int) -> dict | None:
    """The model config stored in the ``meta`` item of checkpoint ``step`` (None if unreadable)."""
    try:
        mgr = ocp.CheckpointManager(os.path.join(os.path.abspath(run_dir), "checkpoints"), item_names=ITEMS)
        return dict(mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]["model_config"])
    except Exception:  # noqa: BLE001 - only used to make the error message more precise
        return None


def _check_run_dir(run_dir: str) -> None:
    """Raises FileNotFoundError / NotADirectoryError naming what ``run_dir`` is instead of a run directory."""
    if not os.path.exists(run_dir):
        raise FileNotFoundError(f"run directory {run_dir!r} does not exist")
    if not os.path.isdir(run_dir):
        raise NotADirectoryError(f"run directory {run_dir!r} is a file; pass the directory train.py wrote "
                                 "(its run.run_dir)")
    if not os.path.isfile(os.path.join(run_dir, "model_config.yaml")):
        raise FileNotFoundError(f"{run_dir!r} is not a train.py run directory (it has no model_config.yaml, "
                                "which train.py writes when a run starts); pass the run's run.run_dir")


def _run_tokenizer(run_dir: str) -> str | None:
    """The ``tokenizer.json`` the run trained with (``data.tokenizer`` of its config.yaml), if any.

    A relative path is tried from the current directory, then from the run directory's parent.
    Raises FileNotFoundError when the run names a tokenizer that neither finds: an export without
    the tokenizer would load in no runtime (pass ``tokenizer=`` / ``--tokenizer``).
    """
    import yaml

    path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        tok = ((yaml.safe_load(f) or {}).get("data") or {}).get("tokenizer")
    if not tok:
        return None
    tried = [tok] if os.path.isabs(tok) else [tok, os.path.join(os.path.dirname(os.path.abspath(run_dir)), tok)]
    for cand in tried:
        if os.path.isdir(cand):
            cand = os.path.join(cand, "tokenizer.json")
        if os.path.isfile(cand):
            return cand
    raise FileNotFoundError(
        f"the run's data.tokenizer {tok!r} was not found (tried {', '.join(map(repr, tried))} from "
        f"{os.getcwd()!r}); run the export from the directory train.py ran in, or pass --tokenizer PATH")


PROG = "python -m minimax_jax.train.export"


def main(argv=None) -> int:
    """Entry point (``argv`` without the program name); returns the exit status (minimax_jax.exit_codes)."""
    return cli_main.run(_main, argv, prog=PROG, usage=(DestinationError, TokenizerMismatch),
                        failure=(ExportMismatch, CheckpointError))


def _main(argv) -> int:
    ap = cli_main.Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--run_dir", required=True, help="a train.py run directory")
    ap.add_argument("--dst", required=True, help="checkpoint directory to write (infer.py --checkpoint)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--tokenizer", help="tokenizer.json to copy alongside (default: the run's data.tokenizer)")
    ap.add_argument("--hf_dst", help="also export HF safetensors here")
    ap.add_argument("--max_shard_mb", type=cli_main.float_in(1e-9), default=15.0,
                    help="HF shard size cap in MiB (default: 15)")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace --dst / --hf_dst when an earlier export wrote them (nothing else is ever replaced)")
    cli_main.add_bool(ap, "verify", True, "check the run's checkpoint against its checksums")
    a = cli_main.parse_args(cli_main.add_common(ap), argv)
    try:
        summary = export_run(a.run_dir, a.dst, dtype=a.dtype, tokenizer=a.tokenizer, hf_dst=a.hf_dst,
                             max_shard_mb=a.max_shard_mb, overwrite=a.overwrite, verify=a.verify)
    except DestinationExistsError as e:
        raise DestinationError(f"{e.path} already exists; pass --overwrite to replace it (only a directory export "
                               "wrote is ever replaced), or choose another destination") from e
    if summary["tokenizer"] is None:
        print(f"{PROG}: warning: the run has no tokenizer (synthetic data?), so {a.dst} has none; infer.py needs "
              f"--tokenizer T.json for it (or export again with --tokenizer)", file=sys.stderr)
    print(json.dumps(summary, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
