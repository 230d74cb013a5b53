"""One FP8 grouped-matmul tiling at one size, in its own process (issue 29): ``gpu_gmm_fp8.gmm_fp8`` against
``gpu_gmm.gmm_forward`` on the same weights dequantised first (the bf16 kernel), relative error and median ms.

A tiling that faults on the device (an illegal address ends the process) cannot hide the others: call the
script once per tiling, e.g. ``for c in 128x64x128w8s4h 128x64x128w4s3 64x128x128w4s4; do python3
bench/gmm_fp8_probe.py --config $c; done``. Rows are M2's first expert matmul at 8K tokens by default
(65,536 rows, 256 experts, [3072, 3072] weights in 128 x 128 scale blocks), routed uniformly at random.

CPU plumbing (interpret mode, tiny): ``python bench/gmm_fp8_probe.py --interpret``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.common import needs_byte_pairs  # noqa: E402
from pallas_kernels.moe.gpu_gmm import TileConfig, gmm_forward  # noqa: E402
from pallas_kernels.moe.gpu_gmm_fp8 import fp8_config, gmm_fp8  # noqa: E402


def parse_config(label: str) -> TileConfig:
    """``TileConfig`` from its label, e.g. ``128x64x128w8s4h`` (h: half_tail; ``fold64``: fold = 64)."""
    fold = 0
    if "fold" in label:
        label, f = label.split("fold")
        fold = int(f)
    half = label.endswith("h")
    label = label.rstrip("h")
    dims, rest = label.split("w")
    warps, stages = rest.split("s")
    bm, bk, bn = (int(x) for x in dims.split("x"))
    return TileConfig(bm, bk, bn, int(warps), int(stages), half_tail=half, fold=fold)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="", help="tile label (default: fp8_config's choice for these rows)")
    ap.add_argument("--rows", type=int, default=65536)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--k", type=int, default=3072)
    ap.add_argument("--n", type=int, default=3072)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--interpret", action="store_true")
    a = ap.parse_args()
    if a.interpret:
        a.rows, a.experts, a.k, a.n, a.reps = 300, 4, 256, 256, 1
    cfg = parse_config(a.config) if a.config else fp8_config(a.rows, a.experts)
    ks = jax.random.split(jax.random.key(0), 4)
    lhs = jax.random.normal(ks[0], (a.rows, a.k), jnp.bfloat16)
    w8 = jax.random.normal(ks[1], (a.experts, a.k, a.n), jnp.float32).astype(jnp.float8_e4m3fn)
    scale = jax.random.uniform(ks[2], (a.experts, -(-a.k // 128), -(-a.n // 128)), jnp.float32, 0.5, 1.5) / a.k ** 0.5
    sizes = np.bincount(np.random.default_rng(0).integers(0, a.experts, a.rows), minlength=a.experts)
    sizes = jnp.asarray(sizes, jnp.int32)
    s = jnp.repeat(jnp.repeat(scale, 128, axis=1)[:, :a.k], 128, axis=2)[:, :, :a.n]
    w16 = (w8.astype(jnp.float32) * s).astype(jnp.bfloat16)
    f8 = jax.jit(lambda x, w, sc, gs: gmm_fp8(x, w, sc, gs, config=cfg, interpret=a.interpret))
    f16 = jax.jit(lambda x, w, gs: gmm_forward(x, w, gs, interpret=a.interpret))
    print(f"config {cfg.label()}: rows {a.rows}, experts {a.experts}, [{a.k}, {a.n}], weights read as byte pairs: "
          f"{needs_byte_pairs(w8)}", flush=True)
    y8 = np.asarray(jax.block_until_ready(f8(lhs, w8, scale, sizes)), np.float64)
    y16 = np.asarray(jax.block_until_ready(f16(lhs, w16, sizes)), np.float64)
    err = float(np.linalg.norm(y8 - y16) / max(np.linalg.norm(y16), 1e-30))
    print(f"non-finite: fp8 {int((~np.isfinite(y8)).sum())}, bf16 kernel {int((~np.isfinite(y16)).sum())} of "
          f"{y8.size}; first non-finite fp8 rows {np.unique(np.nonzero(~np.isfinite(y8))[0])[:8].tolist()}", flush=True)
    try:                                                   # XLA's grouped matmul on the same bf16 weights
        ref = np.asarray(jax.jit(lambda x, w, gs: jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32))(
            lhs, w16, sizes), np.float64)
        rel = lambda y: float(np.linalg.norm(np.nan_to_num(y - ref)) / max(np.linalg.norm(ref), 1e-30))
        print(f"finite-part rel err vs xla ragged_dot: fp8 {rel(y8):.2e}, bf16 kernel {rel(y16):.2e}", flush=True)
    except Exception as e:   # XLA's GPU ragged_dot autotuner fails at some sizes: report and go on
        print(f"xla ragged_dot reference failed: {type(e).__name__}: {str(e)[:120]}", flush=True)

    def med(f, *args):
        ts = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e3
    ms8, ms16 = med(f8, lhs, w8, scale, sizes), med(f16, lhs, w16, sizes)
    tflop = 2.0 * a.rows * a.k * a.n / 1e12
    print(f"RESULT {cfg.label()} | rel err {err:.2e} | fp8 {ms8:.3f} ms ({tflop / ms8 * 1e3:.0f} TFLOP/s) | "
          f"bf16 kernel {ms16:.3f} ms ({tflop / ms16 * 1e3:.0f} TFLOP/s) | {'ok' if err < 1e-2 else 'WRONG'}",
          flush=True)


if __name__ == "__main__":
    main()
