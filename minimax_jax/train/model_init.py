"""Model configuration and initial parameters of a training run (the ``model`` and ``init`` sections).

- ``scratch``: ``model.name`` (a config name/path) with the other ``model`` keys as field overrides;
  params from ``init_params``.
- ``checkpoint``: config and params of a converted checkpoint (``minimax_jax.convert``), ``model``
  keys override fields that do not change shapes (dtypes, implementations...), and
  ``num_mtp_modules``: fewer modules drop the last ones; more append copies of the checkpoint's last
  MTP module (module d then starts from module d-1's weights, the usual way to add speculative depth
  to a trained model; train them with ``optim.freeze`` holding the rest, configs/train/demo-mtp.yaml).
- ``sparse_cpt``: a dense checkpoint turned into MSA: ``cfg.with_msa(msa.layers, **msa.index)`` and
  ``add_index_params`` initialises the index branch (then the loop warms the indexer up).

``run.compute_dtype`` / ``run.param_dtype`` set the model's ``dtype`` / ``param_dtype`` (mixed
precision: bf16 compute with fp32 master parameters is ``compute_dtype: bfloat16, param_dtype: float32``).
"""

from __future__ import annotations

from typing import Any

import jax

from minimax_jax.config import ModelConfig, load_config
from minimax_jax.train.config import TrainConfig, TrainConfigError

__all__ = ["model_configs", "initial_params", "resize_mtp"]


def _apply_fields(cfg: ModelConfig, fields: dict[str, Any]) -> ModelConfig:
    if not fields:
        return cfg
    fields = dict(fields)
    if fields.get("num_layers", cfg.num_layers) != cfg.num_layers:
        # Uniform per-layer lists follow the new depth; mixed ones must be given explicitly.
        for name in ("layer_types", "mlp_types"):
            kinds = set(getattr(cfg, name))
            if name not in fields:
                if len(kinds) != 1:
                    raise TrainConfigError(f"model.num_layers changes the depth of a model with mixed {name} "
                                           f"{getattr(cfg, name)}; give model.{name} too")
                fields[name] = kinds.pop()
    try:
        return ModelConfig.from_dict({**cfg.to_dict(), **fields})
    except ValueError as e:
        raise TrainConfigError(f"model: {e}") from None


def _precision(cfg: ModelConfig, tc: TrainConfig) -> ModelConfig:
    kw = {}
    if tc.run.compute_dtype:
        kw["dtype"] = tc.run.compute_dtype
    if tc.run.param_dtype:
        kw["param_dtype"] = tc.run.param_dtype
    return cfg.replace(**kw) if kw else cfg


def model_configs(tc: TrainConfig) -> tuple[ModelConfig, ModelConfig | None]:
    """``(cfg, source_cfg)``: the config trained, and the checkpoint's config (None for scratch).

    Reads only configuration files (no parameters). Raises TrainConfigError with the cause.
    """
    fields = {k: v for k, v in tc.model.items() if k != "name"}
    try:
        if tc.init.mode == "scratch":
            base = load_config(tc.model["name"]) if tc.model.get("name") else ModelConfig()
            return _precision(_apply_fields(base, fields), tc), None
        from minimax_jax.convert.atomic_dir import read_config

        stored_cfg = read_config(tc.init.path)
        src = _precision(_apply_fields(stored_cfg, fields), tc)
    except (OSError, ValueError) as e:
        raise TrainConfigError(f"cannot build the model config: {e}") from None
    want, stored = src.num_mtp_modules, stored_cfg.num_mtp_modules
    if want != stored:           # grown / shrunk from the stored modules (initial_params, resize_mtp)
        if tc.init.mode != "checkpoint":
            raise TrainConfigError(f"model.num_mtp_modules={want}: init.mode {tc.init.mode} keeps the checkpoint's "
                                   f"{stored} MTP modules; change them in an init.mode: checkpoint run")
        if stored == 0:
            raise TrainConfigError(f"model.num_mtp_modules={want}: the checkpoint {tc.init.path} has no MTP module "
                                   f"to copy the new ones from")
        return src, src.replace(num_mtp_modules=stored)
    if tc.init.mode == "checkpoint":
        return src, src
    try:
        cfg = src.with_msa(tc.msa.layers, **dict(tc.msa.index))
    except (ValueError, TypeError) as e:
        raise TrainConfigError(f"msa.layers / msa.index: {e}") from None
    return cfg, src


def initial_params(tc: TrainConfig, cfg: ModelConfig, src_cfg: ModelConfig | None, shardings: Any,
                   src_shardings: Any = None) -> Any:
    """Initial params placed with ``shardings`` (``src_shardings``: the dense tree's, for sparse_cpt)."""
    if tc.init.mode == "scratch":
        from minimax_jax.model import init_params

        init = jax.jit(lambda k: init_params(cfg, k), out_shardings=shardings)
        return init(jax.random.key(tc.run.seed))
    from minimax_jax.convert.load import load_checkpoint

    if tc.init.mode == "checkpoint":
        if src_cfg is not None and src_cfg.num_mtp_modules != cfg.num_mtp_modules:
            _, params = load_checkpoint(tc.init.path, src_cfg, shardings=src_shardings, dtype=cfg.param_dtype)
            return resize_mtp(params, cfg.num_mtp_modules)
        _, params = load_checkpoint(tc.init.path, cfg, shardings=shardings, dtype=cfg.param_dtype)
        return params
    from minimax_jax.model import add_index_params

    _, dense = load_checkpoint(tc.init.path, src_cfg, shardings=src_shardings, dtype=cfg.param_dtype)
    key = jax.random.fold_in(jax.random.key(tc.run.seed), 1)
    conv = jax.jit(lambda p, k: add_index_params(p, src_cfg, cfg, k), out_shardings=shardings)
    return conv(dense, key)


def resize_mtp(params: dict, num_modules: int) -> dict:
    """``params`` with ``num_modules`` MTP modules: the first ones kept, new ones copies of the last.

    Copies are new buffers (the train step donates its state; one buffer twice would be refused).
    Raises ValueError when modules are to be added and ``params`` has none.
    """
    import jax.numpy as jnp

    mods = list(params.get("mtp", ()))
    if num_modules < 0:
        raise ValueError(f"num_modules must be >= 0, got {num_modules}")
    if num_modules > len(mods) and not mods:
        raise ValueError("no MTP module to copy: the params have none")
    out = {k: v for k, v in params.items() if k != "mtp"}
    mods = mods[:num_modules] + [jax.tree.map(lambda a: jnp.array(a, copy=True), mods[-1])
                                 for _ in range(num_modules - len(mods))]
    if mods:
        out["mtp"] = mods
    return out
