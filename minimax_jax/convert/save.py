"""Save an in-memory params tree as a checkpoint directory (the layout ``load_checkpoint`` reads).

``DST/config.yaml`` + ``DST/params/`` (orbax) + ``DST/minimax_manifest.json`` (checksums) + optional
``DST/tokenizer.json``, written into a temporary sibling and renamed on success, exactly like
``convert_hf_to_orbax``'s output, so a trained model and a converted published one are
interchangeable for ``infer.py``.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import jax
import numpy as np

from minimax_jax.config import ModelConfig
from minimax_jax.convert.atomic_dir import PARAMS_DIR, atomic_output_dir, check_destination, write_config
from minimax_jax.convert.from_state import cast_params
from minimax_jax.convert.manifest import write_manifest
from minimax_jax.convert.orbax_stream import save_lazy_tree

__all__ = ["save_checkpoint"]


def save_checkpoint(params: Any, cfg: ModelConfig, dst: str | os.PathLike, *, dtype: str | None = None,
                    tokenizer: str | None = None, overwrite: bool = False, sources=()) -> None:
    """Write ``params`` (our layout) and ``cfg`` to ``dst``.

    Args:
      params: params tree (jax or numpy leaves) matching ``abstract_params(cfg)``.
      cfg: the model config; with ``dtype`` its ``param_dtype`` is set to that dtype.
      dtype: cast floating leaves (router weights stay float32), e.g. "bfloat16"; None keeps them.
      tokenizer: a ``tokenizer.json`` to copy alongside.
      overwrite: replace an existing ``dst`` that this tool wrote (``atomic_dir.check_destination``).
      sources: paths the params came from (e.g. the run directory): ``dst`` must not overlap them
        (nor the tokenizer).
    Writes ``minimax_manifest.json`` (a checksum per leaf) beside ``params/``.
    Raises: DestinationExistsError (a FileExistsError) when ``dst`` exists and not ``overwrite``;
      DestinationError when ``dst`` overlaps a source or is not ours to replace; FileNotFoundError
      for a missing tokenizer file. All before anything is written.
    """
    if tokenizer and not os.path.isfile(tokenizer):
        raise FileNotFoundError(f"tokenizer file {tokenizer} does not exist")
    sources = (*sources, tokenizer)
    check_destination(dst, sources=sources, overwrite=overwrite, kind="orbax")
    if dtype:
        params = cast_params(params, dtype)
        cfg = cfg.replace(param_dtype=dtype)
    tree = jax.tree.map(lambda x: np.asarray(x), params)
    with atomic_output_dir(dst, overwrite=overwrite, sources=sources, kind="orbax") as tmp:
        entries = save_lazy_tree(os.path.join(tmp, PARAMS_DIR), tree)
        write_manifest(tmp, entries, writer="save_checkpoint")
        write_config(cfg, tmp)
        if tokenizer:
            shutil.copy(tokenizer, os.path.join(tmp, "tokenizer.json"))
