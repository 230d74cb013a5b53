"""Export the params of a training run as an HF-layout safetensors checkpoint.

``python -m minimax_jax.train.export --run_dir RUN --dst HF_DIR [--dtype bfloat16]
[--max_shard_mb 15] [--tokenizer tokenizer.json]`` writes ``config.json``
(``ModelConfig.to_hf_config``), safetensors shards no larger than ``max_shard_mb`` with a
``model.safetensors.index.json``, and the tokenizer. ``python -m minimax_jax.convert`` turns that
directory into the orbax checkpoint that ``infer.py`` loads, so a trained model goes through the
same conversion path as a published one. Writes are atomic (temporary directory, then rename).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

import numpy as np
import orbax.checkpoint as ocp
import yaml

from minimax_jax.config import ModelConfig
from minimax_jax.convert.atomic_dir import atomic_output_dir
from minimax_jax.convert.from_state import params_to_hf_state

__all__ = ["latest_params", "export_run"]


def latest_params(run_dir: str) -> tuple[int, dict]:
    """Restore the params of the newest checkpoint under ``run_dir/checkpoints``.

    Returns: ``(step, params)`` with numpy leaves as saved.
    Raises: FileNotFoundError when the run has no checkpoint.
    """
    ckpt = os.path.join(os.path.abspath(run_dir), "checkpoints")
    mgr = ocp.CheckpointManager(ckpt, item_names=("state", "data", "meta"))
    steps = sorted(mgr.all_steps())
    if not steps:
        raise FileNotFoundError(f"no checkpoint under {ckpt}")
    got = mgr.restore(steps[-1], args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    return steps[-1], got["state"]["params"]


def _run_model_config(run_dir: str) -> ModelConfig:
    path = os.path.join(run_dir, "model_config.yaml")
    if os.path.exists(path):
        return ModelConfig.from_yaml(path)
    with open(os.path.join(run_dir, "config.yaml")) as f:
        cfg = yaml.safe_load(f)
    model = dict(cfg["model"])
    from minimax_jax.config import load_config

    name = model.pop("name", None) or model.pop("path", None)
    base = load_config(name) if name else ModelConfig()
    return base.replace(**model) if model else base


def export_run(run_dir: str, dst: str, *, dtype: str = "bfloat16", max_shard_mb: float = 15.0,
               tokenizer: str | None = None, cfg: ModelConfig | None = None) -> dict:
    """Write the newest params of ``run_dir`` to ``dst`` in the HF layout (see module docstring).

    Returns: a summary dict (step, tensors, bytes, shards).
    """
    from safetensors.numpy import save_file

    step, params = latest_params(run_dir)
    cfg = cfg or _run_model_config(run_dir)
    state = params_to_hf_state(params, cfg)
    np_dt = {"bfloat16": "bfloat16", "float32": np.float32}[dtype]
    if dtype == "bfloat16":
        import ml_dtypes

        np_dt = ml_dtypes.bfloat16
    limit = int(max_shard_mb * 2 ** 20)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(state):
        keep32 = "e_score_correction_bias" in name or name.endswith("gate.weight")
        arr = np.ascontiguousarray(np.asarray(state[name], np.float32 if keep32 else np_dt))
        if size + arr.nbytes > limit and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    total = sum(a.nbytes for s in shards for a in s.values())
    with atomic_output_dir(dst, overwrite=True) as tmp:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(tmp, fname))
            weight_map.update({n: fname for n in shard})
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
        hf = cfg.to_hf_config()
        hf["torch_dtype"] = dtype
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf, f, indent=1)
        if tokenizer:
            shutil.copy(tokenizer, os.path.join(tmp, "tokenizer.json"))
    return {"step": step, "tensors": len(state), "bytes": total, "shards": len(shards)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run_dir", required=True)
    ap.add_argument("--dst", required=True)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--max_shard_mb", type=float, default=15.0)
    ap.add_argument("--tokenizer", help="tokenizer.json to copy alongside")
    a = ap.parse_args(argv)
    print(json.dumps(export_run(a.run_dir, a.dst, dtype=a.dtype, max_shard_mb=a.max_shard_mb,
                                tokenizer=a.tokenizer)))


if __name__ == "__main__":
    main()
