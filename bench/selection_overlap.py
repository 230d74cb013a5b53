"""How much Q consecutive query rows' MSA selections overlap: the pages a speculative verify step's shared
decode tile walks (issue 34).

A decode step verifying 1 main + Q-1 draft rows reads, per request and kv group, the union of the rows'
selected pages (``pallas_kernels/decode/common.union_pages``). ``bench/msa_decode.py --serving`` draws each
row's index query independently (or with ``--serving-row-corr c``: ``c * shared + sqrt(1 - c^2) * own``),
so its Q = 8 union covers nearly every page of a 4-5K context. Here a real checkpoint's MSA layers select on
real text: the mean union of Q consecutive rows' top-k blocks over windows late in a ``--tokens`` prompt,
next to the same count for independent rows (each keeps its local block, the rest uniform among the
visible blocks) and the benchmark's query model at correlation c with random keys at the checkpoint's
geometry (which c reproduces the measured union).

Usage (CPU, about a minute for the demo at 4K):
    python bench/selection_overlap.py --checkpoint checkpoints/demo --tokens 4096 --out /tmp/overlap
Writes ``selection_overlap.json`` under --out and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from minimax_jax.data.prose import read_text, shakespeare_files  # noqa: E402
from minimax_jax.infer.loading import load_model  # noqa: E402
from minimax_jax.model.transformer import forward  # noqa: E402

CORRS = (0.0, 0.9, 0.95, 0.97, 0.98, 0.99)


def measured_unions(block_ids: np.ndarray, rows, start: int, stride: int) -> dict[int, float]:
    """Mean |union| of ``q`` consecutive rows' selected blocks (``-1`` = empty) over heads and windows
    starting at ``start, start + stride, ...``; ``block_ids`` ``[Hi, T, K]``."""
    hi, t, _ = block_ids.shape
    out = {}
    for q in rows:
        sizes = [len({int(b) for b in block_ids[h, s:s + q].ravel() if b >= 0})
                 for s in range(start, t - q + 1, stride) for h in range(hi)]
        out[q] = float(np.mean(sizes))
    return out


def independent_unions(rng, rows, positions, k: int, blk: int) -> dict[int, float]:
    """The same for independent rows: each keeps its local block, the other k - 1 uniform among the visible."""
    out = {}
    for q in rows:
        sizes = []
        for p0 in positions:
            u = set()
            for p in range(p0, p0 + q):
                own = p // blk
                others = np.setdiff1d(np.arange(own + 1), [own])
                u.add(own)
                u.update(rng.choice(others, size=min(k - 1, len(others)), replace=False).tolist())
            sizes.append(len(u))
        out[q] = float(np.mean(sizes))
    return out


def model_unions(rng, pages: int, blk: int, k: int, di: int, q: int, corrs, trials: int = 40) -> dict[float, float]:
    """Union of ``q`` rows under the serving benchmark's query model (``c * shared + sqrt(1 - c^2) * own``,
    page score = max over the page of ``qi . ki``, random normal keys, the last page always kept)."""
    out = {}
    for c in corrs:
        sizes = []
        for _ in range(trials):
            keys = rng.standard_normal((pages * blk, di)).astype(np.float32)
            qs = c * rng.standard_normal(di) + np.sqrt(1 - c * c) * rng.standard_normal((q, di))
            u = set()
            for row in qs.astype(np.float32):
                score = (keys @ row).reshape(pages, blk).max(axis=1)
                score[-1] = np.inf
                u.update(np.argsort(-score)[:k].tolist())
            sizes.append(len(u))
        out[c] = float(np.mean(sizes))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default=os.path.join(ROOT, "checkpoints", "demo"))
    ap.add_argument("--tokens", type=int, default=4096, help="prompt length (Shakespeare text)")
    ap.add_argument("--rows", default="1,2,4,8", help="Q values (consecutive rows)")
    ap.add_argument("--stride", type=int, default=97, help="window starts every this many tokens, from T / 2")
    ap.add_argument("--out", default="/tmp/selection_overlap")
    a = ap.parse_args(argv)
    rows = [int(x) for x in a.rows.split(",")]
    model = load_model(a.checkpoint, log=lambda *_: None)
    cfg = model.cfg
    if not cfg.has_msa:
        ap.error(f"{a.checkpoint} has no MSA layers")
    text = "\n".join(read_text(f) for f in shakespeare_files()[:3])
    enc = model.tokenizer.encode(text)
    ids = np.asarray(getattr(enc, "ids", enc)[:a.tokens], np.int32)
    if len(ids) < a.tokens:
        ap.error(f"the text gives only {len(ids)} tokens, fewer than --tokens {a.tokens}")
    out = forward(model.params, cfg, jnp.asarray(ids[None]), return_msa=True)
    k, blk, t = cfg.index_topk, cfg.index_block_size, a.tokens
    start = t // 2
    rng = np.random.default_rng(0)
    layers = [measured_unions(np.asarray(m["block_ids"])[0], rows, start, a.stride) for m in out.aux["msa"]]
    starts = list(range(start, t - max(rows) + 1, a.stride))
    indep = independent_unions(rng, rows, starts, k, blk)
    mean = {q: float(np.mean([lay[q] for lay in layers])) for q in rows}
    qmax = max(rows)
    corr = model_unions(rng, t // blk, blk, k, cfg.index_head_dim, qmax, CORRS)
    res = {"checkpoint": a.checkpoint, "tokens": t, "block_size": blk, "topk": k, "blocks": t // blk,
           "window_starts": [start, a.stride], "measured_per_layer": layers, "measured_mean": mean,
           "independent_rows": indep, f"benchmark_model_union_{qmax}_rows": corr}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "selection_overlap.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"{a.checkpoint}: T={t}, {t // blk} blocks of {blk}, top-{k}; union of Q consecutive rows' blocks")
    print("Q | measured (mean of layers) | independent rows")
    for q in rows:
        print(f"{q} | {mean[q]:.2f} | {indep[q]:.2f}")
    print(f"benchmark query model, {qmax} rows: " + ", ".join(f"c={c}: {u:.1f}" for c, u in corr.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
