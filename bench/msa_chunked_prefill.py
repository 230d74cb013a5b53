"""Serving-case prefill (issue 26): one layer's chunked prefill of ``--chunk`` new tokens over a paged
prefix of ``--prefix`` cached tokens, MSA (gather + index selection + sparse attention) vs the dense
prefill path (gather + suffix attention), through the decode engine's own per-layer attention
(``minimax_jax.decode.step._attend_gather``), time per chunk, in one run.

Usage (GPU machine):  PYTHONUNBUFFERED=1 python3 bench/msa_chunked_prefill.py --out $OUT
CPU smoke run:        python bench/msa_chunked_prefill.py --tiny --out /tmp/cp

Shapes: M3 (64 q heads, 4 kv heads, D = Di = 128, page = block 128, top-16) or M2 (48 / 8); bf16
pages in a shuffled page table. The check (first, smaller) compares both paths with the XLA
reference implementation of the same ops. Writes msa_chunked_prefill.json under --out; prints a
table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from minimax_jax.decode.step import _attend_gather  # noqa: E402

MODELS = {"m3": (64, 4), "m2": (48, 8)}


def _timeit(f, *args, reps=10):
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def make(key, model, prefix, chunk, d, page, dtype=jnp.bfloat16):
    """(cache dict, q, qi, page_table [1, NP], positions [1, chunk]) with a shuffled page table."""
    h, g = MODELS[model]
    n_pages = -(-(prefix + chunk) // page)
    ks = jax.random.split(key, 5)
    cache = {"k": jax.random.normal(ks[0], (g, n_pages, page, d), dtype),
             "v": jax.random.normal(ks[1], (g, n_pages, page, d), dtype),
             "ki": jax.random.normal(ks[2], (n_pages, page, d), dtype)}
    q = jax.random.normal(ks[3], (1, chunk, h, d), dtype)
    qi = jax.random.normal(ks[4], (1, chunk, g, d), dtype)
    table = jnp.asarray(np.random.default_rng(0).permutation(n_pages)[None], jnp.int32)
    pos = jnp.arange(prefix, prefix + chunk, dtype=jnp.int32)[None]
    return cache, q, qi, table, pos


def layer_fn(layer_type, page, topk, impl):
    cfg = types.SimpleNamespace(index_topk=topk, index_init_blocks=0, index_local_blocks=1, sliding_window=None)
    spec = types.SimpleNamespace(page_size=page)
    return jax.jit(lambda c, q, qi, t, p: _attend_gather(cfg, spec, c, q, qi, t, p, layer_type, impl))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/msa_chunked_prefill")
    ap.add_argument("--models", default="m3,m2")
    ap.add_argument("--prefix", type=int, default=122880)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--impl", default="pallas_gpu", help="MSA / prefill implementation (the engine's)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke: tiny shapes, interpret-mode kernels")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    d, page, topk = (32, 16, 4) if args.tiny else (128, 128, 16)
    impl = "pallas_gpu_interpret" if args.tiny else args.impl
    prefix, chunk = (96, 32) if args.tiny else (args.prefix, args.chunk)
    dev = jax.devices()[0]
    meta = {"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            "device": getattr(dev, "device_kind", str(dev)), "jax": jax.__version__,
            "command": " ".join(sys.argv), "prefix": prefix, "chunk": chunk, "impl": impl}
    print(meta, flush=True)
    checks, rows = [], []
    key = jax.random.PRNGKey(0)
    for model in args.models.split(","):
        # check: both paths against the XLA reference of the same ops, on a smaller prefix
        key, sub = jax.random.split(key)
        cp, cc = (prefix, chunk) if args.tiny else (3000, 1000)
        case = make(sub, model, cp, cc, d, page)
        for lt in ("msa", "full"):
            got = np.asarray(layer_fn(lt, page, topk, impl)(*case), np.float32)
            ref = np.asarray(layer_fn(lt, page, topk, "xla")(*case), np.float32)
            err = float(np.max(np.abs(got - ref)))
            checks.append({"model": model, "layer": lt, "max_err": err, "ok": bool(err < 3e-2)})
            print("CHECK", json.dumps(checks[-1]), flush=True)
        key, sub = jax.random.split(key)
        case = make(sub, model, prefix, chunk, d, page)
        for name, lt in (("MSA (gather + select + sparse attention)", "msa"),
                         ("dense (gather + suffix attention)", "full")):
            r = {"model": model, "prefix": prefix, "chunk": chunk, "path": name}
            try:
                r["ms"] = _timeit(layer_fn(lt, page, topk, impl), *case, reps=2 if args.tiny else 10)
            except Exception as e:   # report (compile error, out of memory) and go on
                r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print("ROW", json.dumps(r), flush=True)
            rows.append(r)
    with open(os.path.join(args.out, "msa_chunked_prefill.json"), "w") as f:
        json.dump({"meta": meta, "checks": checks, "rows": rows}, f, indent=1)
    print("\nchecks:", [(c["model"], c["layer"], c["ok"]) for c in checks])
    print("model | prefix | chunk | path | ms per chunk")
    for r in rows:
        print(f"{r['model']} | {r['prefix']} | {r['chunk']} | {r['path']} | {r.get('ms', float('nan')):.2f} "
              f"{r.get('error', '')[:80]}")


if __name__ == "__main__":
    main()
