"""MSA prefill/training benchmark on GPU: correctness vs the XLA reference, then timings vs cuDNN.

Usage (GPU machine):  PYTHONUNBUFFERED=1 python3 bench/msa_prefill.py --out $OUT
CPU smoke run:        python bench/msa_prefill.py --interpret --tiny --out /tmp/msa_bench
Kernel variants:      --indexer-kernels m3:131072 times the indexer kernels (Triton, Hopper wgmma bf16,
                      Hopper wgmma fp8 index path) at one context: selection agreement with the Triton
                      kernel (bf16: rows with equal sets; fp8: recall of the bf16 selection) and ms;
                      --attn-fwd-variants m3:131072 the attention forward kernels (Triton, Hopper KV-outer,
                      the Hopper per-call choice, the query-tiled Hopper kernel forced), each checked against
                      the first in the same run (with --index-corr: on correlated selections).
Correlated selections: --index-corr c makes the timed rows' index queries an AR(1) process along the tokens
                      (``correlated_normal``), so neighbouring tokens select overlapping blocks as in a trained
                      model; every row reports ``tile_blocks`` (distinct blocks per tile of 1 / 4 / 8 / 16 tokens).
Implementation:       --implementation auto (default: what the ops pick, recorded per row under "ran"),
                      pallas_gpu (Triton kernels) or pallas_hopper_gpu.

1. Correctness (fresh random bf16 inputs), for each GPU kernel set (pallas_gpu and, on Hopper,
   auto, i.e. pallas_hopper_gpu where it serves the shapes): the indexer's block-id SETS against the
   reference (``minimax_jax.ops.msa``, implementation="xla"; a near-tie is accepted when every
   selected block's reference score is >= the (K-1)-th best - 5e-3, the MSA repo's criterion),
   the local block present; attention o (atol=rtol=3e-2) and lse (1e-3) on the same ids;
   dq/dk/dv cosine > 0.99 against autodiff of the fp32 reference; bitwise repeatability of the
   backward. Cases: unpacked self-attention, queries as a suffix of keys, packed segments.
2. Timing (median of repeats after a warm-up, block_until_ready; inputs larger than L2): for each
   model shape and context, indexer, attention fwd, attention fwd+bwd, whole MSA (indexer + attn,
   the sum of the separately timed parts),
   and cuDNN dense causal attention (jax.nn.dot_product_attention(implementation="cudnn")) fwd and
   fwd+bwd. Dense is timed up to --dense-max tokens and extrapolated by the quadratic law above
   (marked "extrapolated"); the indexer-KL loss + gradients (kl_fwd_bwd, GPU kernel, given the
   attention forward's LSE as in training) is timed too (ms only). FLOPs by MSA_SPEC.md section 6: dense 4*D*H*t per token, MSA main
   4*D*H*min(t, K*B), indexer 2*Di*Hi*t; backward counted as 2.5x forward (fwd+bwd = 3.5x).
Writes msa_prefill.json / msa_prefill.csv / msa_prefill_check.json under --out.
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from minimax_jax.ops import msa as msa_ops  # noqa: E402
from minimax_jax.ops.registry import clear_implementation_report, implementation_report  # noqa: E402
from pallas_kernels.common import gpu_compute_capability  # noqa: E402
from pallas_kernels.msa.gpu_attention import FORWARDS  # noqa: E402
from pallas_kernels.msa.gpu_sparse_fwd_qtile import sparse_fwd_qtile  # noqa: E402
from pallas_kernels.msa.gpu_indexer import msa_select_blocks_gpu  # noqa: E402
from pallas_kernels.msa.gpu_indexer_wgmma import msa_select_blocks_wgmma  # noqa: E402

# M3, M2 and the attention of bench/train_step.py's 1.9B model (4 heads per group)
MODELS = {"m3": dict(h=64, g=4, d=128), "m2": dict(h=48, g=8, d=128), "train": dict(h=16, g=4, d=128)}
BLK, TOPK, DI = 128, 16, 128


def _flops(t, h, d, hi, di, blk, topk):
    pos = np.arange(1, t + 1, dtype=np.float64)
    dense = float(np.sum(4.0 * d * h * pos))
    main = float(np.sum(4.0 * d * h * np.minimum(pos, topk * blk)))
    index = float(np.sum(2.0 * di * hi * pos))
    return dense, main, index


def _timeit(f, *args, budget_s=3.0, max_reps=20):
    jax.block_until_ready(f(*args))                    # compile + warm-up
    times = []
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(time.perf_counter() - t0)
    reps = int(max(2, min(max_reps, budget_s / max(times[0], 1e-6))))
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, len(times)


def _cos(a, b):
    a = np.asarray(a, np.float64).ravel()
    b = np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


def correlated_normal(key, shape, axis, corr, dtype):
    """Unit-variance normals in ``dtype``, an AR(1) process along ``axis`` and independent across the other
    axes: ``x_0 = e_0``, ``x_t = corr * x_{t-1} + sqrt(1 - corr^2) * e_t`` (lag-j correlation ``corr^j``);
    ``corr = 0``: independent normals (drawn in f32, then cast). A model of index queries whose neighbouring
    tokens select overlapping blocks, as a trained model's do (bench/selection_overlap.py), where independent
    normals make neighbours' selections nearly disjoint. Raises ValueError unless 0 <= corr < 1."""
    if not 0.0 <= corr < 1.0:
        raise ValueError(f"corr must be in [0, 1), got {corr}")
    e = jax.random.normal(key, shape, jnp.float32)
    if corr:
        e = jnp.moveaxis(e, axis, 0)
        b = e.at[1:].multiply((1.0 - corr ** 2) ** 0.5)
        a = jnp.full((e.shape[0],) + (1,) * (e.ndim - 1), corr, jnp.float32)
        # x_t = a_t x_{t-1} + b_t as an associative scan of (a, b) pairs (log depth, not T sequential steps)
        _, x = jax.lax.associative_scan(lambda l, r: (l[0] * r[0], r[0] * l[1] + r[1]), (a, b))
        e = jnp.moveaxis(x, 0, axis)
    return e.astype(dtype)


def tile_blocks(ids, sizes=(1, 4, 8, 16)):
    """Mean number of distinct selected blocks per tile of ``n`` consecutive query tokens (per batch row and
    index head; tiles that select nothing left out), for each ``n`` in ``sizes``: what a query-tiled sparse
    attention would walk per tile (n = 1: blocks per token). ids ``[B, Hi, T, K]`` int32, -1 = empty.
    Returns ``{n: float}``."""
    out = {}
    b, hi, t, k = ids.shape
    for n in sizes:
        x = jnp.pad(ids, ((0, 0), (0, 0), (0, -t % n), (0, 0)), constant_values=-1)
        x = jnp.sort(x.reshape(b, hi, -1, n * k), axis=-1)
        new = (x >= 0) & jnp.concatenate([jnp.ones_like(x[..., :1], bool), x[..., 1:] != x[..., :-1]], -1)
        count = jnp.sum(new, axis=-1)
        out[n] = float(jnp.sum(count) / jnp.maximum(jnp.sum(count > 0), 1))
    return out


class Inputs:
    def __init__(self, key, bsz, t, s, h, g, d, dtype, segments=None, index_corr=0.0):
        ks = jax.random.split(key, 7)
        self.q = jax.random.normal(ks[0], (bsz, t, h, d), dtype)
        self.k = jax.random.normal(ks[1], (bsz, s, g, d), dtype)
        self.v = jax.random.normal(ks[2], (bsz, s, g, d), dtype)
        self.qi = correlated_normal(ks[3], (bsz, t, g, DI), 1, index_corr, dtype)
        self.ki = jax.random.normal(ks[4], (bsz, s, DI), dtype)
        self.do = jax.random.normal(ks[5], (bsz, t, h, d), dtype)
        if segments is None:
            kvpos = np.broadcast_to(np.arange(s), (bsz, s))
            kvseg = np.zeros((bsz, s), np.int32)
        else:   # packed: per row a list of document lengths summing to <= s (rest = empty slots)
            kvpos = np.zeros((bsz, s), np.int32)
            kvseg = np.full((bsz, s), -1, np.int32)
            for b, lens in enumerate(segments):
                o = 0
                for i, n in enumerate(lens):
                    kvpos[b, o:o + n] = np.arange(n)
                    kvseg[b, o:o + n] = i
                    o += n
        self.kv_pos = jnp.asarray(kvpos, jnp.int32)
        self.kv_seg = jnp.asarray(kvseg, jnp.int32)
        self.q_pos = self.kv_pos[:, s - t:]
        self.q_seg = self.kv_seg[:, s - t:]

    def pos(self):
        return dict(q_positions=self.q_pos, kv_positions=self.kv_pos, q_segment_ids=self.q_seg,
                    kv_segment_ids=self.kv_seg)


def _impl(impl, interpret):
    """The registry name of a GPU kernel set; in interpret mode (CPU) its interpreted twin ("auto": the
    Triton set's, as "auto" on a CPU would run the XLA reference)."""
    if not interpret:
        return impl
    return ("pallas_gpu" if impl == "auto" else impl) + "_interpret"


def _ran():
    return {k: v for k, v in implementation_report().items() if not k.endswith("auto_reason")}


def check_case(name, inp, interpret, impl):
    """Compare one GPU kernel set (``impl``) with the XLA reference on one input set."""
    res = {"case": name, "implementation": impl, "shape": list(inp.q.shape) + [inp.k.shape[1], inp.k.shape[2]]}
    pos = inp.pos()
    impl = _impl(impl, interpret)
    clear_implementation_report()
    sel = jax.jit(lambda qi, ki: msa_ops.msa_select_blocks(qi, ki, block_size=BLK, topk=TOPK,
                                                           implementation=impl, **pos))
    ids = np.asarray(sel(inp.qi, inp.ki))
    ran = _ran()
    ref_ids = np.asarray(msa_ops.msa_select_blocks(inp.qi, inp.ki, block_size=BLK, topk=TOPK,
                                                   implementation="xla", **pos))
    scores = np.asarray(msa_ops.msa_index_scores(inp.qi, inp.ki, block_size=BLK,
                                                 implementation="xla", **pos))
    local = np.asarray(inp.q_pos) // BLK
    n_set_diff = n_bad = n_nolocal = 0
    for idx in zip(*np.nonzero(np.ones(ids.shape[:3], bool))):
        got = ids[idx][ids[idx] >= 0]
        want = ref_ids[idx][ref_ids[idx] >= 0]
        if len(set(got.tolist())) != len(got):
            n_bad += 1
        if len(want) and local[idx[0], idx[2]] not in got:
            n_nolocal += 1
        if set(got.tolist()) != set(want.tolist()):
            n_set_diff += 1
            sc = scores[idx][: local[idx[0], idx[2]]]
            kth = np.sort(sc)[::-1][min(TOPK - 2, len(sc) - 1)] if len(sc) else -np.inf
            ranked = [x for x in got if x != local[idx[0], idx[2]]]
            if len(got) != len(want) or any(sc[x] < kth - 5e-3 for x in ranked):
                n_bad += 1
    res.update(ids_rows=int(np.prod(ids.shape[:3])), ids_set_diff=n_set_diff, ids_bad=n_bad,
               ids_no_local=n_nolocal)
    ids_j = jnp.asarray(ref_ids)
    gids = ids_j   # same ids for both implementations
    # ids are jit arguments, never closed over: a constant ids array makes XLA constant-fold the
    # backward's inverse-map sort (minutes at these sizes)
    attn = jax.jit(lambda q, k, v, ids: msa_ops.msa_attention(q, k, v, ids, block_size=BLK,
                                                              implementation=impl, **pos))
    clear_implementation_report()          # the reference calls above recorded "xla"
    o, lse = attn(inp.q, inp.k, inp.v, gids)
    ran.update(_ran())
    ro, rlse = msa_ops.msa_attention(inp.q.astype(jnp.float32), inp.k.astype(jnp.float32),
                                     inp.v.astype(jnp.float32), gids, block_size=BLK,
                                     implementation="xla", **pos)
    o, ro = np.asarray(o, np.float32), np.asarray(ro, np.float32)
    lse, rlse = np.asarray(lse), np.asarray(rlse)
    fin = np.isfinite(rlse)
    res.update(o_max_err=float(np.max(np.abs(o - ro))),
               o_ok=bool(np.all(np.abs(o - ro) <= 3e-2 + 3e-2 * np.abs(ro))),
               lse_max_err=float(np.max(np.abs(np.where(fin, lse - rlse, 0.0)))),
               lse_inf_match=bool(np.array_equal(np.isfinite(lse), fin)),
               nan=bool(np.isnan(o).any() or np.isnan(lse).any()))
    res["lse_ok"] = res["lse_max_err"] <= 1e-3 and res["lse_inf_match"]

    def loss_k(q, k, v, ids, do):
        o, _ = msa_ops.msa_attention(q, k, v, ids, block_size=BLK, implementation=impl, **pos)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

    def loss_r(q, k, v, ids, do):
        o, _ = msa_ops.msa_attention(q, k, v, ids, block_size=BLK, implementation="xla", **pos)
        return jnp.sum(o * do.astype(jnp.float32))

    gk = jax.jit(jax.grad(loss_k, argnums=(0, 1, 2)))
    g1 = gk(inp.q, inp.k, inp.v, gids, inp.do)
    g2 = gk(inp.q, inp.k, inp.v, gids, inp.do)
    gr = jax.jit(jax.grad(loss_r, argnums=(0, 1, 2)))(inp.q.astype(jnp.float32),
                                                      inp.k.astype(jnp.float32),
                                                      inp.v.astype(jnp.float32), gids, inp.do)
    for nm, a, b in zip(("dq", "dk", "dv"), g1, gr):
        a = np.asarray(a, np.float32)
        b = np.asarray(b, np.float32)
        res[f"{nm}_cos"] = _cos(a, b)
        res[f"{nm}_max_err_rel"] = float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30))
    res["bwd_bitwise_repeat"] = all(bool(jnp.array_equal(a, b)) for a, b in zip(g1, g2))
    res["ran"] = ran
    res["ok"] = bool(res["o_ok"] and res["lse_ok"] and not res["nan"] and res["ids_bad"] == 0
                     and res["ids_no_local"] == 0 and res["bwd_bitwise_repeat"]
                     and all(res[f"{n}_cos"] > 0.99 for n in ("dq", "dk", "dv")))
    return res


def bench_case(model, t, inp, interpret, dense_max, dense_ref, impl="auto"):
    m = MODELS[model]
    pos = inp.pos()
    impl = _impl(impl, interpret)
    dense_fl, main_f, index_f = _flops(t, m["h"], m["d"], m["g"], DI, BLK, TOPK)
    row = {"model": model, "T": t, "H": m["h"], "G": m["g"], "D": m["d"]}
    clear_implementation_report()
    sel = jax.jit(lambda qi, ki: msa_ops.msa_select_blocks(qi, ki, block_size=BLK, topk=TOPK,
                                                           implementation=impl, **pos))
    ids = jax.block_until_ready(sel(inp.qi, inp.ki))
    try:        # blocks a query tile of n tokens would walk (--index-corr); a statistic, never the row's end
        row["tile_blocks"] = tile_blocks(ids)
    except Exception as e:
        row["tile_blocks_error"] = f"{type(e).__name__}: {str(e)[:200]}"

    def attn_f(q, k, v, ids):
        return msa_ops.msa_attention(q, k, v, ids, block_size=BLK, implementation=impl, **pos)

    def attn_fb(q, k, v, ids, do):
        (o, lse), vjp = jax.vjp(lambda q, k, v: attn_f(q, k, v, ids), q, k, v)
        return vjp((do, jnp.zeros_like(lse)))

    def kl_fb(q, k, qi, ki, ids, lse):   # indexer-KL loss and its gradients (qi, ki), sparse support; the
        # teacher's LSE is the attention forward's (as in training: model/msa_block.py)
        return jax.grad(lambda qi, ki: msa_ops.indexer_kl(q, k, qi, ki, ids, block_size=BLK, teacher_lse=lse,
                                                          implementation=impl, **pos)[0],
                        argnums=(0, 1))(qi, ki)

    try:
        lse = jax.block_until_ready(jax.jit(attn_f)(inp.q, inp.k, inp.v, ids)[1])
    except Exception as e:  # reported with the attention rows below
        lse = None
        row["kl_lse_error"] = f"{type(e).__name__}: {str(e)[:200]}"

    timings = {}
    cases = [("indexer", sel, (inp.qi, inp.ki)),
             ("attn_fwd", jax.jit(attn_f), (inp.q, inp.k, inp.v, ids)),
             ("attn_fwd_bwd", jax.jit(attn_fb), (inp.q, inp.k, inp.v, ids, inp.do)),
             ("kl_fwd_bwd", jax.jit(kl_fb), (inp.q, inp.k, inp.qi, inp.ki, ids, lse))]
    for name, fn, args in cases:
        try:
            timings[name] = _timeit(fn, *args)[0]
        except Exception as e:  # report (e.g. out of memory) and continue with the next variant
            timings[name] = None
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        gc.collect()
    row["ran"] = _ran()
    # dense cuDNN
    if not interpret and t <= dense_max:
        def dense_f(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

        def dense_fb(q, k, v, do):
            _, vjp = jax.vjp(dense_f, q, k, v)
            return vjp(do)
        for name, fn, args in (("dense_fwd", jax.jit(dense_f), (inp.q, inp.k, inp.v)),
                               ("dense_fwd_bwd", jax.jit(dense_fb), (inp.q, inp.k, inp.v, inp.do))):
            try:
                timings[name] = _timeit(fn, *args, budget_s=4.0)[0]
            except Exception as e:
                timings[name] = None
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        row["dense_source"] = "measured"
        dense_ref[model] = (t, timings.get("dense_fwd"), timings.get("dense_fwd_bwd"))
    elif model in dense_ref and dense_ref[model][1]:
        t0, f0, fb0 = dense_ref[model]
        timings["dense_fwd"] = f0 * (t / t0) ** 2
        timings["dense_fwd_bwd"] = fb0 * (t / t0) ** 2 if fb0 else None
        row["dense_source"] = f"extrapolated from T={t0} by (T/T0)^2"
    # whole MSA layer = indexer + attention, as the sum of the separately timed parts
    if timings.get("indexer") and timings.get("attn_fwd"):
        timings["msa_fwd"] = timings["indexer"] + timings["attn_fwd"]
    if timings.get("indexer") and timings.get("attn_fwd_bwd"):
        timings["msa_fwd_bwd"] = timings["indexer"] + timings["attn_fwd_bwd"]
    row.update({f"{k}_ms": v for k, v in timings.items()})

    def tf(flops, ms):
        return None if not ms else flops / (ms * 1e-3) / 1e12
    row["indexer_tflops"] = tf(index_f, timings.get("indexer"))
    row["attn_fwd_tflops"] = tf(main_f, timings.get("attn_fwd"))
    row["attn_fwd_bwd_tflops"] = tf(3.5 * main_f, timings.get("attn_fwd_bwd"))
    row["msa_fwd_tflops"] = tf(main_f + index_f, timings.get("msa_fwd"))
    row["msa_fwd_bwd_tflops"] = tf(3.5 * main_f + index_f, timings.get("msa_fwd_bwd"))
    row["dense_fwd_tflops"] = tf(dense_fl, timings.get("dense_fwd"))
    row["dense_fwd_bwd_tflops"] = tf(3.5 * dense_fl, timings.get("dense_fwd_bwd"))
    if timings.get("msa_fwd") and timings.get("indexer"):
        row["indexer_share_fwd"] = timings["indexer"] / timings["msa_fwd"]
    for a, b in (("fwd", "msa_fwd"), ("fwd_bwd", "msa_fwd_bwd")):
        if timings.get(f"dense_{a}") and timings.get(b):
            row[f"speedup_{a}"] = timings[f"dense_{a}"] / timings[b]
    row["flops_dense_fwd"], row["flops_msa_main_fwd"], row["flops_indexer"] = dense_fl, main_f, index_f
    stats = getattr(jax.devices()[0], "memory_stats", lambda: None)() or {}
    if "peak_bytes_in_use" in stats:   # process-wide peak so far (cases run in increasing T)
        row["peak_gib_so_far"] = stats["peak_bytes_in_use"] / 2**30
    return row


def _time_variants(tag, base, variants, make_fn, args, flops, check=None):
    """Time make_fn(**kw)(*args) for every kw of ``variants`` (rows printed as ``tag``; errors such
    as a compile failure are reported in the row). ``check(out) -> dict`` adds a correctness check."""
    out = []
    for kw in variants:
        r = dict(base, **kw)
        try:
            f = make_fn(**kw)
            if check is not None:
                r.update(check(f(*args)))
            ms = _timeit(f, *args)[0]
            r.update(ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
        except Exception as e:
            r["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        print(tag, json.dumps(r), flush=True)
        out.append(r)
        gc.collect()
    return out


# The indexer kernels: the first (Triton) is the reference of the agreement columns.
INDEXER_KERNELS = {
    "triton": lambda qi, ki, pos, interpret: msa_select_blocks_gpu(qi, ki, block_size=BLK, topk=TOPK,
                                                                   interpret=interpret, **pos),
    "wgmma": lambda qi, ki, pos, interpret: msa_select_blocks_wgmma(qi, ki, block_size=BLK, topk=TOPK,
                                                                    interpret=interpret, **pos),
    "wgmma_fp8": lambda qi, ki, pos, interpret: msa_select_blocks_wgmma(
        qi, ki, block_size=BLK, topk=TOPK, index_dtype="float8_e4m3fn", interpret=interpret, **pos),
}


@jax.jit
def _id_agreement(ids, ref):
    """(fraction of rows whose id set equals ref's, recall: ref ids found / ref ids). ids [B,G,T,K]."""
    hit = (ids[..., :, None] == ref[..., None, :]) & (ref[..., None, :] >= 0)
    found = jnp.any(hit, axis=-2)                                   # [B,G,T,K] per ref slot
    n_ref = jnp.sum(ref >= 0, axis=-1)
    n_got = jnp.sum(ids >= 0, axis=-1)
    rows_equal = jnp.mean(((jnp.sum(found, axis=-1) == n_ref) & (n_got == n_ref)).astype(jnp.float32))
    return rows_equal, jnp.sum(found) / jnp.maximum(jnp.sum(n_ref), 1)


def bench_indexer_kernels(model, t, key, interpret=False):
    """Time every indexer kernel of INDEXER_KERNELS at one context; selection agreement with the first."""
    m = MODELS[model]
    inp = Inputs(key, 1, t, t, m["h"], m["g"], m["d"], jnp.bfloat16)
    pos = inp.pos()
    _, _, index_f = _flops(t, m["h"], m["d"], m["g"], DI, BLK, TOPK)
    first = []

    def check(ids):
        if not first:
            first.append(ids)
        eq, recall = _id_agreement(ids, first[0])
        return {"rows_equal_to_first": float(eq), "recall_of_first": float(recall)}
    variants = [dict(kernel=k) for k in INDEXER_KERNELS]
    make = lambda kernel: jax.jit(lambda qi, ki: INDEXER_KERNELS[kernel](qi, ki, pos, interpret))
    return _time_variants("IDXVAR", {"model": model, "T": t}, variants, make, (inp.qi, inp.ki), index_f, check)


def bench_attn_fwd_variants(model, t, key, interpret=False, index_corr=0.0):
    """Time the attention forward kernels (``gpu_attention.FORWARDS``: Triton, Hopper KV-outer wgmma, the Hopper
    per-call choice; and the query-tiled Hopper kernel forced, ``qtile``) at one context on the Triton indexer's
    ids (index queries correlated along the tokens by ``index_corr``). Check: every kernel's o / lse against the
    first one's (o atol = rtol = 3e-2, lse 1e-3, same -inf pattern; ``bitwise``: identical); ``check_case``
    compares each with the reference."""
    m = MODELS[model]
    inp = Inputs(key, 1, t, t, m["h"], m["g"], m["d"], jnp.bfloat16, index_corr=index_corr)
    pos = inp.pos()
    _, main_f, _ = _flops(t, m["h"], m["d"], m["g"], DI, BLK, TOPK)
    ids = jax.block_until_ready(jax.jit(lambda qi, ki: msa_select_blocks_gpu(
        qi, ki, block_size=BLK, topk=TOPK, interpret=interpret, **pos))(inp.qi, inp.ki))
    kernels = dict(FORWARDS, qtile=sparse_fwd_qtile)
    make = lambda forward: jax.jit(lambda q, k, v, ids: kernels[forward](
        q, k, v, ids, pos["q_positions"], pos["kv_positions"], pos["q_segment_ids"],
        pos["kv_segment_ids"], block_size=BLK, interpret=interpret))
    first = []

    @jax.jit
    def diff(o, lse, o0, l0):
        fin = jnp.isfinite(l0)
        o, o0 = o.astype(jnp.float32), o0.astype(jnp.float32)
        d = jnp.abs(o - o0)
        ok = (jnp.all(d <= 3e-2 + 3e-2 * jnp.abs(o0)) & jnp.all(jnp.isfinite(lse) == fin)
              & ~jnp.any(jnp.isnan(o)))
        return (jnp.max(d), jnp.max(jnp.where(fin, jnp.abs(lse - l0), 0.0)), ok,
                jnp.all(o == o0) & jnp.all((lse == l0) | ~fin))

    def check(out):
        if not first:
            first.extend(out)
        o_d, l_d, ok, same = diff(*out, *first)
        return {"o_max_diff": float(o_d), "lse_max_diff": float(l_d), "bitwise": bool(same),
                "ok": bool(ok) and float(l_d) <= 1e-3}

    return _time_variants("FWDVAR", {"model": model, "T": t, "index_corr": index_corr},
                          [dict(forward=f) for f in kernels], make,
                          (inp.q, inp.k, inp.v, ids), main_f, check)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/msa_prefill",
                    help="folder of the results (the curated bench/results/msa_prefill.json is edited by hand)")
    ap.add_argument("--models", default="m3,m2")
    ap.add_argument("--contexts", default="8192,32768,131072,524288,1048576")
    ap.add_argument("--dense-max", type=int, default=131072)
    ap.add_argument("--max-tokens", default="", help="per model cap, e.g. m2=524288")
    ap.add_argument("--deadline-s", type=float, default=1e9, help="skip cases started after this")
    ap.add_argument("--cases", default="", help="ordered model:T list; overrides models/contexts")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--indexer-kernels", default="",
                    help="model:T[,model:T] at which to time the indexer kernels (INDEXER_KERNELS)")
    ap.add_argument("--attn-fwd-variants", default="",
                    help="model:T[,model:T] at which to time the attention forward kernels (gpu_attention.FORWARDS)")
    ap.add_argument("--implementation", default="auto",
                    help="kernel set of the timed rows: auto | pallas_gpu | pallas_hopper_gpu")
    ap.add_argument("--check-implementations", default="",
                    help="kernel sets to check (default: pallas_gpu, and auto on a Hopper GPU)")
    ap.add_argument("--small-check", action="store_true", help="smaller GPU check shapes")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--interpret", action="store_true", help="GPU kernels in interpret mode (CPU)")
    ap.add_argument("--tiny", action="store_true", help="small shapes for a CPU smoke run")
    ap.add_argument("--index-corr", type=float, default=0.0,
                    help="timed rows: index queries as an AR(1) process along the tokens with this lag-1 "
                         "correlation (neighbouring tokens select overlapping blocks, as in a trained model); "
                         "0 = independent normals")
    args = ap.parse_args()
    if not 0.0 <= args.index_corr < 1.0:
        ap.error(f"--index-corr takes a value in [0, 1), got {args.index_corr}")
    os.makedirs(args.out, exist_ok=True)
    start = time.time()
    dev = jax.devices()[0]
    meta = {"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            "device": getattr(dev, "device_kind", str(dev)), "jax": jax.__version__,
            "command": " ".join(sys.argv)}
    print(meta, flush=True)
    key = jax.random.PRNGKey(int(time.time()) & 0xFFFF)
    checks = []
    check_impls = [x for x in args.check_implementations.split(",") if x]
    if not check_impls:       # the interpreted Hopper set is slow on a CPU: only when asked for there
        check_impls = ["pallas_gpu"]
        if not args.interpret and str(gpu_compute_capability() or "").startswith("9."):
            check_impls.append("auto")
    if not args.skip_check:
        if args.tiny:
            cases = [("unpacked_m3like", dict(bsz=1, t=300, s=300, h=8, g=2, d=32), None),
                     ("packed_m2like", dict(bsz=2, t=300, s=300, h=6, g=2, d=32),
                      [[100, 150, 40], [299]]),
                     ("suffix", dict(bsz=1, t=70, s=333, h=4, g=2, d=32), None)]
        elif args.small_check:
            cases = [("unpacked_m3", dict(bsz=1, t=4096, s=4096, h=64, g=4, d=128), None),
                     ("packed_m2", dict(bsz=2, t=2048, s=2048, h=48, g=8, d=128),
                      [[700, 1000, 300], [129, 1919]])]
        else:
            cases = [("unpacked_m3", dict(bsz=1, t=4096, s=4096, h=64, g=4, d=128), None),
                     ("suffix_m3", dict(bsz=1, t=1000, s=5000, h=64, g=4, d=128), None),
                     ("packed_m2", dict(bsz=2, t=3000, s=3000, h=48, g=8, d=128),
                      [[1000, 1500, 450], [129, 2871]])]
        for name, shp, segs in cases:
            key, sub = jax.random.split(key)
            inp = Inputs(sub, shp["bsz"], shp["t"], shp["s"], shp["h"], shp["g"], shp["d"],
                         jnp.bfloat16, segs)
            for impl in check_impls:
                t0 = time.time()
                try:
                    r = check_case(name, inp, args.interpret, impl)
                except Exception as e:
                    r = {"case": name, "implementation": impl, "ok": False,
                         "error": f"{type(e).__name__}: {str(e)[:400]}"}
                r["seconds"] = time.time() - t0
                checks.append(r)
                print("CHECK", json.dumps(r), flush=True)
        with open(os.path.join(args.out, "msa_prefill_check.json"), "w") as f:
            json.dump({"meta": meta, "checks": checks}, f, indent=1)
    if args.check_only:
        return
    variants, fwd_variants, rows = [], [], []

    def save():
        with open(os.path.join(args.out, "msa_prefill.json"), "w") as f:
            json.dump({"meta": meta, "checks": checks, "indexer_variants": variants,
                       "attn_fwd_variants": fwd_variants, "rows": rows}, f, indent=1)
    for case in (c for c in args.indexer_kernels.split(",") if c):
        mo, tt = case.split(":")
        key, sub = jax.random.split(key)
        variants += bench_indexer_kernels(mo, int(tt), sub, args.interpret)
        save()
    for case in (c for c in args.attn_fwd_variants.split(",") if c):
        mo, tt = case.split(":")
        key, sub = jax.random.split(key)
        fwd_variants += bench_attn_fwd_variants(mo, int(tt), sub, args.interpret, args.index_corr)
        save()
    save()
    caps = dict(x.split("=") for x in args.max_tokens.split(",") if x)
    dense_ref = {}
    if args.cases:
        plan = [(c.split(":")[0], int(c.split(":")[1])) for c in args.cases.split(",")]
    else:
        plan = [(mo, int(t)) for mo in args.models.split(",") for t in args.contexts.split(",")]
    for model, t in plan:
            m = MODELS[model]
            if time.time() - start > args.deadline_s:
                print(f"SKIP {model} T={t}: past --deadline-s", flush=True)
                rows.append({"model": model, "T": t, "error": "skipped: time budget"})
                continue
            if model in caps and t > int(caps[model]):
                continue
            if args.tiny:
                m = dict(h=8, g=2, d=32) if model == "m3" else dict(h=6, g=2, d=32)
            key, sub = jax.random.split(key)
            t0 = time.time()
            try:
                inp = Inputs(sub, 1, t, t, m["h"], m["g"], m["d"], jnp.bfloat16, index_corr=args.index_corr)
                row = bench_case(model, t, inp, args.interpret, args.dense_max, dense_ref, args.implementation)
            except Exception as e:
                row = {"model": model, "T": t, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            row["index_corr"] = args.index_corr
            row["seconds"] = time.time() - t0
            rows.append(row)
            print("ROW", json.dumps(row), flush=True)
            inp = None
            gc.collect()
            save()
    cols = ["model", "T", "indexer_ms", "attn_fwd_ms", "attn_fwd_bwd_ms", "kl_fwd_bwd_ms", "msa_fwd_ms",
            "msa_fwd_bwd_ms", "dense_fwd_ms", "dense_fwd_bwd_ms", "indexer_tflops",
            "attn_fwd_tflops", "attn_fwd_bwd_tflops", "dense_fwd_tflops", "indexer_share_fwd",
            "speedup_fwd", "speedup_fwd_bwd", "peak_gib_so_far", "dense_source"]
    with open(os.path.join(args.out, "msa_prefill.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)
    print("\nchecks:", [(c["case"], c.get("ok")) for c in checks])
    print(" | ".join(c[:12] for c in cols[:-1]))
    for r in rows:
        print(" | ".join(("%.3g" % r[c]) if isinstance(r.get(c), float) else str(r.get(c))
                         for c in cols[:-1]))


if __name__ == "__main__":
    main()
