"""Where the Hopper MSA forward's time goes: timed calls and a ``jax.profiler`` breakdown (work-list sort,
kernel, combine) at M3 shapes (issue 26).

Runs ``gpu_sparse_fwd_wgmma.sparse_fwd_wgmma`` at M3 shapes (64 / 4 heads of 128, block 128, top-16,
``bench/msa_fwd_probe.make``'s block ids: own block, block 0, the rest uniform over visible blocks) on
one sequence of ``--t`` tokens: ``--calls`` timed calls after one warm-up (best ms and TFLOP/s of useful
FLOPs), then, with ``--profile DIR``, two calls under ``jax.profiler.trace`` summarised by
``bench/trace_summary.py`` (ms per call by device op). The kernel is named ``msa_sparse_fwd_wgmma``
(CUDA symbol ``msa_sparse_fwd_wgmma_mosaic_gpu_kernel``); one call launches it once per query pass.

Nsight Compute: ``ncu -k regex:msa_sparse_fwd_wgmma`` profiled nothing here ("No kernels were profiled": the
kernel runs inside an XLA command buffer, a CUDA graph with conditional nodes); turning command buffers off
(``XLA_FLAGS=--xla_gpu_enable_command_buffer=``) should expose it (not tried yet).

CPU plumbing (Mosaic GPU interpreter, tiny): ``python bench/msa_fwd_profile.py --interpret``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench.msa_fwd_probe import BLK, D, MODELS, TOPK, make  # noqa: E402
from bench.trace_summary import format_summary, load_events, newest_trace, summarize  # noqa: E402
from pallas_kernels.msa.gpu_sparse_fwd_wgmma import sparse_fwd_wgmma  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--t", type=int, default=131072, help="tokens (queries = keys, causal)")
    ap.add_argument("--calls", type=int, default=3, help="timed calls after one warm-up call")
    ap.add_argument("--profile", default="", help="folder for a jax.profiler trace of two more calls")
    ap.add_argument("--interpret", action="store_true", help="Mosaic GPU interpreter, 512 tokens (CPU)")
    a = ap.parse_args()
    t = 512 if a.interpret else a.t
    if t < BLK or a.calls < 0:
        ap.error(f"--t must be >= {BLK} and --calls >= 0")
    h, g = MODELS["m3"]
    q, k, v, ids, pos = make(jax.random.PRNGKey(0), 1, t, t, h, g, D, BLK, TOPK)
    p = np.arange(1, t + 1, dtype=np.float64)
    flops = float(np.sum(4.0 * D * h * np.minimum(p, TOPK * BLK)))
    fn = jax.jit(lambda q, k, v, ids: sparse_fwd_wgmma(
        q, k, v, ids, pos["q_positions"], pos["kv_positions"], pos["q_segment_ids"], pos["kv_segment_ids"],
        block_size=BLK, interpret=a.interpret))
    o, lse = jax.block_until_ready(fn(q, k, v, ids))                      # compile + warm-up
    ok = bool(np.isfinite(np.asarray(o, np.float32)).all() and np.isfinite(np.asarray(lse)).all())
    print(f"warm-up call: o {tuple(o.shape)} finite {ok}", flush=True)
    if not ok:
        raise SystemExit("the forward wrote non-finite values")
    best = float("inf")
    for _ in range(a.calls):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(q, k, v, ids))
        best = min(best, (time.perf_counter() - t0) * 1e3)
    if a.calls:
        print(f"best of {a.calls} calls: {best:.2f} ms, {flops / best / 1e9:.1f} TFLOP/s (T={t})", flush=True)
    if a.profile:
        with jax.profiler.trace(a.profile, create_perfetto_trace=True):
            for _ in range(2):
                jax.block_until_ready(fn(q, k, v, ids))
        print(format_summary(summarize(load_events(newest_trace(a.profile)), top=12, steps=2)), flush=True)

if __name__ == "__main__":
    main()
