"""Training metrics: FLOP counting / MFU, and the sinks (console progress bar, TensorBoard, JSONL).

FLOPs of one training token (forward + backward = 3 x forward)::

    6 * (active matmul params per token)                      # every projection, lm_head included
  + 3 * sum over attention layers of 4 * H * D * ctx          # QK^T and PV, forward 4*H*D per key
  + sum over MSA layers of 2 * Hi * Di * ctx_index            # the indexer scores: forward only (the
                                                              # selection is discrete, no gradient)
  (+ the same for each MTP module's layer and lm_head)

``train_flops_parts`` also counts the indexer KL on the selected support, apart: per MSA layer
``(2 * H * D + 6 * Hi * Di) * ctx`` (the teacher's QK^T once; the student's scores and their two
gradients, the only gradients the index branch gets).

``ctx`` is the number of keys a token attends: its position + 1 within its document for dense
layers, ``min(position + 1, topk * block)`` for MSA layers (MSA_SPEC.md section 6), the sliding
window for sliding layers. It is averaged over the real batch (``positions``), so packed documents
count what they really cost. The embedding lookup is not a matmul and is not counted.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np

from minimax_jax.config import ModelConfig

__all__ = ["matmul_params_per_token", "train_flops", "train_flops_parts", "peak_flops_per_device", "MetricsWriter"]

# bf16 dense peak TFLOP/s per device (vendor datasheets).
_PEAK_TFLOPS = {"h200": 989.0, "h100": 989.0, "a100": 312.0, "b200": 2250.0, "tpu v4": 275.0,
                "tpu v5 lite": 197.0, "tpu v5e": 197.0, "tpu v5p": 459.0, "tpu v5": 459.0, "tpu v6": 918.0}


def matmul_params_per_token(cfg: ModelConfig) -> int:
    """Active parameters a token multiplies (projections, active experts, lm_head; no embedding table),
    MTP modules included when the model has them."""
    c = cfg.param_counts()
    n = c["active_non_embedding"] + cfg.vocab_size * cfg.hidden_size  # + lm_head (tied or not)
    if cfg.num_mtp_modules:
        H = cfg.hidden_size
        mtp_layer_active = c["mtp"] // cfg.num_mtp_modules
        if cfg.mlp_types[-1] == "moe":  # only the routed experts a token uses
            expert = 3 * H * cfg.moe_intermediate_size
            mtp_layer_active -= (cfg.num_experts - cfg.num_experts_per_tok) * expert
        n += cfg.num_mtp_modules * (mtp_layer_active + cfg.vocab_size * H)
    return int(n)


def _ctx(pos1: np.ndarray, layer_type: str, cfg: ModelConfig) -> tuple[float, float]:
    """Mean (attended keys, indexer keys) per token for one layer kind."""
    if layer_type == "msa":
        return float(np.mean(np.minimum(pos1, cfg.index_topk * cfg.index_block_size))), float(np.mean(pos1))
    if layer_type == "sliding":
        return float(np.mean(np.minimum(pos1, cfg.sliding_window))), 0.0
    return float(np.mean(pos1)), 0.0


def train_flops_parts(cfg: ModelConfig, positions: np.ndarray) -> dict[str, float]:
    """Training FLOPs of a batch with these ``positions`` ``[B, L]``, by part (module docstring):
    ``model`` (matmuls + attention), ``indexer`` (index scores, forward only) and ``kl`` (the indexer
    KL on the selected support: the teacher's QK^T once, 2 H D per key, and the student's scores with
    their two gradients, 6 Hi Di per key; counted whether or not the run trains it)."""
    pos1 = np.asarray(positions, np.float64) + 1.0
    tokens = pos1.size
    model = 6.0 * matmul_params_per_token(cfg)
    index = kl = 0.0
    kinds = list(cfg.layer_types) + [cfg.layer_types[-1]] * cfg.num_mtp_modules
    hd = cfg.num_heads * cfg.head_dim
    hdi = cfg.index_num_heads * cfg.index_head_dim if "msa" in kinds else 0
    for lt in kinds:
        ctx, ictx = _ctx(pos1, lt, cfg)
        model += 3.0 * 4.0 * hd * ctx
        if lt == "msa":
            index += 2.0 * hdi * ictx
            kl += (2.0 * hd + 6.0 * hdi) * ctx
    return {"model": model * tokens, "indexer": index * tokens, "kl": kl * tokens}


def train_flops(cfg: ModelConfig, positions: np.ndarray) -> float:
    """Training FLOPs of a batch with these ``positions`` ``[B, L]``: model + indexer parts of
    ``train_flops_parts`` (the MFU of the train loop's metrics)."""
    parts = train_flops_parts(cfg, positions)
    return parts["model"] + parts["indexer"]


def peak_flops_per_device(device_kind: str, override_tflops: float | None = None) -> float | None:
    """Peak FLOP/s of one device: the override, else a table lookup by device kind, else None."""
    if override_tflops is not None:
        return float(override_tflops) * 1e12 if override_tflops > 0 else None
    kind = device_kind.lower()
    for key in sorted(_PEAK_TFLOPS, key=len, reverse=True):
        if key in kind:
            return _PEAK_TFLOPS[key] * 1e12
    return None


class MetricsWriter:
    """Writes scalar metrics to ``run_dir/metrics.jsonl`` and TensorBoard, and drives a tqdm bar.

    Only process 0 writes. TensorBoard uses ``tensorboard.summary.Writer`` (no TensorFlow needed);
    when the package is missing it is skipped with a warning.
    """

    def __init__(self, run_dir: str, *, total_steps: int, start_step: int, tensorboard: bool, progress: bool,
                 is_main: bool = True):
        self.is_main = is_main
        self.jsonl = None
        self.tb = None
        self.bar = None
        if not is_main:
            return
        os.makedirs(run_dir, exist_ok=True)
        self.jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a")
        if tensorboard:
            try:
                from tensorboard.summary import Writer
                self.tb = Writer(os.path.join(run_dir, "tensorboard"))
            except ImportError as e:
                import warnings
                warnings.warn(f"tensorboard is not installed ({e}); TensorBoard scalars are off", stacklevel=2)
        if progress:
            from tqdm.auto import tqdm
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def write(self, step: int, scalars: dict[str, Any]) -> None:
        """Record ``scalars`` (floats) at ``step``."""
        if not self.is_main:
            return
        clean = {k: float(v) for k, v in scalars.items()}
        self.jsonl.write(json.dumps({"step": int(step), "time": time.time(), **clean}) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for k, v in clean.items():
                self.tb.add_scalar(k, v, int(step))
            self.tb.flush()
        if self.bar is not None:
            post = {"loss": f"{clean.get('loss', float('nan')):.4f}"}      # the total: LM + MTP + indexer terms
            if "lm_loss" in clean:
                post["lm"] = f"{clean['lm_loss']:.4f}"
            if "tokens_per_s" in clean:
                post["tok/s"] = f"{clean['tokens_per_s']:.3g}"
            if "mfu" in clean:
                post["mfu"] = f"{clean['mfu']:.1%}"
            self.bar.set_postfix(post, refresh=False)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def message(self, text: str) -> None:
        if self.is_main:
            if self.bar is not None:
                self.bar.write(text)
            else:
                print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.jsonl is not None:
            self.jsonl.close()
