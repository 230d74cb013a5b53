"""How long the MoE grouped matmuls take on the device, three ways, and where a call's time goes.

    PYTHONUNBUFFERED=1 python3 bench/moe_timing.py --out $OUT/moe_timing            (GPU)
    python bench/moe_timing.py --tiny --out /tmp/moe_timing                           (CPU smoke run)

For each model shape (``bench/moe.py``'s SHAPES, 8K tokens by default) and each of bench/moe.py's
``pallas_gpu_gmm`` (both grouped matmuls with the gated activation between) and ``dense_matmul`` (matmuls of
the same FLOPs), forward and forward+backward:

- ``synced``: the median of single calls, each waited for (``block_until_ready``): what bench/moe.py
  reports; it includes the host's dispatch and the wait's round trip;
- ``pipelined``: ``--reps`` calls dispatched back to back, waited for once, divided by the count (the
  host's dispatch overlaps the previous call's device work, as in a training step);
- ``device``: one call under ``jax.profiler``: the span from its first kernel's start to its last
  kernel's end, the busy time (sum of kernel durations) and the largest idle gaps between kernels,
  with the kernels on each side.

Then (GPU only, ``--mgpu``) JAX's Mosaic GPU example kernel for the weight gradient
(``jax.experimental.pallas.ops.gpu.transposed_ragged_dot_mgpu``: persistent, TMA + wgmma) next to the
project's Triton-lowered tgmm at the M2 first projection, same inputs: relative error vs ours and pipelined
time, for a few of its tile configs. The example ships with JAX; it is timed here to see what a
Mosaic GPU weight-gradient kernel reaches on this chip, not used by the project.

TFLOP/s count 6*T*k*H*I forward, 3x that forward+backward (as bench/moe.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe as moe_bench  # noqa: E402  (bench/moe.py: shapes, problems, variants)
from trace_summary import line_names, load_events, newest_trace  # noqa: E402

from minimax_jax.ops.moe.permute import permute_rows, sort_by_expert  # noqa: E402
from pallas_kernels.moe import gpu_gmm  # noqa: E402


# the variants of bench/moe.py this script can time (the tokamax ones need tokamax, the others a Pallas backend)
TIMED_VARIANTS = ("pallas_gpu_gmm", "dense_matmul", "pallas_gpu")


def _pipelined(f, args, reps):
    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):      # each result replaces the last (its buffers are freed once that call ran)
            out = f(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t) / reps)
        del out
    return best


def _device_events(pdir):
    """Complete events of the device processes, sorted by start: (ts_us, dur_us, name, line)."""
    events = load_events(newest_trace(pdir))
    procs, threads = line_names(events)
    out = [(float(e["ts"]), float(e["dur"]), e.get("name", "?"), threads.get((e["pid"], e.get("tid")), ""))
           for e in events if e.get("ph") == "X" and "dur" in e and procs.get(e.get("pid"), "").startswith("/device:")]
    return sorted(out)


def _device(f, args, out_dir, tag):
    """One call under the profiler: span, busy, the 6 largest gaps (us) between device events."""
    jax.block_until_ready(f(*args))
    pdir = os.path.join(out_dir, f"profile_{tag}")
    with jax.profiler.trace(pdir, create_perfetto_trace=True):
        jax.block_until_ready(f(*args))
    ev = _device_events(pdir)
    if not ev:
        return {"error": "no device events (CPU run)"}
    # the busiest line holds the kernels (other device lines repeat them as XLA ops / modules)
    lines = {}
    for e in ev:
        lines[e[3]] = lines.get(e[3], 0.0) + e[1]
    line = max(lines, key=lines.get)
    ev = [e for e in ev if e[3] == line]
    start, end = ev[0][0], max(e[0] + e[1] for e in ev)
    gaps, prev_end, prev_name = [], ev[0][0] + ev[0][1], ev[0][2]
    for ts, dur, name, _ in ev[1:]:
        if ts > prev_end:
            gaps.append((ts - prev_end, prev_name, name))
        if ts + dur >= prev_end:
            prev_end, prev_name = ts + dur, name
    gaps.sort(reverse=True)
    by_name = {}
    for e in ev:
        by_name[e[2]] = by_name.get(e[2], 0.0) + e[1]
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
    return {"line": line, "kernels_ms": [(n[:40], round(t / 1e3, 3)) for n, t in top],
            "span_ms": (end - start) / 1e3, "busy_ms": sum(e[1] for e in ev) / 1e3,
            "kernels": len(ev), "idle_ms": sum(g[0] for g in gaps) / 1e3,
            "largest_gaps_us": [(round(g[0], 1), g[1][:40], g[2][:40]) for g in gaps[:6]]}


def timing_rows(shapes, tokens, reps, out_dir, names=("pallas_gpu_gmm", "dense_matmul")):
    variants = moe_bench._variants(False, "pallas_gpu" if jax.default_backend() == "gpu" else "pallas_gpu_interpret")
    rows = []
    for model, s in shapes.items():
        for name in names:
            kind, fns = variants[name]
            args = moe_bench._case_args(s, tokens, tokens, kind, jnp.bfloat16)
            for mode, fn in zip(("fwd", "fwd+bwd"), fns):
                f = jax.jit(fn)
                flops = 6.0 * tokens * s["k"] * s["h"] * s["i"] * (3.0 if mode == "fwd+bwd" else 1.0)
                row = {"model": model, "tokens": tokens, "variant": name, "mode": mode,
                       "synced_ms": 1e3 * moe_bench._timeit(f, args, reps, budget_s=float("inf"))[0],
                       "pipelined_ms": 1e3 * _pipelined(f, args, reps)}
                row.update(_device(f, args, out_dir, f"{model}_{name}_{mode.replace('+', '')}"))
                for k in ("synced", "pipelined", "span", "busy"):
                    if f"{k}_ms" in row:
                        row[f"{k}_tflop_s"] = flops / row[f"{k}_ms"] / 1e9
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def mgpu_rows(tokens, reps):
    """JAX's Mosaic GPU transposed ragged dot vs the project's tgmm (M2 first projection)."""
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as trd  # noqa: PLC0415

    s = moe_bench.SHAPES["m2"]
    x, w, ex, wi, wo, cot = moe_bench._problem(s, tokens, jnp.bfloat16, seed=tokens)
    order, inv, gs = sort_by_expert(ex, s["e"])
    xs = permute_rows(x, order, inv)
    dh = jax.random.normal(jax.random.key(7), (xs.shape[0], 2 * s["i"]), jnp.bfloat16)
    flops = 2.0 * xs.shape[0] * s["h"] * 2 * s["i"]
    ours = jax.jit(lambda a, b, g: gpu_gmm.tgmm(a, b, g))
    ref = ours(xs, dh, gs).astype(jnp.float32)
    rows = [{"kernel": "tgmm (ours, " + gpu_gmm.DEFAULT_TGMM_CONFIG.label() + ")",
             "pipelined_ms": 1e3 * _pipelined(ours, (xs, dh, gs), reps)}]
    configs = [dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1),
               dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=4),
               dict(block_m=128, block_n=128, block_k=128, max_concurrent_steps=2, grid_block_n=4),
               dict(block_m=64, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=4),
               dict(block_m=128, block_n=64, block_k=64, max_concurrent_steps=5, grid_block_n=8)]
    for cfg in configs:
        row = {"kernel": "jax mgpu transposed_ragged_dot", **cfg}
        try:
            f = jax.jit(lambda a, b, g, cfg=cfg: trd.transposed_ragged_dot(a, b, group_sizes=g, **cfg))
            out = f(xs, dh, gs).astype(jnp.float32)
            row["rel_err_vs_ours"] = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
            row["pipelined_ms"] = 1e3 * _pipelined(f, (xs, dh, gs), reps)
        except Exception as e:  # a config that does not compile: recorded
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
    for r in rows:
        if "pipelined_ms" in r:
            r["tflop_s"] = flops / r["pipelined_ms"] / 1e9
        print(json.dumps(r), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/moe_timing", help="folder for moe_timing.json and the profiles")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run (tiny shapes, interpret-mode kernels)")
    ap.add_argument("--tokens", type=int, default=None, help="default 8192 (--tiny: 64)")
    ap.add_argument("--models", default="m2,m3", help="comma-separated subset of m2,m3")
    ap.add_argument("--variants", default="pallas_gpu_gmm,dense_matmul",
                    help="comma-separated subset of " + ",".join(TIMED_VARIANTS) + " (bench/moe.py's variants)")
    ap.add_argument("--reps", type=int, default=10, help="calls per synced / back-to-back measurement")
    ap.add_argument("--mgpu", action="store_true", help="also time JAX's Mosaic GPU transposed ragged dot (GPU)")
    args = ap.parse_args()
    bad = sorted(set(args.variants.split(",")) - set(TIMED_VARIANTS))
    if bad:
        ap.error(f"--variants: unknown {bad}; choose from {TIMED_VARIANTS}")
    if args.tokens is not None and args.tokens < 1:
        ap.error(f"--tokens must be >= 1, got {args.tokens}")
    if args.reps < 1:
        ap.error(f"--reps must be >= 1, got {args.reps}")
    if args.mgpu and jax.default_backend() != "gpu":
        print(f"--mgpu skipped: JAX's Mosaic GPU kernel needs a GPU backend, not {jax.default_backend()!r}", flush=True)
    shapes = moe_bench.TINY if args.tiny else moe_bench.SHAPES
    unknown = set(args.models.split(",")) - set(shapes)
    if unknown:
        ap.error(f"--models: unknown {sorted(unknown)}; choose from {sorted(shapes)}")
    shapes = {k: shapes[k] for k in args.models.split(",")}
    tokens = args.tokens if args.tokens is not None else (64 if args.tiny else 8192)
    os.makedirs(args.out, exist_ok=True)
    info = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "pallas_configs": {k: v.label() for k, v in gpu_gmm.DEFAULT_CONFIGS.items()}}
    print(json.dumps(info), flush=True)
    extra = mgpu_rows(tokens, args.reps) if args.mgpu and jax.default_backend() == "gpu" else []
    rows = timing_rows(shapes, tokens, args.reps, args.out, args.variants.split(","))
    with open(os.path.join(args.out, "moe_timing.json"), "w") as f:
        json.dump({"info": info, "rows": rows, "mgpu": extra}, f, indent=1)
    print(f"\n{'model':5} {'variant':15} {'mode':8} {'synced':>8} {'pipelined':>9} {'span':>8} {'busy':>8} "
          f"{'idle':>7}   (ms; TFLOP/s synced / pipelined / span)")
    for r in rows:
        print(f"{r['model']:5} {r['variant']:15} {r['mode']:8} {r['synced_ms']:8.3f} {r['pipelined_ms']:9.3f} "
              f"{r.get('span_ms', float('nan')):8.3f} {r.get('busy_ms', float('nan')):8.3f} "
              f"{r.get('idle_ms', float('nan')):7.3f}   {r['synced_tflop_s']:.0f} / {r['pipelined_tflop_s']:.0f} / "
              f"{r.get('span_tflop_s', float('nan')):.0f}")
    for r in rows:
        if r.get("kernels_ms"):
            print(f"{r['model']} {r['variant']} {r['mode']}: kernels (ms): {r['kernels_ms']}")
    for r in rows:
        if r.get("largest_gaps_us"):
            print(f"{r['model']} {r['variant']} {r['mode']}: largest gaps (us, before, after): {r['largest_gaps_us']}")


if __name__ == "__main__":
    main()
