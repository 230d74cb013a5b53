"""Probe of the KV-outer indexer-KL kernels (pallas_kernels/msa/gpu_kl.py) on GPU: loss and gradients vs
the fp32 XLA reference, then the KL forward+backward timed next to the sparse attention forward+backward
(the issue-26 goal: the KL no slower than the attention it trains), in one run.

Usage (GPU machine):  PYTHONUNBUFFERED=1 python3 bench/msa_kl_probe.py --out $OUT --cases m3:131072
CPU smoke run:        python bench/msa_kl_probe.py --interpret --tiny --out /tmp/probe

Block ids as bench/msa_fwd_probe.py; the index branch has one index head per kv group (Di = D). Timed as in
training: the teacher's LSE is given (the attention forward's). Each ``--variants`` tiling is also compared with
the default tiling on the timed inputs (``variant_ok``). Writes
msa_kl_probe.json under --out; prints a table last. TFLOP/s: none (the KL's work is not a matmul count).
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
from pallas_kernels.msa.gpu_attention import msa_attention_gpu  # noqa: E402
from pallas_kernels.msa.gpu_kl import indexer_kl_gpu  # noqa: E402


def _index_inputs(key, q, k):
    bsz, t, _, d = q.shape
    k1, k2 = jax.random.split(jax.random.fold_in(key, 11))
    return (jax.random.normal(k1, (bsz, t, k.shape[2], d), q.dtype),
            jax.random.normal(k2, (bsz, k.shape[1], d), q.dtype))


def kl_fb(pos, blk, interpret, **tiling):
    def f(q, k, qi, ki, ids, lse=None):
        (kl, cnt), vjp = jax.vjp(lambda qi, ki: indexer_kl_gpu(q, k, qi, ki, ids, block_size=blk, teacher_lse=lse,
                                                               interpret=interpret, **tiling, **pos), qi, ki)
        return kl, cnt, vjp((jnp.float32(1.0), np.zeros((), jax.dtypes.float0)))
    return jax.jit(f)


def check(name, key, interpret, bsz, t, s, h, g, d, blk, topk, segments=None):
    q, k, _, ids, pos = make(key, bsz, t, s, h, g, d, blk, topk, segments)
    qi, ki = _index_inputs(key, q, k)
    f32 = [x.astype(jnp.float32) for x in (q, k, qi, ki)]
    (rkl, rcnt), vjp = jax.vjp(lambda qi, ki: msa_ops.indexer_kl(f32[0], f32[1], qi, ki, ids, block_size=blk,
                                                                 implementation="xla", **pos), *f32[2:])
    ref = [np.asarray(x) for x in vjp((jnp.float32(1.0), np.zeros((), jax.dtypes.float0)))]
    kl, cnt, grads = kl_fb(pos, blk, interpret)(q, k, qi, ki, ids)
    got = [np.asarray(x, np.float32) for x in grads]
    cos = [float(np.sum(a.astype(np.float64) * b) / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))
           for a, b in zip(got, ref)]
    out = {"case": name, "kl": float(kl), "kl_ref": float(rkl), "count": int(cnt), "count_ref": int(rcnt),
           "grad_cos": cos}
    out["kl_ok"] = bool(int(cnt) == int(rcnt) and abs(float(kl) - float(rkl)) <= 2e-2 * abs(float(rkl)) + 1e-3
                        and min(cos) > 0.999 and not any(np.isnan(a).any() for a in got))
    again = kl_fb(pos, blk, interpret)(q, k, qi, ki, ids)
    out["kl_bitwise_repeat"] = bool(float(again[0]) == float(kl) and all(
        np.array_equal(np.asarray(a, np.float32), b) for a, b in zip(again[2], got)))
    print("CHECK", json.dumps(out), flush=True)
    return out


def vs_default(got, want):
    """A variant's (kl, count, grads) against the default tiling's on the same inputs: the KL's relative
    difference, equal counts, each gradient's max |difference| over its max |value| (``variant_ok``: equal
    counts, KL within 1e-4 relative, gradients within 1e-2 of their max: bf16 gradients, another summation order)."""
    kl_rel = abs(float(got[0]) - float(want[0])) / max(abs(float(want[0])), 1e-30)
    grad_rel = [float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))
                / max(float(np.max(np.abs(np.asarray(b, np.float32)))), 1e-30) for a, b in zip(got[2], want[2])]
    ok = int(got[1]) == int(want[1]) and kl_rel <= 1e-4 and max(grad_rel) <= 1e-2
    return {"kl_rel_vs_default": kl_rel, "grad_rel_vs_default": grad_rel, "variant_ok": bool(ok)}


def bench(model, t, key, interpret, variants, dense):
    del dense
    h, g = MODELS[model]
    q, k, v, ids, pos = make(key, 1, t, t, h, g, D, BLK, TOPK)
    qi, ki = _index_inputs(key, q, k)
    do = jax.random.normal(jax.random.fold_in(key, 7), q.shape, q.dtype)
    p = np.arange(1, t + 1, dtype=np.float64)
    fwd_f = float(np.sum(4.0 * D * h * np.minimum(p, TOPK * BLK)))
    rows = []
    add = row_adder(rows, model, t)
    # as in training: the teacher's LSE is the attention forward's (the KL then runs its student pass only)
    lse = jax.jit(lambda q, k, v, ids: msa_attention_gpu(q, k, v, ids, block_size=BLK, interpret=interpret,
                                                         **pos)[1])(q, k, v, ids)
    args = (q, k, qi, ki, ids, lse)
    base = kl_fb(pos, BLK, interpret)
    add("indexer KL fwd+bwd", base, args, float("nan"))
    want = base(*args)
    for kw in variants:      # tilings of the KL kernels (--variants "rows=64,num_warps=4;rows=128")
        if kw:
            fn = kl_fb(pos, BLK, interpret, **kw)
            add("indexer KL fwd+bwd " + ",".join(f"{a}={b}" for a, b in kw.items()), fn, args, float("nan"))
            try:
                rows[-1].update(vs_default(fn(*args), want))
            except Exception as e:
                rows[-1]["vs_default_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            print("VS_DEFAULT", json.dumps(rows[-1]), flush=True)

    def attn_fb(q, k, v, ids, do):
        (_, lse), vjp = jax.vjp(lambda q, k, v: msa_attention_gpu(
            q, k, v, ids, block_size=BLK, interpret=interpret, **pos), q, k, v)
        return vjp((do, jnp.zeros_like(lse)))
    add("sparse attention fwd+bwd", jax.jit(attn_fb), (q, k, v, ids, do), 3.5 * fwd_f)
    return rows


def main():
    run_probe(__doc__, check, bench, "", "msa_kl_probe.json", ("kl_ok", "kl_bitwise_repeat"))


if __name__ == "__main__":
    main()
