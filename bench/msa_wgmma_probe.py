"""Device probe of the Hopper (Mosaic GPU, wgmma) KV-outer MSA forward
(pallas_kernels/msa/gpu_sparse_fwd_wgmma.py) against the Triton one (gpu_sparse_fwd.py), in one run.

1. Checks (small cases first): the wgmma forward vs the fp32 XLA reference and vs the Triton forward
   (o max abs error, lse max error, -inf pattern): M3 aligned, packed documents of unaligned lengths
   (the wide-window kernel), queries as a suffix of the keys, 64-key blocks.
2. At M3 shapes (T = --t, default 128K; 64 heads, 4 groups, D 128, block 128, top-16): wgmma vs
   Triton (o / lse errors), then timings of the wgmma forward (chunk variants, ``--query-chunks``: query
   tokens per pass, whose q rows per kv group may then stay in L2, P through SMEM), the
   Triton forward (defaults) and cuDNN dense causal attention.
Every step reports its error and goes on (e.g. a wgmma kernel that fails to compile on the device).

Usage (GPU):   PYTHONUNBUFFERED=1 python3 bench/msa_wgmma_probe.py --out $OUT [--quick]
CPU smoke run: python bench/msa_wgmma_probe.py --interpret --out /tmp/wgmma_probe  (jax >= 0.11)
Block ids and FLOPs as bench/msa_fwd_probe.py. Writes msa_wgmma_probe.json under --out; a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.msa_fwd_probe import BLK, D, MODELS, TOPK, kv_fn, make, row_adder  # noqa: E402
from minimax_jax.ops import msa as msa_ops  # noqa: E402
from pallas_kernels.msa.gpu_sparse_fwd_wgmma import sparse_fwd_wgmma  # noqa: E402


def wg_fn(pos, blk, interpret, **kw):
    return jax.jit(lambda q, k, v, ids: sparse_fwd_wgmma(
        q, k, v, ids, pos["q_positions"], pos["kv_positions"], pos["q_segment_ids"],
        pos["kv_segment_ids"], block_size=blk, interpret=interpret, **kw))


def _errs(o, lse, ro, rl, prefix):
    o, lse, ro, rl = (np.asarray(x, np.float32) for x in (o, lse, ro, rl))
    fin = np.isfinite(rl)
    err = {f"{prefix}_o_max_err": float(np.max(np.abs(o - ro))),
           f"{prefix}_lse_max_err": float(np.max(np.abs(np.where(fin, lse - rl, 0.0)))),
           f"{prefix}_inf_pattern_equal": bool(np.array_equal(np.isfinite(lse), fin)),
           f"{prefix}_nan": bool(np.isnan(o).any())}
    err[f"{prefix}_ok"] = bool(np.all(np.abs(o - ro) <= 2e-2 + 2e-2 * np.abs(ro))
                               and err[f"{prefix}_lse_max_err"] < 2e-3
                               and err[f"{prefix}_inf_pattern_equal"] and not err[f"{prefix}_nan"])
    return err


def check(name, key, interpret, reference=True, **shp):
    """wgmma vs the fp32 XLA reference (when ``reference``) and vs the Triton forward."""
    out = {"case": name}
    try:
        q, k, v, ids, pos = make(key, **shp)
        o, lse = jax.block_until_ready(wg_fn(pos, shp["blk"], interpret)(q, k, v, ids))
        to, tl = kv_fn(pos, shp["blk"], interpret)(q, k, v, ids)
        out.update(_errs(o, lse, to, tl, "vs_triton"))
        if reference:
            f32 = lambda x: x.astype(jnp.float32)
            ro, rl = msa_ops.msa_attention(f32(q), f32(k), f32(v), ids, block_size=shp["blk"],
                                           implementation="xla", **pos)
            out.update(_errs(o, lse, ro, rl, "vs_fp32"))
    except Exception as e:   # report (compile error, out of memory) and go on
        out["error"] = f"{type(e).__name__}: {str(e)[:600]}"
    print("CHECK", json.dumps(out), flush=True)
    return out


def cases(interpret, quick):
    if interpret:
        return [("tiny_m3like", dict(bsz=1, t=256, s=256, h=32, g=2, d=128, blk=64, topk=4)),
                ("tiny_packed", dict(bsz=1, t=200, s=200, h=16, g=2, d=128, blk=64, topk=3,
                                     segments=[[37, 120, 43]]))]
    small = [("m3", dict(bsz=1, t=4096, s=4096, h=64, g=4, d=D, blk=BLK, topk=TOPK))]
    if quick:
        return small
    return small + [
        ("m3_packed_unaligned", dict(bsz=2, t=3000, s=3000, h=64, g=4, d=D, blk=BLK, topk=TOPK,
                                     segments=[[1001, 1500, 499], [129, 2871]])),
        ("suffix_m3", dict(bsz=1, t=1000, s=5000, h=64, g=4, d=D, blk=BLK, topk=TOPK)),
        ("m3_blk64", dict(bsz=1, t=2048, s=2048, h=64, g=4, d=D, blk=64, topk=TOPK))]


def bench(t, key, quick, chunks, query_chunks=()):
    h, g = MODELS["m3"]
    q, k, v, ids, pos = make(key, 1, t, t, h, g, D, BLK, TOPK)
    p = np.arange(1, t + 1, dtype=np.float64)
    main_f = float(np.sum(4.0 * D * h * np.minimum(p, TOPK * BLK)))
    dense_f = float(np.sum(4.0 * D * h * p))
    rows = []
    add = row_adder(rows, "m3", t)
    big = check(f"m3_{t}", key, False, reference=False, bsz=1, t=t, s=t, h=h, g=g, d=D, blk=BLK, topk=TOPK)
    for c in chunks:
        add(f"wgmma chunk={c}", wg_fn(pos, BLK, False, chunk=c), (q, k, v, ids), main_f)
    for qc in query_chunks:   # smaller query chunks: each kv group's q rows of a chunk may stay in L2
        add(f"wgmma chunk={chunks[0]} query_chunk={qc}", wg_fn(pos, BLK, False, chunk=chunks[0], query_chunk=qc),
            (q, k, v, ids), main_f)
    if not quick:
        add(f"wgmma chunk={chunks[0]} p_in_smem", wg_fn(pos, BLK, False, chunk=chunks[0], p_in_smem=True),
            (q, k, v, ids), main_f)
    add("triton kv_outer (defaults)", kv_fn(pos, BLK, False), (q, k, v, ids), main_f)
    add("cudnn_dense", jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn")), (q, k, v), dense_f)
    return big, rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/msa_wgmma_probe")
    ap.add_argument("--t", type=int, default=131072)
    ap.add_argument("--chunks", default="128,256,512", help="wgmma selections per program to time")
    ap.add_argument("--query-chunks", default="",
                    help="query tokens per pass to time besides the default (e.g. 8192,4096; chunk = the first --chunks)")
    ap.add_argument("--quick", action="store_true", help="one check case, fewer variants")
    ap.add_argument("--interpret", action="store_true", help="CPU smoke run: tiny checks only")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = jax.devices()[0]
    meta = {"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            "device": getattr(dev, "device_kind", str(dev)), "jax": jax.__version__,
            "command": " ".join(sys.argv)}
    print(meta, flush=True)
    key = jax.random.PRNGKey(0)
    checks = []
    for name, shp in cases(args.interpret, args.quick):
        key, sub = jax.random.split(key)
        checks.append(check(name, sub, args.interpret, **shp))
    rows, big = [], None
    if not args.interpret:
        chunks = [int(c) for c in args.chunks.split(",")][:1 if args.quick else None]
        big, rows = bench(args.t, key, args.quick, chunks, [int(c) for c in args.query_chunks.split(",") if c])
    with open(os.path.join(args.out, "msa_wgmma_probe.json"), "w") as f:
        json.dump({"meta": meta, "checks": checks, "m3_check": big, "rows": rows}, f, indent=1)
    print("\ncheck                     ok(vs fp32)  ok(vs triton)  o err vs triton  lse err vs triton")
    for c in checks + ([big] if big else []):
        if "error" in c:
            print(f"{c['case']:<26}ERROR {c['error'][:200]}")
            continue
        print(f"{c['case']:<26}{str(c.get('vs_fp32_ok', '-')):<13}{str(c['vs_triton_ok']):<15}"
              f"{c['vs_triton_o_max_err']:<17.3g}{c['vs_triton_lse_max_err']:.3g}")
    print(f"\n{'variant':<34}{'ms':>10}{'TFLOP/s':>10}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<34}ERROR {r['error'][:200]}")
        else:
            print(f"{r['variant']:<34}{r['ms']:>10.2f}{r['tflops']:>10.1f}")


if __name__ == "__main__":
    main()
