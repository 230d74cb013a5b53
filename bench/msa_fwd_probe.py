"""Tuning probe of the KV-outer MSA forward (pallas_kernels/msa/gpu_sparse_fwd.py) on GPU: correctness vs
the fp32 XLA reference, then timings of launch variants (rows, num_warps, chunk), a breakdown (work
list, + kernel, + combine) and cuDNN dense causal attention, in one run.

Usage (GPU machine):  PYTHONUNBUFFERED=1 python3 bench/msa_fwd_probe.py --out $OUT
CPU smoke run:        python bench/msa_fwd_probe.py --interpret --tiny --out /tmp/probe

Block ids: slot 0 the query's own block, slot 1 block 0, the rest uniform over the visible blocks
(duplicates count once). FLOPs: MSA_SPEC.md section 6 (4*D*H*min(t, K*B) per token).
Writes msa_fwd_probe.json under --out; prints a table last.
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
import numpy as np  # noqa: E402

from minimax_jax.ops import msa as msa_ops  # noqa: E402
from pallas_kernels.msa import gpu_sparse_fwd as kv  # noqa: E402
from pallas_kernels.msa import layout  # noqa: E402

MODELS = {"m3": (64, 4), "m2": (48, 8), "train": (16, 4)}   # train: bench/train_step.py's model
D, BLK, TOPK = 128, 128, 16


def _timeit(f, *args, budget_s=2.0, max_reps=15):
    jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    times = [time.perf_counter() - t0]
    for _ in range(int(max(2, min(max_reps, budget_s / max(times[0], 1e-6))))):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def row_adder(rows, model, t):
    """add(name, fn, args, flops): time fn(*args) into a row of ``rows`` (errors reported, not raised)."""
    def add(name, fn, args, flops):
        r = {"model": model, "T": t, "variant": name}
        try:
            ms = _timeit(fn, *args)
            r.update(ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
        except Exception as e:   # report (compile error, out of memory) and go on
            r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print("ROW", json.dumps(r), flush=True)
        rows.append(r)
    return add


def make(key, bsz, t, s, h, g, d, blk, topk, segments=None, dtype=jnp.bfloat16):
    ks = jax.random.split(key, 4)
    q = jax.random.normal(ks[0], (bsz, t, h, d), dtype)
    k = jax.random.normal(ks[1], (bsz, s, g, d), dtype)
    v = jax.random.normal(ks[2], (bsz, s, g, d), dtype)
    if segments is None:
        kvpos = np.broadcast_to(np.arange(s), (bsz, s)).copy()
        kvseg = np.zeros((bsz, s), np.int32)
    else:
        kvpos = np.zeros((bsz, s), np.int32)
        kvseg = np.full((bsz, s), -1, np.int32)
        for b, lens in enumerate(segments):
            o = 0
            for i, n in enumerate(lens):
                kvpos[b, o:o + n] = np.arange(n)
                kvseg[b, o:o + n] = i
                o += n
    qpos = kvpos[:, s - t:]
    own = qpos // blk                                                    # [B, T]
    rnd = jax.random.uniform(ks[3], (bsz, g, t, topk))
    ids = jnp.floor(rnd * (jnp.asarray(own)[:, None, :, None] + 1)).astype(jnp.int32)
    ids = ids.at[..., 0].set(jnp.asarray(own)[:, None, :]).at[..., 1].set(0)
    pos = dict(q_positions=jnp.asarray(qpos, jnp.int32), kv_positions=jnp.asarray(kvpos, jnp.int32),
               q_segment_ids=jnp.asarray(kvseg[:, s - t:]), kv_segment_ids=jnp.asarray(kvseg))
    return q, k, v, ids, pos


def kv_fn(pos, blk, interpret, **kw):
    return jax.jit(lambda q, k, v, ids: kv.sparse_fwd_kv_outer(
        q, k, v, ids, pos["q_positions"], pos["kv_positions"], pos["q_segment_ids"],
        pos["kv_segment_ids"], block_size=blk, interpret=interpret, **kw))


def check(name, key, interpret, bsz, t, s, h, g, d, blk, topk, segments=None):
    q, k, v, ids, pos = make(key, bsz, t, s, h, g, d, blk, topk, segments)
    ro, rl = msa_ops.msa_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                   v.astype(jnp.float32), ids, block_size=blk,
                                   implementation="xla", **pos)
    ro, rl = np.asarray(ro), np.asarray(rl)
    fin = np.isfinite(rl)
    out = {"case": name}
    for label, fn in (("kv_outer", kv_fn(pos, blk, interpret)),
                      ("kv_outer_chunked", kv_fn(pos, blk, interpret, query_chunk=max(16, t // 3)))):
        o, lse = fn(q, k, v, ids)
        o, lse = np.asarray(o, np.float32), np.asarray(lse)
        out[f"{label}_o_max_err"] = float(np.max(np.abs(o - ro)))
        out[f"{label}_o_ok"] = bool(np.all(np.abs(o - ro) <= 2e-2 + 2e-2 * np.abs(ro)))
        out[f"{label}_lse_max_err"] = float(np.max(np.abs(np.where(fin, lse - rl, 0.0))))
        out[f"{label}_ok"] = bool(out[f"{label}_o_ok"] and out[f"{label}_lse_max_err"] < 2e-3
                                  and np.array_equal(np.isfinite(lse), fin)
                                  and not np.isnan(o).any())
    o1 = np.asarray(kv_fn(pos, blk, interpret)(q, k, v, ids)[0], np.float32)
    o2 = np.asarray(kv_fn(pos, blk, interpret)(q, k, v, ids)[0], np.float32)
    out["kv_outer_bitwise_repeat"] = bool(np.array_equal(o1, o2))
    print("CHECK", json.dumps(out), flush=True)
    return out


def bench(model, t, key, interpret, variants, dense):
    h, g = MODELS[model]
    q, k, v, ids, pos = make(key, 1, t, t, h, g, D, BLK, TOPK)
    p = np.arange(1, t + 1, dtype=np.float64)
    main_f = float(np.sum(4.0 * D * h * np.minimum(p, TOPK * BLK)))
    dense_f = float(np.sum(4.0 * D * h * p))
    rows = []
    add = row_adder(rows, model, t)

    for kw in variants:
        name = "kv_outer " + ",".join(f"{a}={b}" for a, b in kw.items())
        add(name, kv_fn(pos, BLK, interpret, **kw), (q, k, v, ids), main_f)
    # breakdown of the KV-outer forward in one query chunk: work list, + kernel, + combine
    def prologue(k, v, ids):
        prep = layout.prepare(k, v, pos["q_positions"], pos["kv_positions"], pos["q_segment_ids"],
                              pos["kv_segment_ids"], BLK)
        dids = layout.dedupe_ids(ids)
        return prep, dids, layout.window_starts(dids, prep.base, BLK, prep.s_pad)

    def wl(k, v, ids):
        _, dids, st = prologue(k, v, ids)
        return kv.worklist(dids, st)

    def parts(q, k, v, ids):
        prep, dids, st = prologue(k, v, ids)
        return kv._partials(q, prep.k, prep.v, dids, st, pos["q_positions"], prep.q_seg,
                            prep.kv_pos, prep.kv_seg, blk=BLK, chunk=128, rows=64,
                            interpret=interpret, num_warps=4, num_stages=2)
    add("kv_outer worklist only (1 chunk)", jax.jit(wl), (k, v, ids), main_f)
    add("kv_outer worklist+kernel (1 chunk; + a copy of the partials)", jax.jit(parts), (q, k, v, ids), main_f)
    add("kv_outer all (1 chunk)", kv_fn(pos, BLK, interpret, query_chunk=t), (q, k, v, ids), main_f)
    if dense and not interpret:
        add("cudnn_dense", jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn")), (q, k, v), dense_f)
    return rows


def probe_shapes(tiny):
    """The correctness cases of the probes: (name, make() kwargs)."""
    if tiny:
        return [("m3like", dict(bsz=1, t=200, s=200, h=8, g=2, d=32, blk=16, topk=4)),
                ("m2like_packed", dict(bsz=2, t=150, s=150, h=12, g=2, d=32, blk=16, topk=4,
                                       segments=[[60, 70, 20], [149]])),
                ("suffix", dict(bsz=1, t=40, s=170, h=4, g=2, d=32, blk=16, topk=4))]
    return [("m3", dict(bsz=1, t=4096, s=4096, h=64, g=4, d=128, blk=128, topk=16)),
            ("m2_packed", dict(bsz=2, t=3000, s=3000, h=48, g=8, d=128, blk=128, topk=16,
                               segments=[[1000, 1500, 450], [129, 2871]])),
            ("suffix_m3", dict(bsz=1, t=1000, s=5000, h=64, g=4, d=128, blk=128, topk=16)),
            ("m3_blk64", dict(bsz=1, t=2048, s=2048, h=64, g=4, d=128, blk=64, topk=16)),
            ("train", dict(bsz=1, t=4096, s=4096, h=16, g=4, d=128, blk=128, topk=16))]   # 4 heads per group


def _parse_variants(text):
    """``"a=1,b=2;c=3"`` -> [{"a": 1, "b": 2}, {"c": 3}]; raises ValueError naming the bad item."""
    variants = []
    for v in text.split(";"):
        kw = {}
        for item in filter(None, v.split(",")):
            name, eq, val = item.partition("=")
            if not eq or not name or not val.lstrip("-").isdigit():
                raise ValueError(f"variant item {item!r} is not name=integer")
            kw[name] = int(val)
        variants.append(kw)
    return variants


def _parse_cases(text):
    """``"m3:131072,m2:8192"`` -> [("m3", 131072), ("m2", 8192)]; raises ValueError naming the bad case."""
    cases = []
    for c in filter(None, text.split(",")):
        model, _, t = c.partition(":")
        if model not in MODELS or not t.isdigit() or int(t) <= 0:
            raise ValueError(f"case {c!r} is not model:T with model in {sorted(MODELS)} and T > 0")
        cases.append((model, int(t)))
    return cases


def run_probe(description, check_fn, bench_fn, default_variants, out_name, ok_keys):
    """The probes' command line: checks first (each case's error reported, not raised), then the
    timed variants per case, a JSON file under --out and a table printed last. ``description``: the
    probe's module docstring (its first paragraph is the --help text)."""
    ap = argparse.ArgumentParser(description=description.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/msa_probe", help="folder of the JSON result")
    ap.add_argument("--cases", default="m3:131072,m2:131072",
                    help=f"timed cases, model:T[,model:T] (models: {', '.join(MODELS)}); not with --tiny")
    ap.add_argument("--variants", default=default_variants,
                    help="timed launch variants: name=int[,name=int][;...] (default: %(default)s)")
    ap.add_argument("--interpret", action="store_true", help="the kernels in interpret mode (CPU)")
    ap.add_argument("--tiny", action="store_true", help="tiny check shapes and no timed cases (CPU smoke run)")
    ap.add_argument("--no-checks", action="store_true", help="the timings alone")
    ap.add_argument("--no-bench", action="store_true", help="the checks alone")
    ap.add_argument("--check-cases", default="", help="only these check cases, comma-separated (default: all)")
    args = ap.parse_args()
    try:        # bad flags end the run here, before minutes of checks
        variants, cases = _parse_variants(args.variants), _parse_cases(args.cases)
    except ValueError as e:
        ap.error(str(e))
    if args.tiny and args.cases != ap.get_default("cases"):
        ap.error("--cases is not timed with --tiny (tiny runs the checks only)")
    os.makedirs(args.out, exist_ok=True)
    dev = jax.devices()[0]
    meta = {"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            "device": getattr(dev, "device_kind", str(dev)), "jax": jax.__version__,
            "command": " ".join(sys.argv)}
    print(meta, flush=True)
    key = jax.random.PRNGKey(0)
    checks = []
    shapes = probe_shapes(args.tiny)
    wanted = [c for c in args.check_cases.split(",") if c]
    unknown = sorted(set(wanted) - {n for n, _ in shapes})
    if unknown:
        ap.error(f"--check-cases {','.join(unknown)}: not among {', '.join(n for n, _ in shapes)}")
    for name, shp in shapes:
        key, sub = jax.random.split(key)
        if args.no_checks or (wanted and name not in wanted):
            checks.append({"case": name, "skipped": True})
            continue
        try:
            checks.append(check_fn(name, sub, args.interpret, **shp))
        except Exception as e:
            checks.append({"case": name, "error": f"{type(e).__name__}: {str(e)[:400]}"})
            print("CHECK", json.dumps(checks[-1]), flush=True)
    rows = []
    if not args.tiny and not args.no_bench:
        for model, t in cases:
            key, sub = jax.random.split(key)
            rows += bench_fn(model, t, sub, args.interpret, variants, dense=True)
    with open(os.path.join(args.out, out_name), "w") as f:
        json.dump({"meta": meta, "checks": checks, "rows": rows}, f, indent=1)
    print("\nchecks:", [(c["case"],) + tuple(c.get(k) for k in ok_keys) + (c.get("error"),) for c in checks])
    print("model | T | variant | ms | TFLOP/s")
    for r in rows:
        print(f"{r['model']} | {r['T']} | {r['variant']} | {r.get('ms', float('nan')):.2f} | "
              f"{r.get('tflops', float('nan')):.1f} {r.get('error', '')[:80]}"
              + (f" variant_ok={r['variant_ok']}" if "variant_ok" in r else ""))


def main():
    run_probe(__doc__, check, bench,
              "rows=64,num_warps=4;rows=128,num_warps=8;rows=64,num_warps=4,chunk=256",
              "msa_fwd_probe.json", ("kv_outer_ok", "kv_outer_chunked_ok", "kv_outer_bitwise_repeat"))


if __name__ == "__main__":
    main()
