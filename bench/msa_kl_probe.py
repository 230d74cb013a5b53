"""Probe of the KV-outer indexer-KL kernels (pallas_kernels/msa/gpu_kl.py) on GPU: loss and gradients vs
the fp32 XLA reference, then the KL forward+backward timed next to the sparse attention forward+backward
(the issue-26 goal: the KL no slower than the attention it trains), in one run. With --dense: the dense
warm-up's kernels (pallas_kernels/msa/gpu_kl_dense.py) instead, checked and timed against the XLA dense
reference (default cases m3:8192,m3:32768).

Usage (GPU machine):  PYTHONUNBUFFERED=1 python3 bench/msa_kl_probe.py --out $OUT --cases m3:131072
Dense warm-up:        PYTHONUNBUFFERED=1 python3 bench/msa_kl_probe.py --dense --out $OUT
CPU smoke run:        python bench/msa_kl_probe.py --interpret --tiny --out /tmp/probe   (--dense as well)

Block ids as bench/msa_fwd_probe.py; the index branch has one index head per kv group (Di = D). Timed as in
training: the teacher's LSE is given (the attention forward's). Each ``--variants`` tiling is also compared with
the default tiling on the timed inputs (``variant_ok``). Writes
msa_kl_probe.json under --out; prints a table last. TFLOP/s: none (the KL's work is not a matmul count).

--dense (not an argparse flag of the shared probe command line: taken off argv first): checks on the probe
shapes (blocks and top-k unused: every visible key), then per case (one causal document, bf16, Di = D)
the kernels' forward+backward per ``--variants`` tiling of ``indexer_kl_dense_gpu`` (default: its own, then
DENSE_VARIANTS) and the XLA reference's (``indexer_kl(..., None, implementation="xla")``, what the warm-up ran
before), the kernels' KL / count / gradients compared with the reference's on the timed inputs
(``vs_xla``), and a table of ms, tokens/s and speed-up over XLA printed last. TFLOP/s there: the matmul
FLOPs of the kernels' schedule over the visible pairs (``dense_flops``), the same count for the XLA row.
Writes msa_kl_dense_probe.json.
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
from pallas_kernels.msa.gpu_kl_dense import indexer_kl_dense_gpu  # noqa: E402

DENSE_VARIANTS = ("block_q=64,block_k=64,num_warps=8;block_q=128,block_k=64,num_warps=8;"
                  "block_q=64,block_k=32,num_warps=4;block_q=128,block_k=32,num_warps=8")
_F0 = np.zeros((), jax.dtypes.float0)


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


def _cos(a, b):
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))


def dense_fb(pos, interpret, **tiling):
    """jit of (kl, count, (dqi, dki)) of the dense kernels for a unit cotangent."""
    def f(q, k, qi, ki):
        (kl, cnt), vjp = jax.vjp(lambda qi, ki: indexer_kl_dense_gpu(q, k, qi, ki, interpret=interpret, **tiling,
                                                                     **pos), qi, ki)
        return kl, cnt, vjp((jnp.float32(1.0), _F0))
    return jax.jit(f)


def dense_xla_fb(pos):
    """jit of the same through the XLA reference (what the warm-up ran before the kernels)."""
    def f(q, k, qi, ki):
        (kl, cnt), vjp = jax.vjp(lambda qi, ki: msa_ops.indexer_kl(q, k, qi, ki, None, implementation="xla", **pos),
                                 qi, ki)
        return kl, cnt, vjp((jnp.float32(1.0), _F0))
    return jax.jit(f)


def vs_reference(got, ref):
    """Kernel (kl, count, grads) against the reference's: equal counts, KL within 2e-2 relative (bf16 inputs),
    gradient cosines > 0.999 and no NaN (``ok``)."""
    kl, rkl = float(got[0]), float(ref[0])
    cos = [_cos(a, b) for a, b in zip(got[2], ref[2])]
    ok = (int(got[1]) == int(ref[1]) and abs(kl - rkl) <= 2e-2 * abs(rkl) + 1e-3 and min(cos) > 0.999
          and not any(np.isnan(np.asarray(a, np.float32)).any() for a in got[2]))
    return {"kl": kl, "kl_ref": rkl, "count": int(got[1]), "count_ref": int(ref[1]), "grad_cos": cos, "ok": bool(ok)}


def check_dense(name, key, interpret, bsz, t, s, h, g, d, blk, topk, segments=None):
    """The dense kernels (bf16) against the fp32 XLA reference on a probe shape (blocks unused)."""
    del blk, topk
    q, k, _, _, pos = make(key, bsz, t, s, h, g, d, 16, 1, segments)
    qi, ki = _index_inputs(key, q, k)
    ref = dense_xla_fb(pos)(*[x.astype(jnp.float32) for x in (q, k, qi, ki)])
    got = dense_fb(pos, interpret)(q, k, qi, ki)
    out = {"case": name, **vs_reference(got, ref)}
    out["kl_ok"] = out.pop("ok")
    again = dense_fb(pos, interpret)(q, k, qi, ki)
    out["kl_bitwise_repeat"] = bool(float(again[0]) == float(got[0]) and all(
        np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32)) for a, b in zip(again[2], got[2])))
    print("CHECK", json.dumps(out), flush=True)
    return out


def dense_flops(t, h, g, d, di):
    """Matmul FLOPs of the kernels' forward+backward on one causal row of T tokens: three passes of the
    teacher's (H x D) and the student's (G x Di) logits over the T (T + 1) / 2 visible pairs, d qi and d ki."""
    pairs = t * (t + 1) / 2
    return pairs * 2.0 * (3 * (h * d + g * di) + 2 * g * di)


def bench_dense(model, t, key, interpret, variants, dense):
    del dense
    h, g = MODELS[model]
    q, k, _, _, pos = make(key, 1, t, t, h, g, D, 16, 1)
    qi, ki = _index_inputs(key, q, k)
    args = (q, k, qi, ki)
    flops = dense_flops(t, h, g, D, D)
    rows = []
    add = row_adder(rows, model, t)
    ref_fn = dense_xla_fb(pos)
    add("xla dense reference fwd+bwd", ref_fn, args, flops)
    try:
        ref = ref_fn(*args)
    except Exception as e:          # reported; the kernels are still timed
        ref, rows[-1]["ref_error"] = None, f"{type(e).__name__}: {str(e)[:200]}"
    for kw in variants:             # {} = the kernels' default tiling
        fn = dense_fb(pos, interpret, **kw)
        add("dense KL kernels fwd+bwd" + (" " + ",".join(f"{a}={b}" for a, b in kw.items()) if kw else ""),
            fn, args, flops)
        if ref is not None and "error" not in rows[-1]:
            try:
                rows[-1]["vs_xla"] = vs_reference(fn(*args), ref)
            except Exception as e:
                rows[-1]["vs_xla_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        print("VS_XLA", json.dumps(rows[-1]), flush=True)
    for r in rows:
        if "ms" in r:
            r["tokens_per_s"] = t / (r["ms"] * 1e-3)
    return rows


def dense_summary(path):
    """The short table printed last: ms, tokens/s and speed-up over the XLA reference per case."""
    with open(path) as f:
        rows = json.load(f)["rows"]
    print("\ndense warm-up KL: model | T | variant | ms | tokens/s | x XLA | matches XLA")
    for r in rows:
        base = [x for x in rows if x["model"] == r["model"] and x["T"] == r["T"] and x["variant"].startswith("xla")]
        speed = base[0]["ms"] / r["ms"] if base and "ms" in base[0] and "ms" in r else float("nan")
        print(f"{r['model']} | {r['T']} | {r['variant']} | {r.get('ms', float('nan')):.1f} | "
              f"{r.get('tokens_per_s', float('nan')):.0f} | {speed:.1f} | {r.get('vs_xla', {}).get('ok', '-')} "
              f"{r.get('error', '')[:80]}")


def main():
    if "--dense" in sys.argv:
        sys.argv.remove("--dense")
        if not any(a == "--cases" or a.startswith("--cases=") for a in sys.argv) and "--tiny" not in sys.argv:
            sys.argv.append("--cases=m3:8192,m3:32768")
        if not any(a == "--variants" or a.startswith("--variants=") for a in sys.argv):
            sys.argv.append("--variants=;" + DENSE_VARIANTS)          # the default tiling first
        run_probe(__doc__, check_dense, bench_dense, "", "msa_kl_dense_probe.json", ("kl_ok", "kl_bitwise_repeat"))
        out = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--out=")), None)
        if out is None and "--out" in sys.argv:
            out = sys.argv[sys.argv.index("--out") + 1]
        dense_summary(os.path.join(out or "/tmp/msa_probe", "msa_kl_dense_probe.json"))
        return
    run_probe(__doc__, check, bench, "", "msa_kl_probe.json", ("kl_ok", "kl_bitwise_repeat"))


if __name__ == "__main__":
    main()
