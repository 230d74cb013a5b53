"""FP8-kept dense projections (``minimax_jax.ops.linear``): the in-kernel dequantising FP8 kernel vs XLA's dequantised
copy vs the bf16 matmul (cuBLAS), at the attention projections of M2 / M3 and decode-to-prefill row counts (issue 29).

Usage (GPU):  PYTHONUNBUFFERED=1 python3 bench/linear_fp8.py --out $OUT
CPU smoke run (tiny shapes, the kernel in interpret mode; timings mean nothing there):
    python bench/linear_fp8.py --tiny --out /tmp/linear_fp8

Per weight (``--models``; M2: q / k / o_proj 3072 x 6144, 3072 x 1024, 6144 x 3072; M3: q / k / o_proj 6144 x 8192,
6144 x 512, 8192 x 6144 and the dense MLP's 6144 x 24576) and rows per call (``--rows``):
- ``bf16``: ``x @ w`` with the weight in bf16 (XLA: cuBLAS), the baseline;
- ``fp8_xla``: ``linear(..., implementation="xla")``: the FP8 weight dequantised by XLA in the step, then the matmul;
- ``fp8_kernel``: ``linear(..., implementation="pallas_gpu")``: ``gmm_fp8`` with one group, reading the FP8 bytes.
Check first, per weight at the smallest and largest row count: ``fp8_kernel`` vs ``fp8_xla`` (relative Frobenius
error, pass < 1e-2). Timing: one jitted program runs ``--chain`` calls, each input depending on the previous output
(XLA cannot merge them into one matmul), median of ``--reps`` programs, divided by ``--chain``. Rows: microseconds per
call, the weight bytes each variant reads (FP8 or bf16) over that time (GB/s), and ``vs_bf16``. Writes
``linear_fp8.json`` and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from minimax_jax.ops.linear import linear  # noqa: E402
from minimax_jax.ops.registry import clear_implementation_report, implementation_report  # noqa: E402
from moe_fp8 import _fp8, _rel, _time  # noqa: E402

SHAPES = {"m2": {"q_proj": (3072, 6144), "k_proj": (3072, 1024), "o_proj": (6144, 3072)},
          "m3": {"q_proj": (6144, 8192), "k_proj": (6144, 512), "o_proj": (8192, 6144), "mlp_wi": (6144, 24576)}}
TINY = {"m2": {"q_proj": (256, 384)}, "m3": {"o_proj": (384, 256)}}
VARIANTS = ("bf16", "fp8_xla", "fp8_kernel")
MAX_REL_ERR = 1e-2


def _chain(variant, chain, interpret):
    """jit(f)(x, w) running ``chain`` dependent calls; returns the last output."""
    impl = {"fp8_xla": "xla", "fp8_kernel": "pallas_gpu_interpret" if interpret else "pallas_gpu"}.get(variant)

    def one(x, w):
        return x @ w if variant == "bf16" else linear(x, w, implementation=impl)

    def f(x, w):
        out = one(x, w)
        for _ in range(chain - 1):
            # a real dependency on the previous output (no merging), numerically negligible
            out = one(x + (out[:, :1] * 1e-30).astype(x.dtype), w)
        return out
    return jax.jit(f)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="m2,m3")
    p.add_argument("--rows", default="1,8,64,256,1024")
    p.add_argument("--chain", type=int, default=16)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--tiny", action="store_true", help="tiny shapes, the kernel in interpret mode (CPU smoke run)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    rows_list = [int(r) for r in a.rows.split(",")]
    chain = 2 if a.tiny else a.chain
    dev = jax.devices()[0]
    print(f"jax {jax.__version__} on {dev.device_kind} ({jax.default_backend()})", flush=True)
    checks, results = [], []
    for model in a.models.split(","):
        for wi, (name, (k, n)) in enumerate((TINY if a.tiny else SHAPES)[model].items()):
            w8 = _fp8(jax.random.key(wi), (k, n), k)
            wb = jax.jit(lambda w: w.astype(jnp.bfloat16))(w8)
            for i, rows in enumerate(rows_list):
                x = jax.random.normal(jax.random.key(i), (rows, k), jnp.bfloat16)
                outs = {}
                for v in VARIANTS:
                    clear_implementation_report()
                    f = _chain(v, chain, a.tiny)
                    w = wb if v == "bf16" else w8
                    us = _time(f, (x, w), 2 if a.tiny else a.reps) / chain * 1e6
                    outs[v] = f(x, w)
                    wbytes = k * n * (2 if v == "bf16" else 1)
                    results.append(dict(model=model, weight=name, k=k, n=n, rows=rows, variant=v, us=us,
                                        weight_gb_per_s=wbytes / us / 1e3, ran=implementation_report().get("linear", "xla")))
                base = next(r["us"] for r in results[-3:] if r["variant"] == "bf16")
                for r in results[-3:]:
                    r["vs_bf16"] = base / r["us"]
                if i in (0, len(rows_list) - 1):
                    err = _rel(outs["fp8_kernel"].astype(jnp.float32), outs["fp8_xla"].astype(jnp.float32))
                    checks.append(dict(model=model, weight=name, rows=rows, rel_err=err, passed=err < MAX_REL_ERR))
                    print("check", json.dumps(checks[-1]), flush=True)
                print("rows", json.dumps(results[-3:]), flush=True)
    ok = all(c["passed"] for c in checks)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "linear_fp8.json"), "w") as fh:
        json.dump(dict(device=dev.device_kind, jax=jax.__version__, chain=chain, checks=checks, rows=results,
                       check_passed=ok), fh, indent=1)
    print(f"\nlinear_fp8 (check {'passed' if ok else 'FAILED'}): us per call (weight GB/s), x = bf16 us / variant us")
    print(f"{'model':>5} {'weight':>7} {'rows':>5} " + " ".join(f"{v:>22}" for v in VARIANTS))
    for j in range(0, len(results), 3):
        rs = results[j:j + 3]
        print(f"{rs[0]['model']:>5} {rs[0]['weight']:>7} {rs[0]['rows']:>5} " + " ".join(
            f"{r['us']:>8.1f} ({r['weight_gb_per_s']:>5.0f}) {r['vs_bf16']:>4.2f}x" for r in rs))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
