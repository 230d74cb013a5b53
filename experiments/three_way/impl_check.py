"""Pre-flight for the GPU run: the Pallas MSA kernels against the XLA reference on the demo model.

Two levels, both at the demo configuration's shapes (``configs/demo-m3.yaml``, random init, one
packed batch):

1. Ops, strict (the kernels' contract, as in bench/msa_prefill.py): block selection — the selected
   SETS equal the reference's, except near-ties (every selected non-local block's reference score
   within 5e-3 of the (K-1)-th best), the local block always present; sparse attention on the
   reference's ids — o within atol=rtol=3e-2 (bf16), lse within 1e-3.
2. Model: loss, logits and every parameter gradient with ``msa_impl="xla"`` vs ``"auto"`` (forward
   with the sparse indexer KL, as in training; the KL follows ``msa_impl`` too, so on a GPU this
   also checks the Pallas KL kernel through the index projections' gradients): loss within 0.1%, every gradient's cosine >= 0.98,
   and the positions whose logits differ by more than 0.05 reported. Whole-model logits are not
   compared element-wise: a near-tie selects a different block for a few queries, which at random
   initialisation changes those rows by O(1) (the first H200 run: max error 0.60, losses equal to
   1e-5), so level 1 is what proves the kernels and level 2 that training sees the same objective.

Prints one JSON line; exits 0 when both levels pass, else 3. On a machine without a GPU, ``auto``
is the reference, so level 2 is trivially equal; ``--interpret`` runs level 1 with the GPU kernels
in Pallas interpret mode. The experiment trains the MSA variant with ``auto`` only after this passes.

    python experiments/three_way/impl_check.py [--seq 2048] [--batch 2] [--interpret]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from minimax_jax.config import load_config  # noqa: E402
from minimax_jax.model.params import init_params  # noqa: E402
from minimax_jax.model.transformer import forward  # noqa: E402
from minimax_jax.ops.registry import clear_implementation_report, implementation_report  # noqa: E402


def _loss_fn(cfg):
    def loss(params, tokens, segs):
        out = forward(params, cfg, tokens, segment_ids=segs, indexer_kl="sparse")
        logp = jax.nn.log_softmax(out.logits[:, :-1].astype(jnp.float32), axis=-1)
        nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        kl = out.aux["indexer_kl_sum"] / jnp.maximum(out.aux["indexer_kl_count"], 1.0)
        return nll.mean() + kl, out.logits
    return jax.jit(jax.value_and_grad(loss, has_aux=True))


def op_check(cfg, seq: int, impl: str) -> dict:
    """Level 1 (module docstring) at ``cfg``'s index/attention shapes; ``impl`` is the kernel path."""
    from minimax_jax.ops import msa as msa_ops

    rng = np.random.default_rng(2)
    g, h, d, di = cfg.num_kv_heads, cfg.num_heads, cfg.head_dim, cfg.index_head_dim
    blk, topk = cfg.index_block_size, cfg.index_topk
    q, k, v = (jnp.asarray(rng.standard_normal(sh), jnp.bfloat16)
               for sh in ((1, seq, h, d), (1, seq, g, d), (1, seq, g, d)))
    qi = jnp.asarray(rng.standard_normal((1, seq, g, di)), jnp.bfloat16)
    ki = jnp.asarray(rng.standard_normal((1, seq, di)), jnp.bfloat16)
    cut = seq // 3 + 5
    pos = jnp.asarray(np.where(np.arange(seq) < cut, np.arange(seq), np.arange(seq) - cut)[None], jnp.int32)
    seg = jnp.asarray((np.arange(seq) >= cut)[None].astype(np.int32))
    kw = dict(q_positions=pos, kv_positions=pos, q_segment_ids=seg, kv_segment_ids=seg, block_size=blk)
    sel = dict(topk=topk, init_blocks=cfg.index_init_blocks, local_blocks=cfg.index_local_blocks)
    ref = np.asarray(msa_ops.msa_select_blocks(qi, ki, implementation="xla", **kw, **sel))
    got = np.asarray(msa_ops.msa_select_blocks(qi, ki, implementation=impl, **kw, **sel))
    scores = np.asarray(msa_ops.msa_index_scores(qi, ki, implementation="xla", **kw), np.float32)
    local = np.asarray(pos)[0] // blk
    diff = bad = 0
    for r in range(g):
        for i in range(seq):
            a, b = set(got[0, r, i][got[0, r, i] >= 0].tolist()), set(ref[0, r, i][ref[0, r, i] >= 0].tolist())
            if local[i] not in a:
                bad += 1
            if a != b:
                diff += 1
                sc = np.sort(scores[0, r, i][: local[i]])[::-1]
                kth = sc[min(topk - 2, len(sc) - 1)] if len(sc) else -np.inf
                if len(a) != len(b) or any(scores[0, r, i][x] < kth - 5e-3 for x in a if x != local[i]):
                    bad += 1
    ids = jnp.asarray(ref)
    o, lse = msa_ops.msa_attention(q, k, v, ids, implementation=impl, **kw)
    ro, rlse = msa_ops.msa_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), ids,
                                     implementation="xla", **kw)
    o, ro = np.asarray(o, np.float32), np.asarray(ro, np.float32)
    lse, rlse = np.asarray(lse), np.asarray(rlse)
    fin = np.isfinite(rlse)
    o_ok = bool(np.all(np.abs(o - ro) <= 3e-2 + 3e-2 * np.abs(ro)))
    lse_err = float(np.max(np.abs(np.where(fin, lse - rlse, 0.0))))
    ok = bad == 0 and o_ok and lse_err <= 1e-3 and bool(np.all(np.isfinite(lse) == fin))
    return {"impl": impl, "rows": int(g * seq), "set_diff_rows": diff, "bad_rows": bad,
            "o_max_err": float(np.max(np.abs(o - ro))), "o_ok": o_ok, "lse_max_err": lse_err, "ok": bool(ok)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/demo-m3.yaml")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--interpret", action="store_true", help="level 1 with the GPU kernels interpreted (CPU)")
    a = ap.parse_args()
    base = load_config(a.config).replace(param_dtype="float32")
    params = init_params(base, jax.random.key(0))
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(3, base.vocab_size, (a.batch, a.seq)), jnp.int32)
    cut = a.seq // 3 + 5  # two packed documents per row, the boundary inside a block
    segs = jnp.asarray(np.where(np.arange(a.seq)[None] < cut, 0, 1).repeat(a.batch, 0), jnp.int32)
    res = {}
    for impl in ("xla", "auto"):
        clear_implementation_report()
        (loss, logits), grads = _loss_fn(base.replace(msa_impl=impl))(params, tokens, segs)
        res[impl] = (float(loss), np.asarray(logits, np.float32), jax.tree.map(lambda g: np.asarray(g, np.float32), grads))
        res[impl + "_ran"] = {k: v for k, v in implementation_report().items() if k.startswith(("msa", "indexer_kl"))}
    lx, ox, gx = res["xla"]
    la, oa, ga = res["auto"]
    cos = []
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(gx), jax.tree.leaves(ga)):
        nx, ny = np.linalg.norm(x), np.linalg.norm(y)
        if nx == 0 and ny == 0:
            continue
        cos.append((float(np.sum(x * y) / max(nx * ny, 1e-30)), jax.tree_util.keystr(path)))
    worst = min(cos)
    row_err = np.max(np.abs(ox - oa), axis=-1)          # [B, T] worst logit error per position
    out = {"loss_xla": lx, "loss_auto": la, "logits_max_err": float(np.max(row_err)),
           "positions_over_0.05": float(np.mean(row_err > 0.05)),
           "worst_grad_cosine": worst[0], "worst_grad_leaf": worst[1], "auto_ran": res["auto_ran"],
           "device": jax.devices()[0].device_kind}
    kernel = "pallas_gpu_interpret" if a.interpret else ("pallas_gpu" if jax.default_backend() == "gpu" else None)
    out["ops"] = op_check(base, a.seq, kernel) if kernel else {"ok": True, "skipped": "no GPU (use --interpret)"}
    ok = out["ops"]["ok"] and abs(la - lx) <= 1e-3 * abs(lx) and worst[0] >= 0.98
    out["ok"] = bool(ok)
    print(json.dumps(out))
    return 0 if ok else 3


if __name__ == "__main__":
    sys.exit(main())
