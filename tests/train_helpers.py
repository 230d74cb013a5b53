"""Helpers for the training tests and smoke runs: a micro model, a small real-text corpus + tokenizer,
and running ``train.py`` in a subprocess with a persistent compilation cache.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from typing import Any

import yaml

__all__ = ["MICRO_MODEL", "MICRO_MSA_MODEL", "micro_train_dict", "write_yaml", "stdlib_corpus", "subprocess_env",
           "run_train_cli", "train_script_main", "REPO"]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: A 2-layer MoE (M2 style) model small enough to compile in seconds on CPU.
MICRO_MODEL: dict[str, Any] = dict(
    name="tiny-m2", vocab_size=384, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
    rotary_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, max_position_embeddings=512)

#: A 2-layer M3-style model: a dense full-attention layer, then MSA + MoE; blocks of 8, top-2.
MICRO_MSA_MODEL: dict[str, Any] = dict(
    name="tiny-m3", vocab_size=384, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    rotary_dim=8, layer_types=["full", "msa"], mlp_types=["dense", "moe"], dense_intermediate_size=32,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_intermediate_size=16,
    index_head_dim=16, index_block_size=8, index_topk=2, num_mtp_modules=1, max_position_embeddings=512)


def micro_train_dict(run_dir: str, *, model: dict | None = None, data: dict | None = None, **sections) -> dict:
    """A training config dict for the micro model on synthetic data (override any section)."""
    d = {
        "model": copy.deepcopy(model or MICRO_MODEL),
        "data": data or {"kind": "synthetic", "seq_len": 64, "batch_size": 4, "seed": 0},
        "mesh": "data=1",
        "optim": {"lr": 3e-3, "weight_decay": 0.01, "z_loss": 1e-4},
        "schedule": {"kind": "constant", "warmup_steps": 2},
        "checkpoint": {"every": 2, "keep": 3},
        "run": {"run_dir": run_dir, "steps": 6, "log_every": 1, "progress": False, "tensorboard": False},
    }
    for k, v in sections.items():
        d[k] = {**d.get(k, {}), **v} if isinstance(v, dict) else v
    return d


def write_yaml(d: dict, path: str) -> str:
    with open(path, "w") as f:
        yaml.safe_dump(d, f, sort_keys=False)
    return path


def stdlib_corpus(out_dir: str, *, max_files: int = 40, vocab_size: int = 384) -> tuple[str, str]:
    """Copy a deterministic set of Python stdlib sources into ``out_dir/text`` and train a byte-level
    BPE tokenizer on them. Returns ``(text_dir, tokenizer_dir)``."""
    from minimax_jax.data.prose import stdlib_python_files
    from minimax_jax.data.tokenizer import save_tokenizer, train_tokenizer_from_paths

    text_dir = os.path.join(out_dir, "text")
    os.makedirs(text_dir, exist_ok=True)
    files = sorted(f for f in stdlib_python_files() if 2_000 < os.path.getsize(f) < 40_000)[:max_files]
    for i, f in enumerate(files):
        with open(f, encoding="utf-8", errors="replace") as src, open(os.path.join(text_dir, f"{i:03d}.py"), "w") as dst:
            dst.write(src.read())
    tok_dir = os.path.join(out_dir, "tok")
    save_tokenizer(train_tokenizer_from_paths([text_dir], vocab_size), tok_dir)
    return text_dir, tok_dir


def subprocess_env(cache_dir: str | None = None, devices: int | None = None) -> dict[str, str]:
    """Environment for a child JAX process: CPU, optional persistent compilation cache / N devices."""
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    if cache_dir:
        env.update(JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    if devices:
        env["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    return env


def train_script_main():
    """``train.py``'s ``main(argv) -> exit status``, loaded in this process: for the checks that end before any
    compile (usage errors, ``--check_only``), without an interpreter start-up per case."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_script", os.path.join(REPO, "train.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def run_train_cli(config_path: str, *overrides: str, env: dict | None = None, timeout: float = 600,
                  wait: bool = True):
    """Run ``python train.py --config ... --set ...``; returns CompletedProcess (or Popen if not wait)."""
    cmd = [sys.executable, os.path.join(REPO, "train.py"), "--config", config_path]
    for o in overrides:
        cmd += ["--set", o]
    if not wait:
        return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def random_params(cfg, seed: int = 3):
    """Random params for ``cfg`` built in numpy (``init_params`` takes seconds on CPU), committed to
    the first device like a loaded checkpoint: norm scales ~1 +- 0.1, biases ~N(0, 0.1), matrices
    ~N(0, 1/fan_in) (embeddings N(0, 1))."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from minimax_jax.model import abstract_params

    rng = np.random.default_rng(seed)

    def leaf(path, a):
        name = jax.tree_util.keystr(path)
        if name.endswith("['scale']"):
            x = 1.0 + 0.1 * rng.standard_normal(a.shape)
        elif "bias" in name:
            x = 0.1 * rng.standard_normal(a.shape)
        else:
            x = rng.standard_normal(a.shape) / np.sqrt(a.shape[-2] if "embedding" not in name else 1)
        return jnp.asarray(x, a.dtype)

    return jax.device_put(jax.tree_util.tree_map_with_path(leaf, abstract_params(cfg)), jax.devices()[0])
