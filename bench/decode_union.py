"""Device time of the constructions of the shared decode tiles' page union, outputs compared first; 200 calls in
one jitted loop, best of 5: the two XLA forms (pairwise comparisons vs a per-page bitmap;
``pallas_kernels.decode.common.union_pages`` picks the bitmap where the page table has at most U = Q x top-k pages)
and the Triton kernel (``pallas_kernels.decode.gpu_union``, one launch; GPU, or ``--interpret`` on a CPU): its
"pairwise" algorithm at each ``--kernel-warps`` count, at any U (its ``MAX_SLOTS`` bound raised for the timing),
and its "bitmap" algorithm at each ``--bitmap-warps`` count ("auto" = ``gpu_union.default_warps``) where it
serves the cell (U x padded pages <= ``BITMAP_MAX``; "-" elsewhere).

Cells are batch x context; the page table is sized as the serving sweep's (context x 1.25 / 128-token pages,
bench/msa_decode_serving.py: lengths vary +-25 % inside a batch), with random selections of top-k pages per row.

    python3 bench/decode_union.py            # M3 decode shapes: 4 kv groups, top-16, 128-token pages
    python3 bench/decode_union.py --q 8 --kernel-warps 4,16 --bitmap-warps auto,4,8,16 --cells 1x4096,8x4096,64x4096
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pallas_kernels.decode.common import union_pages  # noqa: E402
from pallas_kernels.decode.gpu_union import default_warps, union_algorithm, union_pages_gpu  # noqa: E402


def _looped(union, n_pages, calls):
    """``calls`` unions ``union(ids)`` in one jitted loop (each on ids shifted by the iteration, so none is
    hoisted): device time."""
    def run(ids):
        def body(i, acc):
            x = jnp.where(ids >= 0, (ids + i) % n_pages, -1)
            u, bits, starts = union(x)
            return acc + u[0, 0, 0, 0] + bits[0, 0, 0, 0] + starts[0, 0, 0, -1]
        return jax.lax.fori_loop(0, calls, body, jnp.zeros((), jnp.int32))
    return jax.jit(run)


def _kernel(q, nsplit, warps, interpret, algorithm="pairwise", n_pages=None):
    """The Triton union (``algorithm``) at ``warps`` warps, trimmed to ``union_pages``' shapes (pairwise at any
    width)."""
    def union(x):
        u, bits, starts = union_pages_gpu(x, q, nsplit, n_pages, interpret=interpret, num_warps=warps,
                                          max_slots=1 << 20, algorithm=algorithm)
        n = q * x.shape[-1]
        return u[..., :n], bits[..., :n], starts[..., : nsplit + 1]
    return union


def _time(fn, *args, reps=5):
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", default="64x4096,128x5120,32x10240,8x102400,32x204800", help="batch x context")
    ap.add_argument("--q", type=int, default=8, help="query rows per request (one row block)")
    ap.add_argument("--topk", type=int, default=16)
    ap.add_argument("--nsplit", type=int, default=4)
    ap.add_argument("--kernel-warps", default="", help="comma list: also time the Triton union kernel at these warps")
    ap.add_argument("--bitmap-warps", default="",
                    help="comma list: also time the bitmap union kernel at these warps ('auto' = its default)")
    ap.add_argument("--interpret", action="store_true", help="the Triton kernel in Pallas interpret mode (CPU)")
    ap.add_argument("--calls", type=int, default=200, help="unions per timed loop")
    a = ap.parse_args()
    warps = [int(w) for w in a.kernel_warps.split(",") if w]
    try:
        bwarps = [w if w == "auto" else int(w) for w in a.bitmap_warps.split(",") if w]
    except ValueError:
        ap.error(f"--bitmap-warps: {a.bitmap_warps!r} is not a comma list of ints or 'auto'")
    rng = np.random.default_rng(0)
    print(f"device {jax.devices()[0].device_kind}; Q {a.q}, top-{a.topk}, {a.nsplit} splits, 4 kv groups")
    print(f"{'cell':>12} {'pages':>6} {'pairwise ms':>12} {'bitmap ms':>10}"
          + "".join(f" {f'kernel w{w} ms':>14}" for w in warps)
          + "".join(f" {f'bitmap k w{w} ms':>16}" for w in bwarps) + " equal")
    cells = []
    for cell in a.cells.split(","):
        try:
            b, ctx = (int(x) for x in cell.split("x"))
        except ValueError:
            ap.error(f"--cells: {cell!r} is not BATCHxCONTEXT (e.g. 64x4096)")
        if b < 1 or ctx < 128:
            ap.error(f"--cells: {cell!r} needs batch >= 1 and context >= 128")
        cells.append((cell, b, ctx))
    for cell, b, ctx in cells:
        n_pages = -(-int(ctx * 1.25) // 128)
        ids = jnp.asarray(rng.integers(-1, n_pages, (b, 4, a.q, a.topk)), jnp.int32)
        pair = lambda x: union_pages(x, a.q, a.nsplit)
        bitmap = lambda x, n=n_pages: union_pages(x, a.q, a.nsplit, n)
        serves = union_algorithm(a.q, a.topk, n_pages, max_slots=0) == "bitmap"
        kw = [default_warps("bitmap", a.q * a.topk, n_pages) if w == "auto" else w for w in bwarps] if serves else []
        forms = ([pair, bitmap] + [_kernel(a.q, a.nsplit, w, a.interpret) for w in warps]
                 + [_kernel(a.q, a.nsplit, w, a.interpret, "bitmap", n_pages) for w in kw])
        want = jax.jit(pair)(ids)
        same = all(bool(jnp.array_equal(u, v)) for f in forms[1:] for u, v in zip(want, jax.jit(f)(ids)))
        times = [_time(_looped(f, n_pages, a.calls), ids) / a.calls for f in forms]
        nb = len(times) - 2 - len(warps)
        bcols = [f"{t:.4f} (w{w})" for t, w in zip(times[2 + len(warps):], kw)] if nb else ["-"] * len(bwarps)
        print(f"{cell:>12} {n_pages:>6} {times[0]:>12.4f} {times[1]:>10.4f}"
              + "".join(f" {t:>14.4f}" for t in times[2:2 + len(warps)])
              + "".join(f" {c:>16}" for c in bcols) + f" {same}")

if __name__ == "__main__":
    main()
