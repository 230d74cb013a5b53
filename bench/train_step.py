"""Training-step benchmark: tokens/s and MFU of the production train step (``minimax_jax.train``).

Usage (GPU machine, one H200)::

    PYTHONUNBUFFERED=1 python3 bench/train_step.py --out $OUT            # dense 8K and MSA 64K
    python3 bench/train_step.py --modes msa --seq 65536 --steps 5 --out $OUT

CPU smoke run (a tiny model, seconds)::

    python bench/train_step.py --tiny --out /tmp/train_bench

Model (``--tiny`` off): an M3-style decoder of ~1.9B total / ~0.55B active parameters: Gemma norms,
per-head q/k norm, swigluoai, layer 0 dense full attention + dense MLP, layers 1-9 MSA + MoE
(16 experts, top-2, shared expert), 1 MTP module, 16 query / 4 kv heads of 128, index dim 128,
block 128, top-16 blocks. The vocabulary is 32768: ``forward`` materialises float32 logits
``[B, T, V]``, and at 64K tokens M3's 200K vocabulary alone would need ~52 GB for them (a chunked
lm-head + cross-entropy is the fix, not part of this benchmark).

Modes: ``dense`` = the same model with every MSA layer turned into full attention (``--dense-seq``,
default 8192); ``msa`` = sparse attention with the sparse indexer KL (``--msa-seq``, default 65536).
Both: bf16 compute, fp32 master params, ``remat=full``, AdamW, batch ``--batch`` rows of packed
synthetic documents (one document per row unless ``--doc-len``), one device (mesh ``data=1``).

Implementations: ``--attention-impl``, ``--moe-impl``, ``--msa-impl`` set the model's op choices
("auto" by default: on GPU the MoE uses the project's Pallas grouped matmul ``pallas_gpu``, 283-432
TFLOP/s on the H200 (bench/moe.py, 2026-11-30); elsewhere XLA ragged_dot, ``--moe-impl ragged``, which
on GPU PLATFORM.md measured at ~4% of matmul speed and out of memory at full size; tokamax is
opt-in, ``--moe-impl tokamax``). What actually ran is in the result's ``implementations``.

Measured: compile time, the median step time over ``--steps`` timed steps after ``--warmup``
steps (each ``block_until_ready``), tokens/s, model TFLOP/s and MFU by
``minimax_jax.train.metrics.train_flops`` (6 x matmul params + attention + indexer FLOPs, causal
context per token), peak device memory, and the op implementations that ran. Writes
``train_step.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from minimax_jax.ops.common import clear_implementation_report, implementation_report  # noqa: E402
from minimax_jax.train.config import from_dict  # noqa: E402
from minimax_jax.train.data import SyntheticIterator  # noqa: E402
from minimax_jax.train.loop import Trainer  # noqa: E402
from minimax_jax.train.metrics import matmul_params_per_token, peak_flops_per_device, train_flops  # noqa: E402

M3_STYLE = dict(
    vocab_size=32768, hidden_size=2048, num_layers=10, num_heads=16, num_kv_heads=4, head_dim=128, rotary_dim=64,
    max_position_embeddings=131072, norm_kind="gemma", qk_norm="per_head", mlp_activation="swigluoai",
    layer_types=["full"] + ["msa"] * 9, mlp_types=["dense"] + ["moe"] * 9, dense_intermediate_size=5632,
    num_experts=16, num_experts_per_tok=2, moe_intermediate_size=1536, shared_intermediate_size=1536,
    routed_scaling_factor=2.0, index_head_dim=128, index_block_size=128, index_topk=16, num_mtp_modules=1,
    bos_token_id=1, eos_token_id=2)

TINY = dict(M3_STYLE, vocab_size=512, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
            rotary_dim=8, layer_types=["full", "msa", "msa"], mlp_types=["dense", "moe", "moe"],
            dense_intermediate_size=96, num_experts=4, moe_intermediate_size=32, shared_intermediate_size=32,
            index_head_dim=16, index_block_size=16, index_topk=4, max_position_embeddings=4096)


def model_fields(mode: str, tiny: bool) -> dict:
    m = dict(TINY if tiny else M3_STYLE)
    if mode == "dense":
        m["layer_types"] = ["full"] * m["num_layers"]
    return m


def bench_one(mode: str, seq: int, args) -> dict:
    """Compile and time the train step of one mode; returns a result row."""
    fields = model_fields(mode, args.tiny)
    fields.update(attention_impl=args.attention_impl, moe_impl=args.moe_impl, msa_impl=args.msa_impl)
    tc = from_dict({
        "model": fields,
        "data": {"kind": "synthetic", "seq_len": seq, "batch_size": args.batch, "seed": 0,
                 "mean_doc_len": args.doc_len or seq * 100},
        "mesh": "data=1",
        "optim": {"lr": 1e-4, "mtp_weights": 0.3, "grad_accum": 1},
        "schedule": {"kind": "constant", "warmup_steps": 1},
        "msa": {"kl_coeff": args.kl_coeff},
        "checkpoint": {"every": 0},
        "run": {"run_dir": os.path.join(args.out, "unused"), "steps": 10**6, "compute_dtype": "bfloat16",
                "param_dtype": "float32", "remat": args.remat, "progress": False, "tensorboard": False},
    })
    tr = Trainer(tc)
    cfg = tr.cfg
    counts = cfg.param_counts()
    clear_implementation_report()
    state = tr.initial_state()
    it = SyntheticIterator(seq, args.batch, cfg.vocab_size, seed=0, mean_doc_len=args.doc_len or seq * 100)
    phase = tr.phase_of(10**6)
    batch = next(it)
    t = time.perf_counter()
    state, m = tr.run_step(phase, state, batch)
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t
    for _ in range(args.warmup):
        state, m = tr.run_step(phase, state, next(it))
    jax.block_until_ready(m)
    times, flops, loss = [], [], None
    for _ in range(args.steps):
        batch = next(it)
        t = time.perf_counter()
        state, m = tr.run_step(phase, state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t)
        flops.append(train_flops(cfg, batch["positions"]))
        loss = float(m["loss"])
    dev = jax.devices()[0]
    step_s = statistics.median(times)
    fl = statistics.median(flops)
    peak = peak_flops_per_device(dev.device_kind, args.peak_tflops)
    mem = {}
    try:
        stats = dev.memory_stats() or {}
        mem = {k: stats[k] for k in ("peak_bytes_in_use", "bytes_limit") if k in stats}
    except Exception:  # noqa: BLE001 - not every backend reports memory
        pass
    row = {
        "mode": mode, "seq_len": seq, "batch": args.batch, "device": dev.device_kind, "backend": jax.default_backend(),
        "params_total": counts["total"], "params_active": counts["active"],
        "matmul_params_per_token": matmul_params_per_token(cfg), "compile_s": round(compile_s, 2),
        "step_s_median": step_s, "step_s_all": times, "tokens_per_s": args.batch * seq / step_s,
        "model_tflops_per_s": fl / step_s / 1e12, "mfu": (fl / step_s / peak) if peak else None,
        "flops_per_step": fl, "loss_last": loss, "remat": args.remat, "kl_coeff": args.kl_coeff,
        "implementations": implementation_report(), **mem,
    }
    print(json.dumps({k: v for k, v in row.items() if k != "step_s_all"}), flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="dense,msa", help="comma list of dense,msa")
    p.add_argument("--dense-seq", type=int, default=8192)
    p.add_argument("--msa-seq", type=int, default=65536)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--doc-len", type=int, default=0, help="mean packed document length (0 = one per row)")
    p.add_argument("--remat", default="full", choices=["none", "full", "dots"])
    p.add_argument("--kl-coeff", type=float, default=1.0, help="MSA indexer KL weight (0 = no KL)")
    p.add_argument("--peak-tflops", type=float, default=None, help="per-device peak (default: table by device)")
    p.add_argument("--attention-impl", default="auto", help="ModelConfig.attention_impl")
    p.add_argument("--moe-impl", default="auto", help="ModelConfig.moe_impl: auto | dense | ragged | pallas_gpu | "
                                                      "tokamax | capacity ('auto' = dense for small problems, else "
                                                      "the Pallas grouped matmul 'pallas_gpu' on GPU, XLA ragged_dot "
                                                      "elsewhere; 'tokamax' (carry it) is opt-in: see "
                                                      "minimax_jax/ops/moe.py)")
    p.add_argument("--msa-impl", default="auto", help="ModelConfig.msa_impl (auto = Pallas kernel when present)")
    p.add_argument("--tiny", action="store_true", help="tiny model and short sequences (CPU smoke test)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.tiny:
        args.dense_seq, args.msa_seq = min(args.dense_seq, 128), min(args.msa_seq, 256)
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
    os.makedirs(args.out, exist_ok=True)
    rows, errors = [], []
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        if mode not in ("dense", "msa"):
            p.error(f"unknown mode {mode!r}")
        seq = args.dense_seq if mode == "dense" else args.msa_seq
        try:
            rows.append(bench_one(mode, seq, args))
        except Exception as e:  # noqa: BLE001 - record and go on to the next mode
            errors.append({"mode": mode, "seq_len": seq, "error": f"{type(e).__name__}: {str(e)[:2000]}"})
            print(f"{mode} @ {seq}: FAILED {errors[-1]['error'][:500]}", flush=True)
    with open(os.path.join(args.out, "train_step.json"), "w") as f:
        json.dump({"results": rows, "errors": errors, "jax": jax.__version__}, f, indent=1)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
