"""Tuning probe of the KV-outer MSA backward (pallas_kernels/msa/gpu_sparse_bwd.py, and the Hopper one of
gpu_sparse_bwd_wgmma.py) on GPU: gradients vs the fp32 XLA reference (default, chunked queries, bf16 dq
partials; the wgmma backward where its shapes are served), then timings of launch variants (rows,
num_warps, chunk, query_chunk, dq_partial_bits; ``wgmma=1``: the Hopper kernel with the variant's chunk /
query_chunk / dq_partial_bits), the op's forward+backward (Triton, and the Hopper forward with either
backward) and cuDNN dense causal forward+backward, in one run.

Usage (GPU machine):  PYTHONUNBUFFERED=1 python3 bench/msa_bwd_probe.py --out $OUT   (--no-checks / --no-bench:
                      the timings or the checks alone)
CPU smoke run:        python bench/msa_bwd_probe.py --interpret --tiny --out /tmp/probe

Block ids as bench/msa_fwd_probe.py. FLOPs (MSA_SPEC.md section 6): forward 4*D*H*min(t, K*B) per
token, backward 2.5x that (five matmuls to the forward's two). Writes msa_bwd_probe.json under --out;
prints a table last.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.msa_fwd_probe import D, BLK, MODELS, TOPK, make, row_adder, run_probe  # noqa: E402
from minimax_jax.ops import msa as msa_ops  # noqa: E402
from pallas_kernels.msa import gpu_sparse_bwd as kb  # noqa: E402
from pallas_kernels.msa import gpu_sparse_bwd_wgmma as kbw  # noqa: E402
from pallas_kernels.msa import gpu_sparse_fwd as kf  # noqa: E402
from pallas_kernels.msa import layout  # noqa: E402
from pallas_kernels.msa.gpu_attention import msa_attention_gpu  # noqa: E402


def _pos_args(pos):
    return (pos["q_positions"], pos["kv_positions"], pos["q_segment_ids"], pos["kv_segment_ids"])


def bwd_fn(pos, blk, interpret, wgmma=0, **kw):
    """The backward, jitted: the Triton kernel, or with ``wgmma=1`` the Hopper one (Triton-only knobs dropped)."""
    fn = kb.sparse_bwd_kv_outer
    if wgmma:
        fn = kbw.sparse_bwd_wgmma
        kw = {a: b for a, b in kw.items() if a in ("chunk", "query_chunk", "dq_partial_bits", "p_in_smem")}
    return jax.jit(lambda q, k, v, ids, o, lse, do: fn(
        q, k, v, ids, *_pos_args(pos), o, lse, do, block_size=blk, interpret=interpret, **kw))


def wgmma_served(q, k, blk, pos):
    """(None or why the wgmma backward does not serve the case, every window 8-row aligned: its kernel runs
    rather than the Triton fallback)."""
    why = kbw.wgmma_bwd_supported(q.shape, k.shape, k.shape[-1], q.dtype, blk)
    prep = layout.prepare(k, k, *_pos_args(pos), blk)
    return why, bool(np.all(np.asarray(prep.base) % 8 == 0))


def fwd_fn(pos, blk, interpret):
    return jax.jit(lambda q, k, v, ids: kf.sparse_fwd_kv_outer(
        q, k, v, ids, *_pos_args(pos), block_size=blk, interpret=interpret))


def _cos(a, b):
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))


def check(name, key, interpret, bsz, t, s, h, g, d, blk, topk, segments=None):
    q, k, v, ids, pos = make(key, bsz, t, s, h, g, d, blk, topk, segments)
    do = jax.random.normal(jax.random.fold_in(key, 7), q.shape, q.dtype)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    _, vjp = jax.vjp(lambda q, k, v: msa_ops.msa_attention(q, k, v, ids, block_size=blk,
                                                           implementation="xla", **pos)[0], *f32)
    ref = [np.asarray(x) for x in vjp(do.astype(jnp.float32))]
    o, lse = fwd_fn(pos, blk, interpret)(q, k, v, ids)
    out = {"case": name}
    labels = [("bwd", {}), ("bwd_chunked", dict(query_chunk=max(16, t // 3))), ("bwd_dq16", dict(dq_partial_bits=16))]
    why, aligned = wgmma_served(q, k, blk, pos)
    out["wgmma"] = why or ("kernel" if aligned else "triton fallback (a window off an 8-row boundary)")
    if why is None:
        labels += [("wgmma", dict(wgmma=1, dq_partial_bits=32)),
                   ("wgmma_chunked", dict(wgmma=1, query_chunk=max(16, t // 3))),
                   ("wgmma_dq16", dict(wgmma=1)), ("wgmma_split", dict(wgmma=1, chunk=32))]
    for label, kw in labels:
        got = [np.asarray(x, np.float32) for x in bwd_fn(pos, blk, interpret, **kw)(q, k, v, ids, o, lse, do)]
        cos = [_cos(a, b) for a, b in zip(got, ref)]
        rel = [float(np.max(np.abs(a - b)) / max(np.abs(b).max(), 1e-30)) for a, b in zip(got, ref)]
        out[f"{label}_cos"] = cos
        out[f"{label}_max_rel"] = rel
        out[f"{label}_ok"] = bool(min(cos) > 0.9999 and max(rel) < 0.05
                                  and not any(np.isnan(a).any() for a in got))
    r1 = bwd_fn(pos, blk, interpret)(q, k, v, ids, o, lse, do)
    r2 = bwd_fn(pos, blk, interpret)(q, k, v, ids, o, lse, do)
    out["bwd_bitwise_repeat"] = bool(all(np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
                                         for a, b in zip(r1, r2)))
    if why is None:
        r1, r2 = (bwd_fn(pos, blk, interpret, wgmma=1)(q, k, v, ids, o, lse, do) for _ in range(2))
        out["wgmma_bitwise_repeat"] = bool(all(np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
                                               for a, b in zip(r1, r2)))
    print("CHECK", json.dumps(out), flush=True)
    return out


def bench(model, t, key, interpret, variants, dense):
    h, g = MODELS[model]
    q, k, v, ids, pos = make(key, 1, t, t, h, g, D, BLK, TOPK)
    do = jax.random.normal(jax.random.fold_in(key, 7), q.shape, q.dtype)
    p = np.arange(1, t + 1, dtype=np.float64)
    fwd_f = float(np.sum(4.0 * D * h * np.minimum(p, TOPK * BLK)))
    dense_f = float(np.sum(4.0 * D * h * p))
    o, lse = fwd_fn(pos, BLK, interpret)(q, k, v, ids)
    rows = []
    add = row_adder(rows, model, t)

    for kw in variants:
        name = "bwd " + ",".join(f"{a}={b}" for a, b in kw.items())
        add(name, bwd_fn(pos, BLK, interpret, **kw), (q, k, v, ids, o, lse, do), 2.5 * fwd_f)

    def msa_fb(q, k, v, ids, do):
        (_, lse), vjp = jax.vjp(lambda q, k, v: msa_attention_gpu(
            q, k, v, ids, block_size=BLK, interpret=interpret, **pos), q, k, v)
        return vjp((do, jnp.zeros_like(lse)))
    add("msa_attention_gpu fwd+bwd (defaults)", jax.jit(msa_fb), (q, k, v, ids, do), 3.5 * fwd_f)
    if kbw.wgmma_bwd_supported(q.shape, k.shape, v.shape[-1], q.dtype, BLK) is None:
        for fwd, bwd in (("wgmma", "triton"), ("wgmma", "wgmma"), ("triton", "wgmma")):
            def hopper_fb(q, k, v, ids, do, fwd=fwd, bwd=bwd):
                (_, lse), vjp = jax.vjp(lambda q, k, v: msa_attention_gpu(
                    q, k, v, ids, block_size=BLK, interpret=interpret, forward=fwd, backward=bwd, **pos), q, k, v)
                return vjp((do, jnp.zeros_like(lse)))
            add(f"msa_attention_gpu fwd+bwd (forward {fwd}, backward {bwd})", jax.jit(hopper_fb), (q, k, v, ids, do),
                3.5 * fwd_f)
    if dense and not interpret:
        def dense_fb(q, k, v, do):
            _, vjp = jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=True, implementation="cudnn"), q, k, v)
            return vjp(do)
        add("cudnn_dense fwd+bwd", jax.jit(dense_fb), (q, k, v, do), 3.5 * dense_f)
    return rows


def main():
    # --no-checks / --no-bench (run_probe): one half of the probe per call (at M3 128K both can pass 10 minutes)
    run_probe(__doc__, check, bench,
              "rows=32,num_warps=8;rows=64,num_warps=8;rows=32,num_warps=4;"
              "rows=64,num_warps=8,chunk=256;rows=32,num_warps=8,query_chunk=8192;"
              "wgmma=1,dq_partial_bits=32;wgmma=1;wgmma=1,chunk=256",
              "msa_bwd_probe.json", ("bwd_ok", "bwd_chunked_ok", "bwd_dq16_ok", "bwd_bitwise_repeat", "wgmma",
                                     "wgmma_ok", "wgmma_chunked_ok", "wgmma_dq16_ok", "wgmma_split_ok",
                                     "wgmma_bitwise_repeat"))


if __name__ == "__main__":
    main()
