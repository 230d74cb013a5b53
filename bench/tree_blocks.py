"""Prefix-tree attention kernel launch configurations vs cuDNN on the same trajectories (one layer).

Usage (GPU machine)::

    python3 bench/tree_blocks.py --out $OUT

Workload: ``bench/prefix_tree.py``'s synthetic rollouts (same flags and defaults), laid out merged (one
tree, ``pack_trajectories``) and unmerged (one document per trajectory, ``prefix_tree.unmerged_rows``).
Shapes: bench/train_step.py's M3-style model (16 query heads, 4 kv heads of 128), bf16, random q/k/v.
Timed: ``tree_attention_gpu`` forward and forward+backward (gradient of ``sum(o * do)``) for each
configuration of ``--configs`` (rows:block_k:num_warps:num_stages; the first is the kernel's default), and
the attention op's ``cudnn_packed`` on the unmerged rows (the unmerged step's attention). Each
configuration's outputs and gradients are compared with the first configuration's (bf16 tolerance). Writes ``tree_blocks.json``
under ``--out``; the table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import prefix_tree as pt  # noqa: E402
from minimax_jax.data.prefix_tree import pack_trajectories  # noqa: E402
from minimax_jax.ops.attention import attention  # noqa: E402
from pallas_kernels.tree.gpu_attention import tree_attention_gpu  # noqa: E402

DEFAULT_CONFIGS = "128:32:4:3,64:64:8:2,128:64:8:3,128:32:8:3,128:32:4:4,64:32:4:3"


def _time(fn, *args, iters: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters


def _case(batch, rng, h=16, g=4, d=128):
    b, t = batch["tokens"].shape
    mk = lambda n: jnp.asarray(rng.standard_normal((b, t, n, d)), jnp.bfloat16)      # noqa: E731
    return mk(h), mk(g), mk(g), mk(h)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--configs", default=DEFAULT_CONFIGS)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--interpret", action="store_true", help="tiny workload, interpret mode (CPU smoke run)")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    w = dict(pt.TINY_WORKLOAD) if args.interpret else dict(prompt=6144, rollouts=16, turn_min=200, turn_max=1500,
                                                           seq_len=32768)
    seq_len = w.pop("seq_len")
    trajs = pt.synthetic_rollouts(np.random.default_rng(args.seed), branch_min=2, branch_max=4, vocab=32768, **w)
    merged = pt.fit_rows(pack_trajectories(trajs, seq_len)[0], 1024 if not args.interpret else 64)
    unmerged = pt.unmerged_rows(trajs, seq_len)
    rng = np.random.default_rng(1)
    q, k, v, do = _case(merged, rng)
    kw = {n: jnp.asarray(merged[m]) for n, m in (("q_positions", "positions"), ("kv_positions", "positions"),
                                                  ("q_segment_ids", "segment_ids"), ("kv_segment_ids", "segment_ids"),
                                                  ("subtree_end", "subtree_end"))}
    rows, ref = [], None
    for c in args.configs.split(","):
        r, bk, nw, ns = (int(x) for x in c.split(":"))
        f = lambda q, k, v, r=r, bk=bk, nw=nw, ns=ns: tree_attention_gpu(                 # noqa: E731
            q, k, v, rows=r, block_k=bk, num_warps=nw, num_stages=ns, interpret=args.interpret, **kw)
        fwd = jax.jit(f)
        grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * do), argnums=(0, 1, 2)))
        row = {"config": c}
        try:
            outs = [fwd(q, k, v), *grad(q, k, v)]
            if ref is None:
                ref = outs
            row["max_rel_err_vs_first"] = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                                                    / (float(jnp.max(jnp.abs(b.astype(jnp.float32)))) + 1e-6))
                                              for a, b in zip(outs, ref))
            row["fwd_ms"] = _time(fwd, q, k, v, iters=args.iters) * 1e3
            row["fwd_bwd_ms"] = _time(grad, q, k, v, iters=args.iters) * 1e3
        except Exception as e:  # noqa: BLE001  (a configuration Triton cannot compile must not lose the rest)
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        print(json.dumps(row), flush=True)
        rows.append(row)
    result = {"device": str(jax.devices()[0].device_kind), "merged_tokens": int((merged["segment_ids"] > 0).sum()),
              "unmerged_tokens": int((unmerged["segment_ids"] > 0).sum()), "tree": rows}
    if not args.interpret:
        qu, ku, vu, dou = _case(unmerged, rng)
        upos, useg = jnp.asarray(unmerged["positions"]), jnp.asarray(unmerged["segment_ids"])
        ukw = dict(q_positions=upos, kv_positions=upos, q_segment_ids=useg, kv_segment_ids=useg)
        fu = lambda q, k, v: attention(q, k, v, implementation="cudnn_packed", **ukw)    # noqa: E731
        gu = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fu(q, k, v).astype(jnp.float32) * dou), argnums=(0, 1, 2)))
        result["cudnn_unmerged"] = {"fwd_ms": _time(jax.jit(fu), qu, ku, vu, iters=args.iters) * 1e3,
                                    "fwd_bwd_ms": _time(gu, qu, ku, vu, iters=args.iters) * 1e3}
    with open(os.path.join(args.out, "tree_blocks.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"\nmerged {result['merged_tokens']} tokens, unmerged {result['unmerged_tokens']}; ms per layer")
    print(f"{'config (rows:bk:warps:stages)':30} {'fwd':>8} {'fwd+bwd':>8} {'rel err':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['config']:30} {r['error'][:80]}")
        else:
            print(f"{r['config']:30} {r['fwd_ms']:8.2f} {r['fwd_bwd_ms']:8.2f} {r['max_rel_err_vs_first']:8.1e}")
    if "cudnn_unmerged" in result:
        cu = result["cudnn_unmerged"]
        print(f"{'cudnn_packed, unmerged rows':30} {cu['fwd_ms']:8.2f} {cu['fwd_bwd_ms']:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
