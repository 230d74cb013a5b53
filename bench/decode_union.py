"""Device time of the two constructions of the shared decode tiles' page union (pairwise comparisons vs a
per-page bitmap; ``pallas_kernels.decode.common.union_pages`` picks the bitmap where the page table has at most
U = Q x top-k pages), outputs compared first; 200 calls in one jitted loop, best of 5.

Cells are batch x context; the page table is sized as the serving sweep's (context x 1.25 / 128-token pages,
bench/msa_decode_serving.py: lengths vary +-25 % inside a batch), with random selections of top-k pages per row.

    python3 bench/decode_union.py            # M3 decode shapes: 4 kv groups, top-16, 128-token pages
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


def _looped(q, nsplit, n_pages, calls):
    """``calls`` unions in one jitted loop (each on ids shifted by the iteration, so none is hoisted): device time."""
    def run(ids):
        def body(i, acc):
            x = jnp.where(ids >= 0, (ids + i) % n_pages, -1)
            u, bits, starts = union_pages(x, q, nsplit, n_pages if calls > 0 else None)
            return acc + u[0, 0, 0, 0] + bits[0, 0, 0, 0] + starts[0, 0, 0, -1]
        return jax.lax.fori_loop(0, abs(calls), body, jnp.zeros((), jnp.int32))
    return jax.jit(run)


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
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"device {jax.devices()[0].device_kind}; Q {a.q}, top-{a.topk}, {a.nsplit} splits, 4 kv groups")
    print(f"{'cell':>12} {'pages':>6} {'pairwise ms':>12} {'bitmap ms':>10} equal")
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
        pair = jax.jit(lambda x: union_pages(x, a.q, a.nsplit))
        bitmap = jax.jit(lambda x, n=n_pages: union_pages(x, a.q, a.nsplit, n))
        same = all(bool(jnp.array_equal(u, v)) for u, v in zip(pair(ids), bitmap(ids)))
        calls = 200
        t_pair = _time(_looped(a.q, a.nsplit, n_pages, -calls), ids) / calls
        t_bit = _time(_looped(a.q, a.nsplit, n_pages, calls), ids) / calls
        print(f"{cell:>12} {n_pages:>6} {t_pair:>12.4f} {t_bit:>10.4f} {same}")

if __name__ == "__main__":
    main()
