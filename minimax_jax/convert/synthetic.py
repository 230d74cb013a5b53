"""Write a synthetic HF checkpoint (hub layout, BF16 or FP8 block-scaled) for any ``ModelConfig``,
one shard per layer, so memory and speed of the converter can be measured on multi-GB inputs
without downloading anything. Values are slices of one random pool (cheap to produce, not i.i.d.),
fine for throughput / memory measurements, not for numerics.

    python -m minimax_jax.convert.synthetic --dst DIR --hidden 2048 --layers 12 --experts 16 [--fp8]
"""

from __future__ import annotations

import argparse
import json
import os

import ml_dtypes
import numpy as np

from minimax_jax.config import ModelConfig
from minimax_jax.convert.fp8 import FP8_MAX, scale_shape
from minimax_jax.convert.layout import EXPORT_STYLE, layer_slots, top_slots

__all__ = ["write_synthetic_checkpoint", "wide_config"]

_POOL = 1 << 24


def wide_config(*, hidden: int = 2048, layers: int = 12, experts: int = 16, inter: int = 1536,
                vocab: int = 32000, heads: int = 16, kv: int = 4, head_dim: int = 128) -> ModelConfig:
    """An M2-shaped config (full attention + MoE every layer) of adjustable width and depth."""
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv,
                       head_dim=head_dim, num_experts=experts, num_experts_per_tok=min(2, experts),
                       moe_intermediate_size=inter)


class _Pool:
    def __init__(self, seed: int):
        rng = np.random.default_rng(seed)
        self.rng = rng
        self.f32 = (rng.standard_normal(_POOL, np.float32) * 0.02).astype(np.float32)
        self.bf16 = self.f32.astype(ml_dtypes.bfloat16)
        self.fp8 = np.clip(self.f32 * (FP8_MAX / 0.1), -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)

    def take(self, shape, kind: str) -> np.ndarray:
        src = {"f32": self.f32, "bf16": self.bf16, "fp8": self.fp8}[kind]
        n = int(np.prod(shape))
        reps = -(-n // (_POOL // 2))
        o = int(self.rng.integers(0, _POOL // 2))
        flat = np.concatenate([src[o:o + _POOL // 2]] * reps)[:n] if reps > 1 else src[o:o + n].copy()
        return flat.reshape(shape)


def _is_quantised(name: str) -> bool:
    return ".layers." in name and (name.endswith("_proj.weight") or name.endswith((".w1.weight", ".w2.weight",
                                                                                      ".w3.weight")))


def write_synthetic_checkpoint(cfg: ModelConfig, dst: str, *, fp8: bool = False, seed: int = 0) -> int:
    """Write ``cfg``'s weights (hub names) to ``dst`` (one shard per layer + one for the rest), with
    ``config.json`` and an index. Returns the total tensor bytes written."""
    from safetensors.numpy import save_file

    os.makedirs(dst, exist_ok=True)
    pool = _Pool(seed)
    style = EXPORT_STYLE[cfg.norm_kind]
    groups = [[p for s in top_slots(cfg) for p in s.for_style(style).pieces]]
    for i in range(cfg.num_layers):
        slots = layer_slots(cfg, f"model.layers.{i}.", cfg.layer_types[i], cfg.mlp_types[i])
        groups.append([p for s in slots for p in s.for_style(style).pieces])
    weight_map, total = {}, 0
    for k, pieces in enumerate(groups):
        tensors = {}
        for p in pieces:
            if fp8 and _is_quantised(p.name):
                tensors[p.name] = pool.take(p.shape, "fp8")
                tensors[p.name + "_scale_inv"] = (pool.rng.random(scale_shape(p.shape), np.float32) * 1e-3)
            elif p.name.endswith((".gate.weight", "e_score_correction_bias")):
                tensors[p.name] = pool.take(p.shape, "f32")
            else:
                tensors[p.name] = pool.take(p.shape, "bf16")
        fn = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(tensors, os.path.join(dst, fn), metadata={"format": "pt"})
        for n, a in tensors.items():
            weight_map[n] = fn
            total += a.nbytes
        del tensors
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    hf = cfg.to_hf_config()
    if fp8:
        hf["quantization_config"] = {"quant_method": "fp8", "fmt": "float8_e4m3fn", "weight_block_size": [128, 128],
                                     "activation_scheme": "dynamic"}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    return total


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dst", required=True)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--inter", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--fp8", action="store_true")
    a = p.parse_args(argv)
    cfg = wide_config(hidden=a.hidden, layers=a.layers, experts=a.experts, inter=a.inter, vocab=a.vocab)
    n = write_synthetic_checkpoint(cfg, a.dst, fp8=a.fp8)
    print(f"wrote {n / 1e9:.3f} GB to {a.dst}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
