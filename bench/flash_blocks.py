"""Tile sizes of the GPU flash-attention backward (``minimax_jax.ops.attention.flash``, JAX's Pallas Triton ``mha``).

    PYTHONUNBUFFERED=1 python3 bench/flash_blocks.py --out $OUT             # GPU
    python bench/flash_blocks.py --tiny --out /tmp/flash_blocks             # CPU plumbing (interpret)

The training step's profile (bench/train_step.py --profile, 2026-12-01) put the Pallas flash backward
at a third of the dense 8K step: JAX's ``mha`` defaults its backward tiles to 32 x 32. For each
candidate ``BlockSizes`` (backward tiles; the fused backward needs ``block_q_dq == block_kv_dkv``)
and ``num_warps``, on causal packed GQA attention of the bench model's shape (B=1, T=8192, 16 query
/ 4 kv heads of 128, two documents per row) this script:

1. checks outputs and q/k/v gradients against the library-default configuration and against the
   XLA reference path ``attention(implementation="xla")`` (bf16 inputs, relative Frobenius error
   < 2e-2 each; on the H200 the tilings agreed with the default bit for bit, 4.9e-3 from XLA) -- a
   failing candidate is reported and not timed;
2. times forward and forward+backward (median of ``--reps`` calls, ``block_until_ready``) and
   reports TFLOP/s (causal FLOPs: 4 * T^2/2 * H * D forward, 2.5x that for the backward);
3. times cuDNN's fused attention (``jax.nn.dot_product_attention(implementation="cudnn")``, causal,
   one document per row: it has no segment ids here) as the baseline of the same run;
4. checks (against the XLA reference, same bound) and times cuDNN's packed layout on the same
   two-document rows (``minimax_jax.ops.attention.cudnn``, ``attention(implementation="cudnn_packed")``)
   for each ``--max-segments`` (the static runs-per-row bound cuDNN's grid is sized by).

``--candidates current`` times only the tiles ``flash.GPU_BLOCKS`` in use (with the library default
as the reference).

Writes ``flash_blocks.json``; prints a table last.
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
import jax.numpy as jnp  # noqa: E402

from minimax_jax.ops.attention import attention, flash  # noqa: E402
from minimax_jax.ops.attention import cudnn as cudnn_packed  # noqa: E402

#: (block_q_dkv, block_kv_dkv, block_q_dq, block_kv_dq, num_warps); None = the library default.
CANDIDATES = [None, (32, 64, 64, 32, 4), (32, 128, 128, 32, 8), (64, 128, 128, 64, 8), (64, 64, 64, 64, 4),
              (64, 64, 64, 64, 8), (128, 128, 128, 128, 8), (64, 128, 128, 64, 4), (128, 64, 64, 128, 8)]


def _rel(a, b) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def _time(fn, *args, reps: int) -> float:
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def _cudnn_packed_row(q, k, v, do, seg, max_segments, xref, fwd_flops, reps) -> dict:
    """Check cuDNN's packed attention against the XLA reference outputs / gradients and time it."""
    def f(q, k, v):
        return cudnn_packed.packed_attention(q, k, v, seg, max_segments=max_segments)

    def fb(q, k, v):
        o, vjp = jax.vjp(f, q, k, v)
        return (o, *vjp(do))
    row = {"config": f"cudnn_packed (two documents, max_segments={max_segments})"}
    try:
        got = jax.jit(fb)(q, k, v)
        row["max_rel_err_vs_xla"] = max(_rel(g, x) for g, x in zip(got, xref))
        row["ok"] = row["max_rel_err_vs_xla"] < 2e-2
        if row["ok"]:
            row["fwd_ms"] = 1e3 * _time(jax.jit(f), q, k, v, reps=reps)
            row["fwdbwd_ms"] = 1e3 * _time(jax.jit(fb), q, k, v, reps=reps)
            row["fwd_tflops"] = fwd_flops / row["fwd_ms"] * 1e-9
            row["fwdbwd_tflops"] = 3.5 * fwd_flops / row["fwdbwd_ms"] * 1e-9
    except Exception as e:  # noqa: BLE001 - reported in the table, not fatal
        row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--candidates", choices=("all", "current"), default="all")
    p.add_argument("--max-segments", default="2,16,64,default",
                   help="cudnn_packed runs-per-row bounds to time ('default': the op's default buckets)")
    p.add_argument("--tiny", action="store_true", help="CPU interpret-mode plumbing run (T=256, 2 candidates)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    backend = "gpu"
    cands = CANDIDATES if a.candidates == "all" else [None, flash.GPU_BLOCKS]
    if a.tiny:
        a.seq, a.heads, a.kv_heads, a.head_dim, a.reps = 256, 2, 1, 32, 1
        backend, cands = "gpu_interpret", CANDIDATES[:2]
    os.makedirs(a.out, exist_ok=True)
    t, h, hk, d = a.seq, a.heads, a.kv_heads, a.head_dim
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (1, t, h, d), jnp.bfloat16)
    k = jax.random.normal(ks[1], (1, t, hk, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (1, t, hk, d), jnp.bfloat16)
    do = jax.random.normal(ks[3], (1, t, h, d), jnp.bfloat16)
    half = t // 2
    seg = jnp.concatenate([jnp.ones((1, half), jnp.int32), jnp.full((1, t - half), 2, jnp.int32)], 1)
    pos = jnp.concatenate([jnp.arange(half), jnp.arange(t - half)])[None].astype(jnp.int32)
    fwd_flops = 4.0 * t * t / 2 * h * d
    rows = []

    def make(blocks):
        def f(q, k, v):
            return flash.flash_attention(q, k, v, seg, backend=backend, blocks=blocks)

        def fb(q, k, v):
            o, vjp = jax.vjp(f, q, k, v)
            return (o, *vjp(do))
        return jax.jit(f), jax.jit(fb)

    # The reference of the candidates: the library default, itself checked against the XLA path.
    _, ref_fb = make(None)
    ref = ref_fb(q, k, v)

    def xla(q, k, v):
        return attention(q, k, v, q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg,
                         implementation="xla")
    xo, xvjp = jax.vjp(jax.jit(xla), q, k, v)
    xref = (xo, *xvjp(do))
    xla_err = max(_rel(r, x) for r, x in zip(ref, xref))
    print(f"default config vs XLA reference: max relative error {xla_err:.2e}", flush=True)
    for c in cands:
        blocks = None if c is None else c
        name = "default(32,32,32,32)" if c is None else "q_dkv={},kv_dkv={},q_dq={},kv_dq={},w={}".format(*c)
        row = {"config": name, "blocks": c}
        try:
            f, fb = make(blocks)
            got = fb(q, k, v)
            row["max_rel_err"] = max(_rel(g, r) for g, r in zip(got, ref))
            # Tilings can agree bit for bit (the kernels accumulate in the same order), so each is also
            # compared with the independent XLA path.
            row["max_rel_err_vs_xla"] = max(_rel(g, x) for g, x in zip(got, xref))
            row["ok"] = row["max_rel_err"] < 2e-2 and row["max_rel_err_vs_xla"] < 2e-2
            if row["ok"]:
                row["fwd_ms"] = 1e3 * _time(f, q, k, v, reps=a.reps)
                row["fwdbwd_ms"] = 1e3 * _time(fb, q, k, v, reps=a.reps)
                row["fwd_tflops"] = fwd_flops / row["fwd_ms"] * 1e-9
                row["fwdbwd_tflops"] = 3.5 * fwd_flops / row["fwdbwd_ms"] * 1e-9
        except Exception as e:  # noqa: BLE001 - a candidate the kernel rejects is reported, not fatal
            row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
        rows.append(row)
        print(json.dumps(row), flush=True)
    if not a.tiny:
        rep = h // hk

        def cud(q, k, v):
            return jax.nn.dot_product_attention(q, jnp.repeat(k, rep, 2), jnp.repeat(v, rep, 2), is_causal=True,
                                                implementation="cudnn")

        def cud_fb(q, k, v):
            o, vjp = jax.vjp(cud, q, k, v)
            return (o, *vjp(do))
        try:
            row = {"config": "cudnn (one document per row)", "ok": True,
                   "fwd_ms": 1e3 * _time(jax.jit(cud), q, k, v, reps=a.reps),
                   "fwdbwd_ms": 1e3 * _time(jax.jit(cud_fb), q, k, v, reps=a.reps)}
            row["fwd_tflops"] = fwd_flops / row["fwd_ms"] * 1e-9
            row["fwdbwd_tflops"] = 3.5 * fwd_flops / row["fwdbwd_ms"] * 1e-9
        except Exception as e:  # noqa: BLE001
            row = {"config": "cudnn", "ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        rows.append(row)
        for m in (cudnn_packed.DEFAULT_MAX_SEGMENTS if x == "default" else int(x) for x in a.max_segments.split(",") if x):
            rows.append(_cudnn_packed_row(q, k, v, do, seg, m, xref, fwd_flops, a.reps))
            print(json.dumps(rows[-1]), flush=True)
    info = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "seq": t, "heads": h, "kv_heads": hk,
            "head_dim": d, "default_vs_xla_max_rel_err": xla_err, "rows": rows}
    with open(os.path.join(a.out, "flash_blocks.json"), "w") as f:
        json.dump(info, f, indent=1)
    print(f"\n{'config':44s} {'err':>8s} {'vs xla':>8s} {'fwd ms':>8s} {'TF/s':>6s} {'f+b ms':>8s} {'TF/s':>6s}")
    for r in rows:
        if r.get("ok"):
            print(f"{r['config']:44s} {r.get('max_rel_err', 0):8.1e} {r.get('max_rel_err_vs_xla', 0):8.1e} "
                  f"{r['fwd_ms']:8.3f} {r['fwd_tflops']:6.0f} "
                  f"{r['fwdbwd_ms']:8.3f} {r['fwdbwd_tflops']:6.0f}")
        else:
            print(f"{r['config']:44s} FAILED {r.get('error', '')[:80]} {r.get('max_rel_err', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
