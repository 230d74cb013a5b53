"""MSA decode vs dense paged decode on GPU: correctness vs the XLA reference, then timings.

Usage (GPU machine):  PYTHONUNBUFFERED=1 python3 bench/msa_decode.py --out $OUT
CPU smoke run:        python bench/msa_decode.py --smoke --contexts 2048 --batches 1,2 --steps 1 --out /tmp/msa_decode
Tuning first:         python3 bench/msa_decode.py --sweep-scores 32x1048576,1x1048576 \
                          --score-family persistent,evict --sweep-budget-s 200 --out $OUT
  (times the current launch table and every ``score_candidates`` config of the given families of the
  page-scoring kernel at those batch x context cases, bf16 and fp8 keys separately; records the best
  config of each case and installs, per size class of the run's launch table (``LaunchTable.score``), the case's
  winner (the best geometric mean when several swept cases share a class), re-checks every class's launch
  (keeping the old table if the check fails), then the table, which prints the launch each case ran;
  --sweep-budget-s caps the sweep's wall time, candidates past a group's share left untimed)
Selection / sparse-attention launch sweeps (after --sweep-scores when both are given):
  python3 bench/msa_decode.py --sweep-select 1,2,4,8,16,auto --sweep-sparse-pps 1,2,4,8 --out $OUT
  (at the --sweep-scores cases, else --sweep-cases, default 32x1048576,1x1048576: times
  select_pages_gpu per select_splits value, ids checked equal to S=1's, and sparse paged_attention_gpu
  per sparse_pages_per_split value over real selections, o/lse checked against pps=1; each keeps its
  best geometric mean in the run's launch table; rows under "select_sweep" / "sparse_pps_sweep")
Serving sweep (``msa_decode_serving``: batches x contexts with lengths +-25 % inside a batch, Q = 8 and 1 query
rows, bf16 / fp8 index keys, MSA vs dense, each under the ``--serving-tilings`` attention tilings (default
"default,legacy": shared 128-row tiles vs the former ones) in the same run, after its own check;
``--serving-budget-s`` caps its timings):
  PYTHONUNBUFFERED=1 python3 bench/msa_decode.py --contexts 1048576 --batches 32 --serving --serving-budget-s 300 \
      --out $OUT
  python bench/msa_decode.py --smoke --contexts "" --steps 1 --serving --serving-batches 2 --serving-contexts 512,2560 \
      --serving-first "" --out /tmp/msa_decode        (CPU: check with the kernels in interpret mode, xla timings)
CPU plumbing of the sweeps (kernels in interpret mode):
  python bench/msa_decode.py --smoke --contexts 2048 --batches 1 --steps 1 --sweep-steps 1 --sweep-cases 1x4096 \
      --sweep-select 1,2,auto --sweep-sparse-pps 1,4 --out /tmp/msa_decode
  python bench/msa_decode.py --smoke --contexts 2048 --batches 1 --steps 1 --sweep-steps 1 --sweep-scores 1x2048 \
      --score-family evict --sms 2 --out /tmp/msa_decode

One layer, M3 shapes (H=64 query heads, G=4 kv heads, D=128, Di=128, page = block = 128, K=16),
Q=1 query row per request, bf16 K/V. For each (batch, context):
  dense      split-KV paged attention over every cached page (``paged_attention``, pallas_gpu);
  msa_bf16   page scoring over bf16 index keys + top-(K-1) + local page + split-KV sparse attention
             (``msa_decode``, pallas_gpu);
  msa_fp8    the same with fp8 e4m3 index keys (per-token f32 scales);
  select_*   page scoring + top-(K-1) + local page (``msa_decode_select``) alone;
  scores_*   the page-scoring kernel alone.
Timing: each timed call runs ``--steps`` decode steps inside one jit, over page-table replicas
that point at disjoint physical pages when the cache is small (so the L2 never holds the data);
time per step = median call time / steps. The launch table of the run (``pallas_kernels.decode.gpu_config.LaunchTable``: DEFAULT_TABLE with the loop
variant that passed the check and the sweeps' winners) is passed explicitly to every kernel / op call.
The host's dispatch of each call (~0.3-0.5 ms on the H200)
is spread over the steps: session 11 measured batch 32 x 1M MSA bf16 at 2.09 ms per step with 4 steps
per call, 1.98 with 32 and 1.97 with 64, while the kernels' device time (``--profile``) was 1.96 ms; so
the default is 64 (dense steps, 15 ms, move < 1%). Bytes per step (fewest bytes a step must read): dense
= B*ctx*G*D*2 (K,V) * 2 B; MSA = B*ctx*(Di*bytes(ki) [+4 scale]) + B*G*K*page*D*2*2 (selected K/V).
HBM reference: a large bf16 ``x + 1`` (read + write) in the same run.
Writes msa_decode.json under --out (with --serving also ``serving`` cells, ``serving_skipped``, ``serving_check``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from minimax_jax.ops import paged as ops  # noqa: E402
from minimax_jax.decode.cache import quantize  # noqa: E402
from minimax_jax.ops.registry import implementation_report  # noqa: E402

H, G, D, DI, PAGE, K = 64, 4, 128, 128, 128, 16
GIB = 1 << 30
#: Cache bytes per token slot (``make_cache``): bf16 K and V of G groups, bf16 index key, fp8 index key + f32 scale.
TOKEN_BYTES = G * D * 2 * 2 + DI * 2 + DI + 4


def fill(shape, seed, dtype):
    """Pseudo-random values in [-2, 2) from a hash of the element index (no big temporaries)."""
    @jax.jit
    def f():
        h = jnp.uint32((seed * 0x9E3779B9 + 12345) & 0xFFFFFFFF)
        for ax in range(len(shape)):
            i = jax.lax.broadcasted_iota(jnp.uint32, shape, ax)
            h = (h ^ (i * jnp.uint32((0x85EBCA6B + 2 * ax) & 0xFFFFFFFF))) * jnp.uint32(0xC2B2AE35)
            h = h ^ (h >> 13)
        h = (h * jnp.uint32(0x27D4EB2F)) ^ (h >> 16)
        return ((h >> 8).astype(jnp.float32) * (4.0 / (1 << 24)) - 2.0).astype(dtype)
    return f()


def case_sizes(b, ctx, min_steps, l2_bytes):
    """(pages per request, cache replicas, steps per timed call, physical pages) of one (batch, context):
    enough replicas (at most 12) that the index keys the timed steps read exceed ``l2_bytes``
    (rotating through them measures HBM, not the L2), and at least one step per replica."""
    npg = ctx // PAGE
    reps = max(1, min(12, -(-l2_bytes // (b * ctx * DI * 2))))
    return npg, reps, max(reps, min_steps), reps * b * npg + 1


def timeit(f, *args, budget_s=0.5, max_reps=12):
    jax.block_until_ready(f(*args))
    times = []
    t_end = time.perf_counter() + budget_s
    while len(times) < 3 or (time.perf_counter() < t_end and len(times) < max_reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), len(times)


def hbm_copy_bandwidth(n_bytes=4 * GIB):
    x = fill((n_bytes // 2 // 4096, 4096), 7, jnp.bfloat16)
    f = jax.jit(lambda a: a + jnp.bfloat16(1))
    t, _ = timeit(f, x)
    del x
    return 2 * n_bytes / t


# ----------------------------------------------------------------------------- correctness

def check(impl, rng, interpret=False, table=None):
    """Kernels vs the xla reference on fresh random inputs; returns a dict of max errors.

    ``table``: the GPU kernels' launch table (``gpu_config.LaunchTable``; None = ``DEFAULT_TABLE``).
    With ``impl="pallas_gpu"`` or ``interpret`` (the GPU kernels in interpret mode, CPU) also the
    selection with the scoring launch of every size class of ``table.score`` (forced with
    ``size_class``: the check's case itself is small), keys ``select_{bf16,fp8}_{class}_set_mismatch_rows``."""
    res = {}
    classes = []
    if impl == "pallas_gpu" or interpret:
        from pallas_kernels.decode import gpu_config, gpu_select
        classes = [name for name, _ in gpu_config.SCORE_CLASSES]
    b, nq, npg = 2, 4, 24
    p = b * npg + 5
    kd = jax.random.split(jax.random.PRNGKey(int(rng.integers(1 << 30))), 6)
    q = jax.random.normal(kd[0], (b, nq, H, D), jnp.bfloat16)
    qi = jax.random.normal(kd[1], (b, nq, G, DI), jnp.bfloat16)
    kp = jax.random.normal(kd[2], (G, p, PAGE, D), jnp.bfloat16)
    vp = jax.random.normal(kd[3], (G, p, PAGE, D), jnp.bfloat16)
    kip = jax.random.normal(kd[4], (p, PAGE, DI), jnp.bfloat16)
    pt = jnp.asarray(rng.permutation(np.arange(1, p))[: b * npg].reshape(b, npg), jnp.int32)
    start = np.array([npg * PAGE - 3 - nq, 5 * PAGE + 60])
    pos = jnp.asarray(start[:, None] + np.arange(nq)[None], jnp.int32)
    for label, kis in (("bf16", None), ("fp8", "fp8")):
        kq, ks = (kip, None) if kis is None else quantize(kip, "float8_e4m3fn")
        ids_ref = ops.msa_decode_select(qi, kq, pt, pos, ki_scale=ks, topk=K, implementation="xla")
        ids = ops.msa_decode_select(qi, kq, pt, pos, ki_scale=ks, topk=K, implementation=impl, launch_table=table)
        r = np.sort(np.asarray(ids_ref), -1)
        res[f"select_{label}_set_mismatch_rows"] = int(np.sum(np.any(np.sort(np.asarray(ids), -1) != r, -1)))
        for cls in classes:
            ids = gpu_select.select_pages_gpu(qi, kq, pt, pos, ks, topk=K, interpret=interpret, size_class=cls,
                                              table=table)
            res[f"select_{label}_{cls}_set_mismatch_rows"] = int(np.sum(np.any(np.sort(np.asarray(ids), -1) != r, -1)))
    for label, ids in (("dense", None), ("sparse", ids_ref)):
        o_r, l_r = ops.paged_attention(q, kp, vp, pt, pos, block_ids=ids, implementation="xla")
        o, l = ops.paged_attention(q, kp, vp, pt, pos, block_ids=ids, implementation=impl, launch_table=table)
        res[f"attn_{label}_o_maxerr"] = float(jnp.max(jnp.abs(o.astype(jnp.float32) - o_r.astype(jnp.float32))))
        res[f"attn_{label}_lse_maxerr"] = float(jnp.max(jnp.abs(l - l_r)))
        res[f"attn_{label}_finite"] = bool(jnp.all(jnp.isfinite(o.astype(jnp.float32))))
    ok = (all(v <= 1 for k, v in res.items() if k.endswith("_set_mismatch_rows"))
          and all(res[f"attn_{x}_o_maxerr"] < 3e-2 and res[f"attn_{x}_lse_maxerr"] < 1e-2 and res[f"attn_{x}_finite"]
                  for x in ("dense", "sparse")))
    res["ok"] = bool(ok)
    return res


# ----------------------------------------------------------------------------- scoring-kernel sweep

SCORE_FAMILIES = ("wide", "narrow", "persistent", "evict")


def score_candidates(label, family="wide", sms=132, table=None):
    """Launch configs of the scoring kernel to sweep (``pallas_kernels.decode.gpu_config.score_launch`` keys).

    family "wide": 4 warps, unroll x stages x pages per program (label "fp8" adds the f16-compute
    variants); session 8's sweeps (BENCHMARKS.md): unroll 1-2 with 4-8 pages per program led, 8 warps and
    64-128 pages per program lost. family "narrow": 1 or 2 warps per program (a [16, page] score tile
    whose max over the page's tokens needs no cross-warp reduction with one warp), stages 2-4, 4 or 8
    pages per program; fp8 only with the f16 product (session 8: always better). family "persistent":
    the persistent scorer, ``programs`` = ``sms`` x {1, 2, 4} (SMs of the GPU), 1 / 2 / 4 warps, stages
    2-4. family "evict": the ``table.score`` entries of ``label`` (None = ``DEFAULT_TABLE``) and persistent configs
    (1-2 warps, 3-4 stages, 2 x sms programs) with ``evict="evict_first"`` (streaming key loads).
    Persistent, evict and fp8 narrow candidates use the f16 product for fp8.
    Raises ValueError for an unknown family."""
    from pallas_kernels.decode import gpu_config
    if family not in SCORE_FAMILIES:
        raise ValueError(f"unknown score family {family!r}; known: {SCORE_FAMILIES}")
    f16 = {"f16": True} if label == "fp8" else {}
    if family == "narrow":
        return [dict(num_warps=w, num_stages=st, unroll=1, ppp=p, **f16) for w in (1, 2) for st in (2, 3, 4)
                for p in (4, 8)]
    if family == "persistent":
        return [dict(num_warps=w, num_stages=st, unroll=1, programs=sms * k, **f16) for w in (1, 2, 4)
                for st in (2, 3, 4) for k in (1, 2, 4)]
    if family == "evict":
        table = gpu_config.DEFAULT_TABLE if table is None else table
        current = [dict(gpu_config.SCORE_LAUNCH_BASE, **e) for e in table.score[label].values()]
        pers = [dict(num_warps=w, num_stages=st, unroll=1, programs=2 * sms, **f16) for w in (1, 2) for st in (3, 4)]
        return [dict(c, evict="evict_first") for c in current + pers]
    c = [dict(num_warps=4, num_stages=st, unroll=u, ppp=p) for u in (1, 2, 4) for st in (2, 3) for p in (4, 8, 16)]
    if label == "fp8":
        c += [dict(x, f16=True) for x in c]
    return c


def family_candidates(label, families, sms=132, table=None):
    """The candidates of several families (``score_candidates``), duplicates dropped, in order."""
    seen, out = set(), []
    for fam in families:
        for c in score_candidates(label, fam, sms, table):
            key = json.dumps(c, sort_keys=True)
            if key not in seen:
                seen.add(key)
                out.append(c)
    return out


def sweep_scores(cases, min_steps, candidates, l2_bytes=200 * 1024 * 1024, interpret=False, budget_s=None,
                 table=None):
    """Time the page-scoring kernel with the launch table ``table`` ("default": ``table.score`` of the
    case's size class; None = ``gpu_config.DEFAULT_TABLE``) and each candidate config of ``candidates`` {"bf16" / "fp8": [config]},
    bf16 and fp8 index keys, at each (batch, context) of ``cases``. A candidate runs as given over
    ``gpu_config.SCORE_LAUNCH_BASE`` (nothing inherited from the table). ``budget_s``: wall seconds for the
    whole sweep, shared equally by the (case, keys) groups; a group's candidates left when its share
    is spent are not timed (rows with ``skipped``; the default is always timed). Returns rows (batch,
    context, keys, size_class, config, launch = the launch that ran, ms, gbps, wall_s = compile +
    timing; or error / skipped)."""
    from pallas_kernels.decode import gpu_config, gpu_select
    rows = []
    share = None if budget_s is None else budget_s / (2 * len(cases))
    for b, ctx in cases:
        npg, reps, steps, p = case_sizes(b, ctx, min_steps, l2_bytes)
        cls = gpu_config.score_size_class(b * npg)
        kib = fill((p, PAGE, DI), 3, jnp.bfloat16)
        ki8, ks8 = jax.jit(lambda x: quantize(x, "float8_e4m3fn"))(kib)
        rng = np.random.default_rng(b * 7 + ctx)
        tables = jnp.asarray(rng.permutation(np.arange(1, p)).reshape(reps, b, npg), jnp.int32)
        qi = jax.random.normal(jax.random.PRNGKey(ctx + b), (steps, b, 1, G, DI), jnp.bfloat16)
        pos = jnp.full((b, 1), ctx - 1, jnp.int32)
        for label, ki, ks, nbytes in (("bf16", kib, None, b * ctx * DI * 2), ("fp8", ki8, ks8, b * ctx * (DI + 4))):
            t_group = time.perf_counter()
            for cfg in [None] + list(candidates.get(label, [])):
                launch = (gpu_config.score_launch(ki.dtype, total_pages=b * npg, table=table) if cfg is None
                          else {k: v for k, v in dict(gpu_config.SCORE_LAUNCH_BASE, **cfg).items() if v is not None})
                if cfg is not None and share is not None and time.perf_counter() - t_group > share:
                    rows.append(dict(batch=b, context=ctx, keys=label, size_class=cls, config=cfg, launch=launch,
                                     skipped=f"sweep budget ({share:.0f} s per case and key dtype) spent"))
                    continue

                def run(qi, ki, ks, tables, launch=launch):
                    acc = jnp.zeros((), jnp.float32)
                    for r in range(steps):
                        sc = gpu_select.page_scores_gpu(qi[r], ki, tables[r % reps], pos, ks, interpret=interpret,
                                                        table=table, **launch)
                        acc = acc + sc[0, 0, 0, 0]
                    return acc
                row = dict(batch=b, context=ctx, keys=label, size_class=cls,
                           config="default" if cfg is None else cfg, launch=launch)
                t0 = time.perf_counter()
                try:
                    t, n = timeit(jax.jit(run), qi, ki, ks, tables, budget_s=0.3)
                    row.update(ms=t / steps * 1e3, gbps=nbytes / (t / steps) / 1e9)
                except Exception as e:  # a config that does not compile: record it, go on
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                row["wall_s"] = time.perf_counter() - t0
                rows.append(row)
                print(json.dumps(row), flush=True)
        del kib, ki8, ks8
    return rows


def pick_score_configs(rows):
    """Winners of a scoring sweep (``sweep_scores`` rows).

    Returns ``(per_case, per_class)``: per_case[keys]["BxCTX"] = the fastest config of that case
    (config, launch, ms, default_ms, speedup over the default); per_class[keys][size class] = the
    config with the best geometric mean of ms / default ms over the swept cases of that class (one case:
    its fastest), only where it beats the default (config, gain, cases)."""
    per_case, per_class = {}, {}
    for label in sorted({r["keys"] for r in rows}):
        mine = [r for r in rows if r["keys"] == label]
        for b, ctx in sorted({(r["batch"], r["context"]) for r in mine}):
            timed = [r for r in mine if (r["batch"], r["context"]) == (b, ctx) and "ms" in r]
            base = [r["ms"] for r in timed if r["config"] == "default"]
            if timed:
                top = min(timed, key=lambda r: r["ms"])
                per_case.setdefault(label, {})[f"{b}x{ctx}"] = dict(
                    config=top["config"], launch=top["launch"], ms=top["ms"], default_ms=base[0] if base else None,
                    speedup=base[0] / top["ms"] if base else None)
        for cls in sorted({r["size_class"] for r in mine}):
            sub = [r for r in mine if r["size_class"] == cls]
            ratios, best = _geomean_best(sub, "config", "default")
            if best != "default":
                per_class.setdefault(label, {})[cls] = dict(
                    config=best, gain=1.0 / ratios[json.dumps(best)],
                    cases=sorted(f"{r['batch']}x{r['context']}" for r in sub if r["config"] == "default"))
    return per_case, per_class


def install_score_configs(per_class, table=None):
    """A copy of the launch table ``table`` (None = ``gpu_config.DEFAULT_TABLE``) whose ``score`` holds the
    per-class winners (``pick_score_configs``), each over ``gpu_config.SCORE_LAUNCH_BASE`` (as timed)."""
    from pallas_kernels.decode import gpu_config
    table = gpu_config.DEFAULT_TABLE if table is None else table
    score = table.to_dict()["score"]
    for label, by_cls in per_class.items():
        for cls, pick in by_cls.items():
            score[label][cls] = dict(gpu_config.SCORE_LAUNCH_BASE, **pick["config"])
    return dataclasses.replace(table, score=score)


# ----------------------------------------------------------------------------- selection / sparse-attention sweeps

def _parse_cases(text):
    return [tuple(int(v) for v in c.split("x")) for c in text.split(",") if c]


def _parse_values(text):
    """``1,2,auto`` -> [1, 2, "auto"]."""
    return [v if v == "auto" else int(v) for v in (x.strip() for x in text.split(",")) if v]


def _geomean_best(rows, key, base_value):
    """{value: geometric mean over cases of ms / ms at ``base_value``} over the values timed (and
    checked equal) at every case, and the value with the smallest mean."""
    base = {(r["batch"], r["context"]): r["ms"] for r in rows if r[key] == base_value and "ms" in r}
    score = {}
    for r in rows:
        if "ms" in r and r.get("match", True) and (r["batch"], r["context"]) in base:
            score.setdefault(json.dumps(r[key]), []).append(math.log(r["ms"] / base[(r["batch"], r["context"])]))
    full = {k: math.exp(sum(v) / len(v)) for k, v in score.items() if len(v) == len(base) and base}
    best = json.loads(min(full, key=full.get)) if full else base_value
    return {k: float(v) for k, v in full.items()}, best


def sweep_select(cases, values, min_steps, interpret=False, l2_bytes=200 * 1024 * 1024, table=None):
    """Time ``select_pages_gpu`` (bf16 index keys, scoring launch from ``table``) for each
    ``select_splits`` value at each (batch, context); also the top-k kernels alone
    (``gpu_select._select_rows`` on precomputed raw scores). Every value's ids must equal the S = 1 ids.
    Returns (rows, {value: geomean of select ms / S=1 select ms}, best value)."""
    from pallas_kernels.decode import gpu_config, gpu_select
    from pallas_kernels.decode.common import pad_rows
    values = [1] + [v for v in values if v != 1]
    rows = []
    for b, ctx in cases:
        npg, reps, steps, p = case_sizes(b, ctx, min_steps, l2_bytes)
        kib = fill((p, PAGE, DI), 3, jnp.bfloat16)
        rng = np.random.default_rng(b * 7 + ctx)
        tables = jnp.asarray(rng.permutation(np.arange(1, p)).reshape(reps, b, npg), jnp.int32)
        qi = jax.random.normal(jax.random.PRNGKey(ctx + b), (steps, b, 1, G, DI), jnp.bfloat16)
        pos = jnp.full((b, 1), ctx - 1, jnp.int32)
        launch = gpu_config.score_launch(kib.dtype, total_pages=b * npg, table=table)

        @jax.jit
        def raw_scores(qi, ki, tables):
            return jnp.stack([gpu_select._page_scores_raw(qi[r], ki, tables[r % reps], pos, None,
                                                          interpret=interpret, **launch) for r in range(steps)])
        raw = raw_scores(qi, kib, tables)                        # [steps, B, R, W]
        pos_rows = pad_rows(jnp.repeat(pos, G, axis=1), 1, raw.shape[2], -1)
        ids1 = None
        for s in values:
            row = dict(batch=b, context=ctx, select_splits=s, width=int(raw.shape[-1]),
                       slices=gpu_select._resolve_select_splits(s, b, G, raw.shape[-1]) if s == "auto" else s)
            try:
                sel = jax.jit(lambda qi, ki, t, s=s: gpu_select.select_pages_gpu(
                    qi, ki, t, pos, topk=K, interpret=interpret, select_splits=s, table=table))
                ids = np.asarray(sel(qi[0], kib, tables[0]))
                ids1 = ids if s == 1 else ids1
                row["match"] = bool(np.array_equal(ids, ids1))

                def run(qi, ki, tables, s=s):
                    acc = jnp.zeros((), jnp.int32)
                    for r in range(steps):
                        acc = acc + gpu_select.select_pages_gpu(qi[r], ki, tables[r % reps], pos, topk=K,
                                                                interpret=interpret, select_splits=s,
                                                                table=table)[0, 0, 0, 0]
                    return acc

                def topk_only(raw, s=s):
                    acc = jnp.zeros((), jnp.int32)
                    for r in range(steps):
                        acc = acc + gpu_select._select_rows(raw[r], pos_rows, n_rows=G, page=PAGE, topk=K,
                                                            init_blocks=0, local_blocks=1, interpret=interpret,
                                                            splits=s)[0, 0, 0]
                    return acc
                t, n = timeit(jax.jit(run), qi, kib, tables, budget_s=0.3)
                t2, _ = timeit(jax.jit(topk_only), raw, budget_s=0.3)
                row.update(ms=t / steps * 1e3, topk_ms=t2 / steps * 1e3, calls=n)
            except Exception as e:  # a value that does not compile / is invalid here: record it, go on
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
        del kib, raw
    ratios, best = _geomean_best(rows, "select_splits", 1)
    return rows, ratios, best


def sweep_sparse_pps(cases, values, min_steps, mem_gib, interpret=False, l2_bytes=200 * 1024 * 1024, table=None):
    """Time sparse (MSA) ``paged_attention_gpu`` for each ``sparse_pages_per_split`` value at each
    (batch, context), over block ids from a real selection (bf16 index keys, one per step); o and
    lse are checked against pps = 1; the other launches from ``table``. Returns (rows, {value: geomean of ms / pps=1 ms}, best value)."""
    from pallas_kernels.decode import gpu_attention, gpu_select
    values = [1] + [v for v in values if v != 1]
    rows = []
    for b, ctx in cases:
        npg, reps, steps, p = case_sizes(b, ctx, min_steps, l2_bytes)
        need = p * PAGE * (G * D * 2 * 2 + DI * 2) / GIB
        if need > mem_gib:
            rows.append(dict(batch=b, context=ctx, skipped=f"cache {need:.0f} GiB > {mem_gib} GiB"))
            print(json.dumps(rows[-1]), flush=True)
            continue
        kp = fill((G, p, PAGE, D), 1, jnp.bfloat16)
        vp = fill((G, p, PAGE, D), 2, jnp.bfloat16)
        kib = fill((p, PAGE, DI), 3, jnp.bfloat16)
        rng = np.random.default_rng(b * 7 + ctx)
        tables = jnp.asarray(rng.permutation(np.arange(1, p)).reshape(reps, b, npg), jnp.int32)
        kq = jax.random.split(jax.random.PRNGKey(ctx + b), 2)
        q = jax.random.normal(kq[0], (steps, b, 1, H, D), jnp.bfloat16)
        qi = jax.random.normal(kq[1], (steps, b, 1, G, DI), jnp.bfloat16)
        pos = jnp.full((b, 1), ctx - 1, jnp.int32)
        # kib is an argument, not a closure: a captured array becomes an XLA constant (an 8.6 GB copy
        # at batch 32 x 1M, after which the sweep's first attention call failed on the H200, session 10).
        sel = jax.jit(lambda qi, ki, t: gpu_select.select_pages_gpu(qi, ki, t, pos, topk=K, interpret=interpret,
                                                                    table=table))
        ids = jnp.stack([sel(qi[r], kib, tables[r % reps]) for r in range(steps)])   # [steps, B, G, 1, K]
        del kib
        ref = None
        for pps in values:
            row = dict(batch=b, context=ctx, sparse_pps=pps)
            try:
                att = jax.jit(lambda q, kp, vp, t, i, pps=pps: gpu_attention.paged_attention_gpu(
                    q, kp, vp, t, pos, block_ids=i, interpret=interpret, sparse_pages_per_split=pps, table=table))
                o, lse = att(q[0], kp, vp, tables[0], ids[0])
                o = np.asarray(o.astype(jnp.float32))
                lse = np.asarray(lse)
                ref = (o, lse) if pps == 1 else ref
                row.update(o_maxerr=float(np.max(np.abs(o - ref[0]))), lse_maxerr=float(np.max(np.abs(lse - ref[1]))))
                row["match"] = bool(row["o_maxerr"] < 2e-2 and row["lse_maxerr"] < 1e-3)

                def run(q, kp, vp, tables, ids, pps=pps):
                    acc = jnp.zeros((), jnp.float32)
                    for r in range(steps):
                        o, _ = gpu_attention.paged_attention_gpu(q[r], kp, vp, tables[r % reps], pos,
                                                                 block_ids=ids[r], interpret=interpret,
                                                                 sparse_pages_per_split=pps, table=table)
                        acc = acc + o[0, 0, 0, 0].astype(jnp.float32)
                    return acc
                t, n = timeit(jax.jit(run), q, kp, vp, tables, ids, budget_s=0.3)
                row.update(ms=t / steps * 1e3, calls=n)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
        del kp, vp
    ratios, best = _geomean_best([r for r in rows if "skipped" not in r], "sparse_pps", 1)
    return rows, ratios, best


# ----------------------------------------------------------------------------- timing

def profile_cases(runs, steps, profile_dir):
    """One more call of each ``runs`` entry ``name -> (jitted fn, args)`` under ``jax.profiler`` (perfetto
    trace in ``profile_dir/name``); returns ``name -> trace_summary rows`` (device ms per decode step) and
    prints the busiest device lines of each: where the time between the kernels goes (XLA glue, gaps)."""
    import trace_summary
    out = {}
    for name, (fn, args) in runs.items():
        d = os.path.join(profile_dir, name)
        jax.block_until_ready(fn(*args))                  # compiled and warm before the trace
        with jax.profiler.trace(d, create_perfetto_trace=True):
            jax.block_until_ready(fn(*args))
        rows = trace_summary.summarize(trace_summary.load_events(trace_summary.newest_trace(d)), top=12, steps=steps)
        out[name] = rows
        print(f"profile {name} (ms per decode step):\n" + trace_summary.format_summary(rows, max_lines=2), flush=True)
    return out


def make_cache(p):
    """bf16 K / V pages ``[G, p, PAGE, D]``, bf16 index keys ``[p, PAGE, DI]`` and their fp8 e4m3 copy with
    per-token f32 scales ``[p, PAGE]``: ``(kp, vp, kib, ki8, ks8)``, filled by ``fill``."""
    kp = fill((G, p, PAGE, D), 1, jnp.bfloat16)
    vp = fill((G, p, PAGE, D), 2, jnp.bfloat16)
    kib = fill((p, PAGE, DI), 3, jnp.bfloat16)
    ki8, ks8 = jax.jit(lambda x: quantize(x, "float8_e4m3fn"))(kib)
    return kp, vp, kib, ki8, ks8


def step_fns(impl, table, runtime_dense_check=False):
    """One decode step of each timed op, ``fn(q, qi, kp, vp, ki, ks, pos, pt)``: ``dense`` (``paged_attention``)
    and ``msa`` (``msa_decode``, top-K; ``runtime_dense_check`` as the op's) return their whole output ``o``
    (``unrolled`` feeds it to the next step, so every element is computed, as in a model), ``select``
    (``msa_decode_select``) and ``scores`` (the GPU page-scoring kernel alone) one f32 element of theirs."""
    def dense(q, qi, kp, vp, ki, ks, pos, pt):
        return ops.paged_attention(q, kp, vp, pt, pos, implementation=impl, launch_table=table)[0]

    def msa(q, qi, kp, vp, ki, ks, pos, pt):
        return ops.msa_decode(q, qi, kp, vp, ki, pt, pos, ki_scale=ks, topk=K, implementation=impl,
                              launch_table=table, runtime_dense_check=runtime_dense_check)[0]

    def select(q, qi, kp, vp, ki, ks, pos, pt):
        ids = ops.msa_decode_select(qi, ki, pt, pos, ki_scale=ks, topk=K, implementation=impl, launch_table=table)
        return ids[0, 0, 0, 0].astype(jnp.float32)

    def scores(q, qi, kp, vp, ki, ks, pos, pt):
        from pallas_kernels.decode import gpu_select
        return gpu_select.page_scores_gpu(qi, ki, pt, pos, ks, table=table)[0, 0, 0, 0]
    return dict(dense=dense, msa=msa, select=select, scores=scores)


#: decode steps per loop iteration of ``unrolled`` (``--step-unroll``; 0 = every step of a call unrolled, as
#: before session 32: one traced copy per step made each (batch, context, Q) unit compile for ~15 s per function)
STEP_UNROLL = 8


#: scale of the previous step's output added to a step's queries (``unrolled``): far below a bf16 ulp of the
#: queries (no value changes), but not a constant XLA can fold away
_CHAIN = 1e-30


def unrolled(fn, steps, reps, unroll=None):
    """``jit(run)(q, qi, *args, tables)``: ``steps`` decode steps in one call, step ``r`` =
    ``fn(q[r], qi[r], *args, tables[r % reps])`` (a distinct query per step: identical steps would be
    merged by XLA's CSE, seen in the first H200 run, where single-replica rows then reported a quarter of
    the true step time), the results summed. A step whose ``fn`` returns an array of the queries' shape (an
    attention output) passes it on: the next step's queries are ``q[r + 1] + _CHAIN * o``, so XLA computes
    every element of every step's output (from one summed element it computed only what that element needs,
    e.g. one row's split combine); the call returns the last output's first element. ``unroll`` (default
    ``STEP_UNROLL``): steps per iteration of a ``fori_loop`` (the loop's predicate costs once per ``unroll``
    steps); 0 or >= steps: all steps unrolled."""
    unroll = STEP_UNROLL if unroll is None else unroll

    @jax.jit
    def run(q, qi, *args):
        *rest, tables = args
        chain = jax.eval_shape(fn, q[0], qi[0], *rest, tables[0]).shape == q.shape[1:]

        def step(r, carry):
            acc, prev = carry
            qr = q[r] + (prev * _CHAIN).astype(q.dtype) if chain else q[r]
            out = fn(qr, qi[r], *rest, tables[r % reps])
            if chain:
                return out.reshape(-1)[0].astype(jnp.float32), out.astype(q.dtype)
            return acc + out, prev

        carry = (jnp.zeros((), jnp.float32), jnp.zeros(q.shape[1:], q.dtype) if chain else None)
        if not unroll or unroll >= steps:
            for r in range(steps):
                carry = step(r, carry)
            return carry[0]
        return jax.lax.fori_loop(0, steps, step, carry, unroll=unroll)[0]
    return run


def bench_one(b, ctx, min_steps, impl, l2_bytes=200 * 1024 * 1024, dry=False, profile_dir=None, table=None):
    kv_bytes = b * ctx * G * D * 2 * 2
    npg, reps, steps, p = case_sizes(b, ctx, min_steps, l2_bytes)
    need = p * PAGE * TOKEN_BYTES
    row = dict(batch=b, context=ctx, replicas=reps, steps_per_call=steps, cache_gib=need / GIB)
    if dry:
        return row
    if impl == "pallas_gpu":   # the scoring launch this case runs (``table.score``, by size class)
        from pallas_kernels.decode import gpu_config
        row["score_class"] = gpu_config.score_size_class(b * npg)
        for label, dt in (("bf16", jnp.bfloat16), ("fp8", jnp.float8_e4m3fn)):
            row[f"score_launch_{label}"] = gpu_config.score_launch(dt, total_pages=b * npg, table=table)
    kp, vp, kib, ki8, ks8 = make_cache(p)
    rng = np.random.default_rng(b * 7 + ctx)
    perm = rng.permutation(np.arange(1, p)).reshape(reps, b, npg)  # shuffled, disjoint tables
    tables = jnp.asarray(perm, jnp.int32)
    kq = jax.random.split(jax.random.PRNGKey(ctx + b), 2)
    q = jax.random.normal(kq[0], (steps, b, 1, H, D), jnp.bfloat16)
    qi = jax.random.normal(kq[1], (steps, b, 1, G, DI), jnp.bfloat16)
    pos = jnp.full((b, 1), ctx - 1, jnp.int32)
    fns = step_fns(impl, table)
    msa_kv = b * G * K * PAGE * D * 2 * 2
    cases = {
        "dense": (fns["dense"], kib, None, kv_bytes),
        "msa_bf16": (fns["msa"], kib, None, b * ctx * DI * 2 + msa_kv),
        "msa_fp8": (fns["msa"], ki8, ks8, b * ctx * (DI + 4) + msa_kv),
        "select_bf16": (fns["select"], kib, None, b * ctx * DI * 2),
        "select_fp8": (fns["select"], ki8, ks8, b * ctx * (DI + 4)),
    }
    if impl == "pallas_gpu":
        cases["scores_bf16"] = (fns["scores"], kib, None, b * ctx * DI * 2)
        cases["scores_fp8"] = (fns["scores"], ki8, ks8, b * ctx * (DI + 4))
    for name, (fn, ki, ks, nbytes) in cases.items():
        t, n = timeit(unrolled(fn, steps, reps), q, qi, kp, vp, ki, ks, pos, tables)
        row[f"{name}_ms"] = t / steps * 1e3
        row[f"{name}_gbps"] = nbytes / (t / steps) / 1e9
        row[f"{name}_calls"] = n
    row["speedup_bf16"] = row["dense_ms"] / row["msa_bf16_ms"]
    row["speedup_fp8"] = row["dense_ms"] / row["msa_fp8_ms"]
    if profile_dir:
        runs = {n: (unrolled(cases[n][0], steps, reps), (q, qi, kp, vp, cases[n][1], cases[n][2], pos, tables))
                for n in ("msa_bf16", "msa_fp8", "dense")}
        rows = profile_cases(runs, steps, os.path.join(profile_dir, f"b{b}_ctx{ctx}"))
        row["profile"] = {n: r[:2] for n, r in rows.items()}
    del kp, vp, kib, ki8, ks8
    return row


def main():
    global STEP_UNROLL       # --step-unroll sets the module default that unrolled() reads
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/msa_decode")
    ap.add_argument("--smoke", action="store_true", help="small HBM copy (CPU plumbing run)")
    ap.add_argument("--mem-gib", type=float, default=110.0, help="skip combos whose cache exceeds this")
    ap.add_argument("--steps", type=int, default=64,
                    help="minimum decode steps per timed call (each call's host dispatch, ~0.3-0.5 ms on the H200, "
                         "is spread over them: at 4 steps it added ~0.1 ms to a 2 ms MSA step)")
    ap.add_argument("--step-unroll", type=int, default=STEP_UNROLL,
                    help="decode steps per loop iteration inside a timed call (0 = all unrolled: slow to compile)")
    ap.add_argument("--contexts", default="32768,131072,1048576")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--sweep-scores", default="",
                    help="batch x context cases, e.g. 32x1048576,1x1048576: sweep the scoring kernel's launch "
                         "configs there first (bf16 and fp8 separately), install each case's winner into its size "
                         "class of the run's launch table (LaunchTable.score) and time the table with them")
    ap.add_argument("--score-family", default="wide",
                    help=f"comma-separated families of launch configs that --sweep-scores times (score_candidates; "
                         f"{', '.join(SCORE_FAMILIES)}): wide = 4 warps x unroll x stages x pages per program; "
                         "narrow = 1-2 warps per program; persistent = the persistent scorer with SMs x {1,2,4} "
                         "programs; evict = streaming (evict_first) key loads")
    ap.add_argument("--sweep-budget-s", type=float, default=None,
                    help="wall seconds for --sweep-scores, shared by its (case, key dtype) groups; candidates left "
                         "when a group's share is spent are not timed (default: no limit)")
    ap.add_argument("--sms", type=int, default=0,
                    help="SMs for the persistent candidates' program counts (0 = the device's core_count, else 132)")
    ap.add_argument("--sweep-cases", default="32x1048576,1x1048576",
                    help="batch x context cases of --sweep-select / --sweep-sparse-pps when --sweep-scores is not given")
    ap.add_argument("--sweep-select", default="",
                    help="select_splits values, e.g. 1,2,4,8,16,auto: time select_pages_gpu with each (ids must equal "
                         "S=1's) and keep the best geometric mean in the launch table's select_splits for the rest "
                         "of the run")
    ap.add_argument("--sweep-sparse-pps", default="",
                    help="sparse_pages_per_split values, e.g. 1,2,4,8: time sparse paged_attention_gpu with each (o/lse "
                         "checked against pps=1) and keep the best in the launch table's sparse_pps")
    ap.add_argument("--sweep-steps", type=int, default=4,
                    help="minimum decode steps per timed call in the sweeps (fewer than --steps: each candidate "
                         "compiles its own unrolled steps; the sweeps compare candidates, the table reports)")
    ap.add_argument("--profile", action="store_true",
                    help="after timing each case, profile one more call of msa_bf16 / msa_fp8 / dense under "
                         "jax.profiler (traces under --out/profile) and print the top device ops per step")
    ap.add_argument("--serving", action="store_true",
                    help="after the rows, the serving sweep (msa_decode_serving): batch x context cells with "
                         "lengths +-25%% inside a batch, Q rows per request, bf16 and fp8 index keys, MSA and dense, "
                         "after its own check; cells under \"serving\" in the JSON, its table printed last")
    ap.add_argument("--serving-batches", default="1,8,32,64,128")
    ap.add_argument("--serving-contexts", default="1024,4096,10240,51200,204800")
    ap.add_argument("--serving-q", default="8,1", help="query rows per request (1-16), timed in this order")
    ap.add_argument("--serving-first", default=None,
                    help="batch x context cells timed before the grid (default: the issue's table cells "
                         "128x1024,64x4096,128x5120,32x10240,8x102400,32x204800; '' = none)")
    ap.add_argument("--serving-budget-s", type=float, default=None,
                    help="wall seconds for the serving sweep's timings: a (batch, context, Q) starts only while "
                         "some is left (the one running may overrun it by its compile + timing); the rest are "
                         "listed as skipped (default: no limit)")
    ap.add_argument("--serving-seed", type=int, default=0, help="seed of the request lengths, pages and queries")
    ap.add_argument("--serving-tilings", default="default,legacy",
                    help="attention tilings timed side by side in the serving sweep (msa_decode_serving.TILINGS; "
                         "the first one's cells are the headline, the table compares the others to it)")
    ap.add_argument("--serving-row-corr", type=float, default=0.0,
                    help="correlation in [0, 1) of a request's Q rows' index queries in the serving sweep (0 = "
                         "independent rows; MTP draft rows are consecutive tokens whose selections overlap)")
    ap.add_argument("--serving-profile", action="store_true",
                    help="profile each serving unit once more (dense and MSA bf16 index keys, first tiling) under "
                         "jax.profiler and print / keep the top device ops per step")
    ap.add_argument("--serving-dense-check", action="store_true",
                    help="msa_decode(runtime_dense_check=True) in the serving timings (path \"cond\")")
    a = ap.parse_args()
    if a.step_unroll < 0:
        ap.error("--step-unroll must be >= 0")
    STEP_UNROLL = a.step_unroll
    serving_q = [int(x) for x in a.serving_q.split(",") if x]
    if not 0.0 <= a.serving_row_corr < 1.0:
        ap.error(f"--serving-row-corr takes a value in [0, 1), got {a.serving_row_corr}")
    if a.serving and not all(1 <= x <= 16 for x in serving_q):
        ap.error(f"--serving-q takes 1..16 query rows, got {a.serving_q!r}")
    import msa_decode_serving
    if a.serving and (unknown := [t for t in a.serving_tilings.split(",") if t not in msa_decode_serving.TILINGS]):
        ap.error(f"unknown --serving-tilings {unknown}; known: {list(msa_decode_serving.TILINGS)}")
    families = [f for f in a.score_family.split(",") if f]
    if unknown := [f for f in families if f not in SCORE_FAMILIES]:
        ap.error(f"unknown --score-family {unknown}; known: {SCORE_FAMILIES}")
    os.makedirs(a.out, exist_ok=True)
    rng = np.random.default_rng(int(time.time()))
    out = {"device": str(jax.devices()[0]), "jax": jax.__version__}
    impl = "pallas_gpu" if jax.default_backend() == "gpu" else "xla"
    out["variants"] = {}
    chosen = None
    from pallas_kernels.decode import gpu_config
    table = gpu_config.DEFAULT_TABLE      # the run's launch table, passed to every kernel / op call
    for variant in (["dynamic", "static"] if impl == "pallas_gpu" else ["n/a"]):
        if impl == "pallas_gpu":
            table = dataclasses.replace(gpu_config.DEFAULT_TABLE, loop=variant)
        try:
            res = check(impl, rng, table=table)
        except Exception as e:  # record the compiler's message, keep going with the next variant
            msg = "".join(ch for ch in str(e) if 32 <= ord(ch) < 127 or ch == "\n")
            keep = [ln for ln in msg.split("\n") if "rror" in ln or "failed" in ln][:20]
            res = {"ok": False, "error": type(e).__name__, "lines": keep, "head": msg[:1500]}
            with open(os.path.join(a.out, f"error_{variant}.txt"), "w") as f:
                f.write(msg[:200000])
        out["variants"][variant] = res
        print(f"check[{variant}]:", json.dumps(res)[:1500], flush=True)
        if res.get("ok"):
            chosen = variant
            break
    out["check"] = out["variants"].get(chosen, {"ok": False})
    out["variant"] = chosen
    if chosen is None:
        with open(os.path.join(a.out, "msa_decode.json"), "w") as f:
            json.dump(out, f, indent=1)
        print("no kernel variant passed the check; not timing")
        return
    # GPU: the real kernels; CPU with --smoke: the same plumbing with the kernels in interpret mode.
    sweep_interp = impl != "pallas_gpu"
    sweep_cases = _parse_cases(a.sweep_scores or a.sweep_cases)
    if a.sweep_scores and (impl == "pallas_gpu" or a.smoke):
        sms = a.sms or getattr(jax.devices()[0], "core_count", 0) or 132
        before = table.to_dict()["score"]
        cands = {label: family_candidates(label, families, sms, table) for label in ("bf16", "fp8")}
        print(f"score sweep: families {families}, {sms} SMs, {len(cands['bf16'])} bf16 / {len(cands['fp8'])} fp8 "
              f"candidates per case", flush=True)
        t0 = time.time()
        sweep_rows = sweep_scores(sweep_cases, a.sweep_steps, cands, interpret=sweep_interp, budget_s=a.sweep_budget_s,
                                  table=table, **({"l2_bytes": 1} if sweep_interp else {}))
        n_skip = sum("skipped" in r for r in sweep_rows)
        print(f"score sweep: {len(sweep_rows) - n_skip} configs timed in {time.time() - t0:.0f} s, {n_skip} left "
              f"untimed (--sweep-budget-s)", flush=True)
        per_case, per_class = pick_score_configs(sweep_rows)
        tuned = install_score_configs(per_class, table)
        out["score_sweep"] = {"families": families, "sms": sms, "rows": sweep_rows, "best_per_case": per_case,
                              "installed": per_class, "before": before, "after": tuned.to_dict()["score"]}
        for label, by_case in per_case.items():
            for case, w in by_case.items():
                print(f"score sweep {label} {case}: best {json.dumps(w['config'])} {w['ms']:.4f} ms "
                      f"(default {w['default_ms'] or float('nan'):.4f} ms)", flush=True)
        print("score sweep installed per size class:", json.dumps(per_class), "->",
              json.dumps(out["score_sweep"]["after"]), flush=True)
        out["check_tuned"] = check(impl, rng, interpret=sweep_interp, table=tuned)
        print("check with the tuned configs:", json.dumps(out["check_tuned"]), flush=True)
        if out["check_tuned"]["ok"]:
            table = tuned
        else:
            print("the tuned configs failed the check: the table is back to", json.dumps(before), flush=True)
        with open(os.path.join(a.out, "msa_decode.json"), "w") as f:   # kept if a later step fails
            json.dump(out, f, indent=1)
    if a.sweep_select and (impl == "pallas_gpu" or a.smoke):
        before = table.select_splits
        sel_rows, ratios, best = sweep_select(sweep_cases, _parse_values(a.sweep_select), a.sweep_steps,
                                              interpret=sweep_interp, table=table,
                                              **({"l2_bytes": 1} if sweep_interp else {}))
        table = dataclasses.replace(table, select_splits=best)
        out["select_sweep"] = {"rows": sel_rows, "geomean_vs_s1": ratios, "best": best, "before": before}
        print("select sweep (geomean select ms / S=1):", json.dumps(ratios), f"-> table select_splits={best!r}",
              flush=True)
    if a.sweep_sparse_pps and (impl == "pallas_gpu" or a.smoke):
        before = table.sparse_pps
        pps_rows, ratios, best = sweep_sparse_pps(sweep_cases, _parse_values(a.sweep_sparse_pps), a.sweep_steps, a.mem_gib,
                                                  interpret=sweep_interp, table=table,
                                                  **({"l2_bytes": 1} if sweep_interp else {}))
        table = dataclasses.replace(table, sparse_pps=best)
        out["sparse_pps_sweep"] = {"rows": pps_rows, "geomean_vs_pps1": ratios, "best": best, "before": before}
        print("sparse pps sweep (geomean attention ms / pps=1):", json.dumps(ratios), f"-> table sparse_pps={best!r}",
              flush=True)
    if impl == "pallas_gpu":
        out["gpu_config"] = table.to_dict()
    out["implementations"] = implementation_report()
    out["hbm_copy_gbps"] = hbm_copy_bandwidth(64 << 20 if a.smoke else 4 * GIB) / 1e9
    print(f"HBM copy (x+1 bf16, read+write): {out['hbm_copy_gbps']:.0f} GB/s", flush=True)
    rows, skipped = [], []
    for ctx in [int(x) for x in a.contexts.split(",") if x]:
        for b in [int(x) for x in a.batches.split(",") if x]:
            dry = bench_one(b, ctx, a.steps, impl, dry=True)
            if dry["cache_gib"] > a.mem_gib:
                skipped.append(dict(dry, reason=f"cache {dry['cache_gib']:.0f} GiB > {a.mem_gib} GiB"))
                print("skip", skipped[-1], flush=True)
                continue
            t0 = time.time()
            try:
                row = bench_one(b, ctx, a.steps, impl, profile_dir=os.path.join(a.out, "profile") if a.profile else None,
                                table=table)
            except Exception as e:  # e.g. out of memory: record and go on
                msg = "".join(ch for ch in str(e) if 32 <= ord(ch) < 127)[:600]
                skipped.append(dict(dry, reason=f"{type(e).__name__}: {msg}"))
                print("failed", skipped[-1], flush=True)
                continue
            row["wall_s"] = time.time() - t0
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(os.path.join(a.out, "msa_decode.json"), "w") as f:
                json.dump(dict(out, rows=rows, skipped=skipped), f, indent=1)
    out.update(rows=rows, skipped=skipped)
    with open(os.path.join(a.out, "msa_decode.json"), "w") as f:
        json.dump(out, f, indent=1)
    bw = out["hbm_copy_gbps"]
    print(f"\nHBM copy {bw:.0f} GB/s; check ok={out['check']['ok']}")
    print(f"{'B':>3} {'ctx':>8} {'dense ms':>9} {'msa16 ms':>9} {'msa8 ms':>9} {'x bf16':>7} {'x fp8':>7} "
          f"{'dense %bw':>9} {'msa16 %bw':>9} {'msa8 %bw':>9} {'scor16 %bw':>10} {'scor8 %bw':>9} {'scor16 ms':>9} "
          f"{'scor8 ms':>8} {'sel16 ms':>8} {'class':>6}")
    nan = float("nan")
    for r in rows:
        print(f"{r['batch']:>3} {r['context']:>8} {r['dense_ms']:>9.3f} {r['msa_bf16_ms']:>9.3f} "
              f"{r['msa_fp8_ms']:>9.3f} {r['speedup_bf16']:>7.2f} {r['speedup_fp8']:>7.2f} "
              f"{100 * r['dense_gbps'] / bw:>9.1f} {100 * r['msa_bf16_gbps'] / bw:>9.1f} "
              f"{100 * r['msa_fp8_gbps'] / bw:>9.1f} {100 * r.get('scores_bf16_gbps', nan) / bw:>10.1f} "
              f"{100 * r.get('scores_fp8_gbps', nan) / bw:>9.1f} {r.get('scores_bf16_ms', nan):>9.3f} "
              f"{r.get('scores_fp8_ms', nan):>8.3f} {r['select_bf16_ms']:>8.3f} {r.get('score_class', '-'):>6}")
    for r in rows:   # the scoring launch each case ran (the table's score entry of its size class)
        if "score_class" in r:
            print(f"scoring launch B={r['batch']} ctx={r['context']} ({r['score_class']}): "
                  f"bf16 {json.dumps(r['score_launch_bf16'])}; fp8 {json.dumps(r['score_launch_fp8'])}")
    for r in skipped:
        print("skipped:", r)
    if a.serving:
        serving(a, out, impl, table, serving_q)


def serving(a, out, impl, table, serving_q):
    """The serving sweep (``msa_decode_serving``): its check, its cells into ``out`` and the JSON, the table."""
    import msa_decode_serving as sv
    path = os.path.join(a.out, "msa_decode.json")
    # GPU: the kernels; CPU with --smoke: the GPU kernels in interpret mode for the check, xla timings.
    check_impl = impl if impl == "pallas_gpu" or not a.smoke else "pallas_gpu_interpret"
    tilings = sv.tiling_tables([t for t in a.serving_tilings.split(",") if t], table)
    # Every tiling's kernels are checked on the GPU; in interpret mode (CPU, minutes per tiling) the first only.
    checked = tilings if impl == "pallas_gpu" else dict([next(iter(tilings.items()))])
    checks = {n: sv.serving_check(check_impl, t, a.serving_seed) for n, t in checked.items()}
    out["serving_check"] = dict(next(iter(checks.values())), implementation=check_impl,
                                tilings_ok={n: c["ok"] for n, c in checks.items()})
    out["serving_check"]["ok"] = all(c["ok"] for c in checks.values())
    print("serving check:", json.dumps(out["serving_check"]), flush=True)
    order = sv.cell_order([int(x) for x in a.serving_batches.split(",") if x],
                          [int(x) for x in a.serving_contexts.split(",") if x],
                          _parse_cases(sv.FIRST if a.serving_first is None else a.serving_first))
    out["serving_config"] = dict(order=order, q_rows=serving_q, steps=a.steps, budget_s=a.serving_budget_s,
                                 seed=a.serving_seed, spread=sv.SPREAD, mem_gib=a.mem_gib, implementation=impl,
                                 runtime_dense_check=a.serving_dense_check, row_corr=a.serving_row_corr)
    out["serving_config"]["tilings"] = {n: t.to_dict() for n, t in tilings.items()}

    def save(cells, skipped):
        with open(path, "w") as f:
            json.dump(dict(out, serving=cells, serving_skipped=skipped), f, indent=1)
    cells, skipped, wall = sv.run_sweep(order, serving_q, a.steps, impl, table, a.mem_gib, a.serving_budget_s,
                                        a.serving_seed, a.serving_dense_check,
                                        **({} if impl == "pallas_gpu" else {"l2_bytes": 1}), on_unit=save,
                                        tilings=tilings,
                                        profile_dir=(os.path.join(a.out, "serving_profile") if a.serving_profile
                                                     else None), row_corr=a.serving_row_corr, unroll=a.step_unroll)
    out["serving_config"]["wall_s"] = wall
    out.update(serving=cells, serving_skipped=skipped)
    save(cells, skipped)
    print()
    print(sv.format_table(cells, skipped, out["serving_check"]["ok"]))


if __name__ == "__main__":
    main()
