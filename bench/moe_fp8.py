"""FP8-kept experts vs bf16 experts: time and memory of one MoE layer's expert computation (issue 29).

Usage (GPU):  PYTHONUNBUFFERED=1 python3 bench/moe_fp8.py --out $OUT
CPU smoke run (tiny shapes, interpret-mode kernels; timings mean nothing there):
    python bench/moe_fp8.py --tiny --out /tmp/moe_fp8

Per expert shape (``--models``: M2 = 256 experts of 3072 x 1536, top-8; M3 = 128 of 6144 x 3072, top-4) and
tokens per step (``--tokens``: decode batches and a prefill chunk), the forward of ``moe_experts`` with:
- ``bf16_auto``: bf16 experts, ``implementation="auto"`` (decode sizes run ``xla_dense``, prefill ``pallas_gpu``);
- ``bf16_pallas``: bf16 experts, the grouped Pallas kernels;
- ``fp8_dequant``: FP8 experts dequantised for the whole layer inside the step, then what ``auto`` ran before the
  in-kernel path (``xla_dense`` at decode sizes, ``pallas_gpu`` beyond);
- ``fp8_kernel``: FP8 experts, ``auto`` (the grouped kernel dequantising each weight tile: ``gpu_gmm.gmm_fp8``).
Check first (per model, at the smallest and largest token count): ``fp8_kernel`` against ``bf16_pallas`` on the
dequantised weights (relative Frobenius error, pass < 1e-2; the path each ran is printed from the ops report).
Rows: median ms of ``--reps`` calls after a warm-up, the layer's weight bytes, the compiled step's temporary bytes
(``memory_analysis``: the dequantised copy shows there) and ``vs_bf16_auto``; ``device_memory``: the allocator's
bytes in use added by the FP8 experts (with the step's inputs) and by their bf16 copy (GPU only). A wall-clock budget
(``--budget-s``) stops starting new cases; skipped cases are listed. Writes ``moe_fp8.json`` and prints a table.
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

from minimax_jax.ops import moe  # noqa: E402
from minimax_jax.ops.moe import Fp8Weight  # noqa: E402
from minimax_jax.ops.moe.fp8_weight import FP8_DTYPE, scale_shape  # noqa: E402
from minimax_jax.ops.registry import clear_implementation_report, implementation_report  # noqa: E402

SHAPES = {"m2": dict(h=3072, i=1536, e=256, k=8), "m3": dict(h=6144, i=3072, e=128, k=4)}
TINY = {"m2": dict(h=256, i=128, e=8, k=2), "m3": dict(h=256, i=256, e=4, k=2)}
VARIANTS = ("bf16_auto", "bf16_pallas", "fp8_dequant", "fp8_kernel")
MAX_REL_ERR = 1e-2


def _act(g):
    a, b = jnp.split(g.astype(jnp.float32), 2, axis=-1)
    return (jax.nn.silu(a) * b).astype(g.dtype)


def _fp8(key, shape, fan_in):
    """Random FP8 e4m3 weight with per-128x128-block scales (values ~ N(0, 1/fan_in))."""
    k1, k2 = jax.random.split(key)
    w = jax.random.normal(k1, shape, jnp.float32).astype(FP8_DTYPE)
    s = jax.random.uniform(k2, scale_shape(shape), jnp.float32, 0.5, 1.5) / np.sqrt(fan_in)
    return Fp8Weight(w, s)


def _problem(s, tokens, seed):
    ks = jax.random.split(jax.random.key(seed), 4)
    h, i, e, k = s["h"], s["i"], s["e"], s["k"]
    x = jax.random.normal(ks[0], (tokens, h), jnp.bfloat16)
    router = jax.random.normal(ks[1], (h, e), jnp.float32) / np.sqrt(h)
    w, ex, _ = jax.jit(moe.route, static_argnums=3)(x, router, jnp.zeros((e,), jnp.float32), k)
    wi, wo = _fp8(ks[2], (e, h, 2 * i), h), _fp8(ks[3], (e, i, h), i)
    return x, w, ex, wi, wo


def _fn(variant, tokens, e, interpret):
    """f(x, w, ex, wi, wo) for a variant; wi / wo are the FP8 weights or their bf16 copies (see main)."""
    pallas = "pallas_gpu_interpret" if interpret else "pallas_gpu"
    decode = tokens * e <= moe.DENSE_MAX_TOKENS_X_EXPERTS
    impl = {"bf16_auto": "auto", "bf16_pallas": pallas, "fp8_kernel": pallas if interpret else "auto",
            "fp8_dequant": "xla_dense" if decode else pallas}[variant]

    def f(x, w, ex, wi, wo):
        if variant == "fp8_dequant":
            wi, wo = wi.astype(x.dtype), wo.astype(x.dtype)
        return moe.moe_experts(x, w, ex, wi, wo, _act, implementation=impl)
    return jax.jit(f)


def _time(f, args, reps):
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def _nbytes(*ws):
    return int(sum(w.nbytes if isinstance(w, Fp8Weight) else w.size * w.dtype.itemsize for w in ws))


def _in_use() -> int | None:
    """Bytes the first device's allocator holds (None where the backend reports none, e.g. the CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_in_use")


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="m2,m3")
    p.add_argument("--tokens", default="1,8,32,128,512,8192")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=400.0)
    p.add_argument("--tiny", action="store_true", help="tiny shapes, interpret-mode kernels (CPU smoke run)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown variants {bad}; choose from {list(VARIANTS)}")
    models = [m for m in args.models.split(",") if m]
    if any(m not in SHAPES for m in models):
        p.error(f"--models: choose from {list(SHAPES)}")
    tokens = [int(t) for t in args.tokens.split(",") if t]
    interpret = args.tiny or jax.default_backend() != "gpu"
    if interpret and not args.tiny:
        p.error(f"no GPU here (backend {jax.default_backend()}): pass --tiny for the CPU smoke run")
    reps = 2 if args.tiny else args.reps
    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()
    res = {"info": {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind), "tiny": args.tiny,
                    "argv": sys.argv[1:]}, "checks": [], "rows": [], "device_memory": [], "skipped": []}
    print(f"jax {jax.__version__} on {res['info']['device']}; models {models}, tokens {tokens}", flush=True)
    for model in models:
        s = (TINY if args.tiny else SHAPES)[model]
        for t in tokens:
            if time.perf_counter() - t_start > args.budget_s:
                res["skipped"].append(f"{model} x {t}")
                continue
            used0 = _in_use()
            x, w, ex, wi8, wo8 = _problem(s, t, 0)
            used8 = _in_use()
            wi16, wo16 = jax.block_until_ready(tuple(jax.jit(lambda q: q.astype(jnp.bfloat16))(q) for q in (wi8, wo8)))
            used16 = _in_use()
            if None not in (used0, used8, used16):   # device memory the layer's experts take (GPU allocator)
                res["device_memory"].append({"model": model, "tokens": t, "fp8_bytes": used8 - used0,
                                             "bf16_bytes": used16 - used8})
                print(f"{model} x {t}: device memory of the experts: FP8 {(used8 - used0) / 2**30:.2f} GiB (with "
                      f"the step's inputs), bf16 {(used16 - used8) / 2**30:.2f} GiB", flush=True)
            if t in (tokens[0], tokens[-1]):
                got = {}
                for v, ws in (("fp8_kernel", (wi8, wo8)), ("bf16_pallas", (wi16, wo16))):
                    clear_implementation_report()
                    got[v] = _fn(v, t, s["e"], interpret)(x, w, ex, *ws)
                    got[v + "_ran"] = {k: r for k, r in implementation_report().items() if k.startswith(("moe", "grouped"))}
                err = _rel(got["fp8_kernel"], got["bf16_pallas"])
                row = {"model": model, "tokens": t, "rel_err": err, "ok": err < MAX_REL_ERR,
                       "fp8_ran": got["fp8_kernel_ran"], "bf16_ran": got["bf16_pallas_ran"]}
                res["checks"].append(row)
                print(f"check {model} x {t}: rel err {err:.2e} {'ok' if row['ok'] else 'FAILED'}; fp8 ran "
                      f"{row['fp8_ran']}", flush=True)
            for v in variants:
                ws = (wi8, wo8) if v.startswith("fp8") else (wi16, wo16)
                f = _fn(v, t, s["e"], interpret)
                clear_implementation_report()
                compiled = f.lower(x, w, ex, *ws).compile()
                temp = getattr(compiled.memory_analysis(), "temp_size_in_bytes", None)
                ms = _time(f, (x, w, ex, *ws), reps) * 1e3
                ran = {k: r for k, r in implementation_report().items() if k.startswith(("moe", "grouped"))}
                res["rows"].append({"model": model, "tokens": t, "variant": v, "ms": ms, "weight_bytes": _nbytes(*ws),
                                    "temp_bytes": temp, "ran": ran})
                print(f"{model} x {t:6d} {v:12s} {ms:9.3f} ms  weights {_nbytes(*ws) / 2**30:6.2f} GiB  temp "
                      f"{(temp or 0) / 2**30:6.2f} GiB  {ran}", flush=True)
            with open(os.path.join(args.out, "moe_fp8.json"), "w") as fh:
                json.dump(res, fh, indent=1)
            del x, w, ex, wi8, wo8, wi16, wo16      # freed before the next cell's memory reading
    base = {(r["model"], r["tokens"]): r["ms"] for r in res["rows"] if r["variant"] == "bf16_auto"}
    print("\n| model | tokens | " + " | ".join(f"{v} ms" for v in variants) + " | fp8_kernel vs bf16_auto |")
    print("|---|---|" + "---|" * (len(variants) + 1))
    for (model, t) in sorted({(r["model"], r["tokens"]) for r in res["rows"]}, key=lambda k: (k[0], k[1])):
        cell = {r["variant"]: r["ms"] for r in res["rows"] if (r["model"], r["tokens"]) == (model, t)}
        sp = f"{base[(model, t)] / cell['fp8_kernel']:.2f}x" if (model, t) in base and "fp8_kernel" in cell else "-"
        print(f"| {model} | {t} | " + " | ".join(f"{cell[v]:.3f}" if v in cell else "-" for v in variants)
              + f" | {sp} |")
    if res["skipped"]:
        print(f"skipped (budget): {res['skipped']}")
    with open(os.path.join(args.out, "moe_fp8.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    return 0 if all(c["ok"] for c in res["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
