"""Forward / input-gradient probe: the warp-specialized Mosaic GPU grouped matmul vs the Triton gmm and dense matmul.

One GPU call checks and times ``pallas_kernels.moe.gpu_gmm_ws.gmm_ws`` (each of ``WS_GMM_CANDIDATES``) against the
default Triton ``gpu_gmm.gmm_forward`` and the dense matmul (cuBLAS) of the same M, K, N:

0. a ragged check (32 groups with empty ones, unaligned sizes, sum below M) of every candidate, forward and
   transposed, against an fp32 oracle, every element (bf16 output: within 2**-7 relative or 1e-2 absolute);
1. kernel level, M2 and M3 at ``--tokens`` tokens (routing and expert sort as bench/moe.py): both projections'
   forward (``fwd1``: [T*k, h] x [h, 2i], ``fwd2``: [T*k, i] x [i, h]) and input gradient (``dlhs1``: [T*k, 2i] x
   [h, 2i]^T, ``dlhs2``: [T*k, h] x [i, h]^T); relative Frobenius error vs the Triton output and vs an fp32 oracle
   on three groups (first, largest, last); ``--rounds`` interleaved rounds (median of ``--reps`` synced calls per
   round): ms, TFLOP/s, and the rate as a fraction of the same-shape dense matmul;
2. gmm and layer level at each of ``--gmm-tokens``: bench/moe.py's harness (both grouped matmuls with the gated
   activation between, forward and forward+backward; the MoE layer with sort, permute and combine) with the
   fastest passing candidates as forward / dlhs kernels vs today's kernels (Triton forward / dlhs, the
   warp-specialized weight gradient), vs the dense matmuls of the same FLOPs, interleaved rounds: issue 29's
   ratios (grouped matmuls >= 80 % of dense forward, >= 75 % forward+backward; the layer within 10 %).

Prints JSON lines, then a table; writes ``<--out>/gmm_ws_probe.json``.

On the GPU: ``python3 bench/gmm_ws_probe.py --out $OUT``. CPU plumbing (jax >= 0.11: the Mosaic GPU
interpreter; tiny shapes, timings meaningless): ``python bench/gmm_ws_probe.py --cpu``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import moe as bench_moe  # noqa: E402
from tgmm_ws_probe import _rel, _timeit  # noqa: E402
from minimax_jax.ops.moe.permute import sort_by_expert  # noqa: E402
from pallas_kernels.common import mosaic_interpreter_available as interpreter_available  # noqa: E402
from pallas_kernels.moe import gpu_gmm  # noqa: E402
from pallas_kernels.moe.gpu_gmm_ws import WS_GMM_CANDIDATES  # noqa: E402
from pallas_kernels.moe.gpu_tgmm_ws import WsTgmmConfig  # noqa: E402

DTYPE = jnp.bfloat16
CPU_SHAPES = {"m2": dict(h=256, i=128, e=8, k=2), "m3": dict(h=256, i=128, e=4, k=2)}
MAX_REL = 1e-2          # a candidate further than this from Triton or the oracle at any shape is not adopted


def _oracle(lhs, rhs, sizes, transpose):
    """fp32 (HIGHEST) grouped matmul on the host's device: rows past the sum are 0."""
    out = []
    start = 0
    for g, s in enumerate(sizes):
        w = rhs[g].T if transpose else rhs[g]
        out.append(jnp.matmul(lhs[start:start + s].astype(jnp.float32), w.astype(jnp.float32), precision="highest"))
        start += s
    out.append(jnp.zeros((lhs.shape[0] - start, out[0].shape[1]), jnp.float32))
    return jnp.concatenate(out)


def ragged_check(cands, a, rows):
    """Every candidate, forward and transposed, on 32 ragged groups (3 empty, sum < M) vs the fp32 oracle."""
    rng = np.random.default_rng(7)
    m, kd, nd, g = (200, 128, 256, 6) if a.cpu else (4096, 1024, 1536, 32)
    sizes = rng.integers(1, 2 * m // g, size=g)
    sizes[rng.choice(g, size=min(3, g - 1), replace=False)] = 0
    sizes = (sizes * (0.9 * m / max(sizes.sum(), 1))).astype(int)
    gs = jnp.asarray(sizes, jnp.int32)
    lhs = jax.random.normal(jax.random.key(0), (m, kd), DTYPE)
    for transpose in (False, True):
        rhs = (jax.random.normal(jax.random.key(1), (g, nd, kd) if transpose else (g, kd, nd), DTYPE)
               / np.sqrt(kd)).astype(DTYPE)
        ref = _oracle(lhs, rhs, sizes, transpose)
        for c in cands:
            r = {"check": "ragged", "kernel": c.label(), "transpose": transpose, "sizes_sum": int(sizes.sum()), "m": m}
            try:
                out = jax.jit(lambda p, q, s, c=c: gpu_gmm.gmm_forward(p, q, s, transpose_rhs=transpose, config=c,
                                                                      interpret=a.cpu))(lhs, rhs, gs)
                err = jnp.abs(out.astype(jnp.float32) - ref)
                tol = jnp.maximum(2.0 ** -7 * jnp.abs(ref), 1e-2)
                r["max_abs_err"] = float(err.max())
                r["ok"] = bool(jnp.all(err <= tol)) and bool(jnp.all(out[int(sizes.sum()):] == 0))
            except Exception as e:   # recorded; the other candidates go on
                r["ok"] = False
                r["error"] = f"{type(e).__name__}: {str(e)[:600]}"
                traceback.print_exc()
            print(json.dumps(r), flush=True)
            rows.append(r)


def kernel_level(model, s, tokens, cands, a, rows):
    """Check and time every candidate against the Triton gmm and the dense matmul at the four shapes."""
    x, _, ex, wi, wo, _ = bench_moe._problem(s, tokens, DTYPE, seed=tokens)
    _, _, gs = sort_by_expert(ex, s["e"])
    m = x.shape[0] * s["k"]
    sizes = np.asarray(gs)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    pick = sorted({0, int(np.argmax(sizes)), len(sizes) - 1})
    h, i = s["h"], s["i"]
    for kind, kd, rhs, transpose, tri_cfg in (("fwd1", h, wi, False, gpu_gmm.DEFAULT_CONFIG),
                                              ("fwd2", i, wo, False, gpu_gmm.DEFAULT_CONFIG),
                                              ("dlhs1", 2 * i, wi, True, gpu_gmm.DEFAULT_DLHS_CONFIG),
                                              ("dlhs2", h, wo, True, gpu_gmm.DEFAULT_DLHS_CONFIG)):
        nd = rhs.shape[1] if transpose else rhs.shape[2]
        lhs = jax.random.normal(jax.random.key(1), (m, kd), DTYPE)
        flops = 2.0 * m * kd * nd
        fns = {"triton " + tri_cfg.label(): jax.jit(lambda p, q, g, c=tri_cfg, t=transpose: gpu_gmm.gmm_forward(
            p, q, g, transpose_rhs=t, config=c, interpret=a.cpu))}
        for c in cands:
            fns[c.label()] = jax.jit(lambda p, q, g, c=c, t=transpose: gpu_gmm.gmm_forward(
                p, q, g, transpose_rhs=t, config=c, interpret=a.cpu))
        fns["dense"] = jax.jit(lambda p, q, g, t=transpose: p @ (q[0].T if t else q[0]))
        ref = None
        live = {}
        for name, f in fns.items():
            r = {"model": model, "tokens": tokens, "proj": kind, "kernel": name, "shape": [m, kd, nd]}
            try:
                out = f(lhs, rhs, gs)
                if name != "dense":
                    if name.startswith("triton"):
                        ref = out
                    r["rel_vs_triton"] = _rel(out, ref) if ref is not None else float("nan")
                    r["rel_vs_fp32_groups"] = [
                        _rel(out[starts[g]:starts[g] + sizes[g]],
                             _oracle(lhs[starts[g]:starts[g] + sizes[g]], rhs[g:g + 1], [sizes[g]], transpose))
                        for g in pick]
                live[name] = (f, r)
            except Exception as e:
                r["error"] = f"{type(e).__name__}: {str(e)[:600]}"
                traceback.print_exc()
            print(json.dumps(r), flush=True)
            rows.append(r)
        for _ in range(a.rounds):
            for name, (f, r) in live.items():
                r.setdefault("ms", []).append(_timeit(f, (lhs, rhs, gs), a.reps) * 1e3)
        dense_ms = statistics.median(live["dense"][1]["ms"]) if "dense" in live else float("nan")
        for name, (f, r) in live.items():
            r["ms_median"] = statistics.median(r["ms"])
            r["tflop_s"] = flops / r["ms_median"] / 1e9
            r["vs_dense"] = dense_ms / r["ms_median"]
            print(json.dumps(r), flush=True)


def _passed(rows, label, kinds):
    """Mean TFLOP/s of candidate ``label`` over the shapes ``kinds`` if it passed every check there, else None."""
    rs = [r for r in rows if r.get("kernel") == label and r.get("proj") in kinds]
    checks = [r for r in rows if r.get("check") == "ragged" and r["kernel"] == label]
    if not rs or not all(c["ok"] for c in checks) or not all(
            "tflop_s" in r and r["rel_vs_triton"] < MAX_REL and max(r["rel_vs_fp32_groups"]) < MAX_REL for r in rs):
        return None
    return statistics.mean(r["tflop_s"] for r in rs)


def gmm_level(model, s, tokens, configs, a, rows):
    """bench/moe.py's harness: grouped matmuls and the layer, today's kernels vs ``configs``, vs dense."""
    impl = "pallas_gpu_interpret" if a.cpu else "pallas_gpu"
    tgmm = WsTgmmConfig(num_sms=4) if a.cpu else WsTgmmConfig()
    today = {**gpu_gmm.DEFAULT_CONFIGS, "tgmm": tgmm}
    new = {**configs, "tgmm": tgmm}
    gargs = bench_moe._case_args(s, tokens, tokens, "gmm", DTYPE)
    dargs = bench_moe._case_args(s, tokens, tokens, "dense", DTYPE)
    largs = bench_moe._case_args(s, tokens, tokens, "full", DTYPE)
    flops = 2.0 * tokens * s["k"] * s["h"] * s["i"] * 3
    fns = {}
    for tag, cfgs in (("today", today), ("ws", new)):
        v = bench_moe._variants(False, impl, cfgs)
        for mode, j in (("fwd", 0), ("fwd+bwd", 1)):
            fns[(tag, "gmm", mode)] = (jax.jit(v["pallas_gpu_gmm"][1][j]), gargs)
            fns[(tag, "layer", mode)] = (jax.jit(v["pallas_gpu"][1][j]), largs)
    dense = bench_moe._variants(False, None)["dense_matmul"][1]
    for mode, j in (("fwd", 0), ("fwd+bwd", 1)):
        fns[("dense", "dense", mode)] = (jax.jit(dense[j]), dargs)
    rel = {}
    for mode in ("fwd", "fwd+bwd"):     # one pair of outputs at a time (M3's weight gradients are 14 GiB a set)
        o_ws = fns[("ws", "gmm", mode)][0](*gargs)
        o_today = fns[("today", "gmm", mode)][0](*gargs)
        rel[mode] = [_rel(p, q) for p, q in zip(jax.tree.leaves(o_ws), jax.tree.leaves(o_today))]
        del o_ws, o_today
    ms = {key: [] for key in fns}
    for _ in range(a.rounds):
        for key, (f, args) in fns.items():
            ms[key].append(_timeit(f, args, a.reps) * 1e3)
    for mode in ("fwd", "fwd+bwd"):
        mult = 1 if mode == "fwd" else 3
        d = ms[("dense", "dense", mode)]
        r = {"model": model, "tokens": tokens, "mode": mode, "ws": {k: c.label() for k, c in configs.items()},
             "ms": {f"{t}_{w}": ms[(t, w, mode)] for t, w, m2 in fns if m2 == mode},
             "rel_ws_vs_today": rel[mode],
             "dense_tflop_s": mult * flops / statistics.median(d) / 1e9}
        for tag in ("today", "ws"):
            g_ms, l_ms = ms[(tag, "gmm", mode)], ms[(tag, "layer", mode)]
            r[f"gmm_vs_dense_{tag}"] = statistics.median([x / y for x, y in zip(d, g_ms)])
            r[f"layer_over_gmm_{tag}"] = statistics.median([y / x for x, y in zip(g_ms, l_ms)]) - 1.0
            r[f"gmm_tflop_s_{tag}"] = mult * flops / statistics.median(g_ms) / 1e9
        print(json.dumps(r), flush=True)
        rows.append(r)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per step at the kernel level")
    ap.add_argument("--gmm-tokens", default="8192,32768", help="comma list of tokens per step at the gmm level")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    ap.add_argument("--reps", type=int, default=20, help="synced calls per round (median)")
    ap.add_argument("--models", default="m2,m3", help="comma list of m2, m3")
    ap.add_argument("--out", default=".", help="folder for gmm_ws_probe.json")
    ap.add_argument("--cpu", action="store_true", help="plumbing run: interpreters, tiny shapes (jax >= 0.11)")
    a = ap.parse_args(argv)
    try:
        gmm_tokens = [int(t) for t in a.gmm_tokens.split(",") if t]
    except ValueError:
        ap.error(f"--gmm-tokens must be a comma list of ints, got {a.gmm_tokens!r}")
    models = [m for m in a.models.split(",") if m]
    if a.tokens < 1 or a.rounds < 1 or a.reps < 1 or any(t < 1 for t in gmm_tokens):
        ap.error("--tokens, --gmm-tokens, --rounds and --reps must be >= 1")
    if not models or any(m not in bench_moe.SHAPES for m in models):
        ap.error(f"--models must be a comma list of {sorted(bench_moe.SHAPES)}, got {a.models!r}")
    if a.cpu and not interpreter_available():
        ap.error(f"--cpu needs the Mosaic GPU interpreter of jax >= 0.11 (this is jax {jax.__version__})")
    shapes = CPU_SHAPES if a.cpu else bench_moe.SHAPES
    tokens = 64 if a.cpu else a.tokens
    if a.cpu:
        gmm_tokens = [64]
    cands = ([dataclasses.replace(c, num_sms=4) for c in WS_GMM_CANDIDATES[:2]] if a.cpu
             else list(WS_GMM_CANDIDATES))
    rows = []
    os.makedirs(a.out, exist_ok=True)

    def save():   # after every stage: a run stopped by a time limit keeps what it measured
        with open(os.path.join(a.out, "gmm_ws_probe.json"), "w") as f:
            json.dump(rows, f, indent=1)
    print(json.dumps({"device": jax.devices()[0].device_kind, "jax": jax.__version__}), flush=True)
    ragged_check(cands, a, rows)
    save()
    for model in models:
        kernel_level(model, shapes[model], tokens, cands, a, rows)
        save()
    best = {}
    for key, kinds in (("fwd", ("fwd1", "fwd2")), ("dlhs", ("dlhs1", "dlhs2"))):
        ok = {c: t for c in cands if (t := _passed(rows, c.label(), kinds)) is not None}
        if ok:
            best[key] = max(ok, key=ok.get)
    print("fastest candidates that passed:", {k: c.label() for k, c in best.items()}, flush=True)
    for key, kinds in (("fwd", ("fwd1", "fwd2")), ("dlhs", ("dlhs1", "dlhs2"))):
        tri = [r["tflop_s"] for r in rows if r.get("proj") in kinds and r["kernel"].startswith("triton") and "tflop_s" in r]
        if key in best and tri and _passed(rows, best[key].label(), kinds) <= statistics.mean(tri) and not a.cpu:
            print(f"{key}: {best[key].label()} is not faster than the Triton kernel on average: not used", flush=True)
            del best[key]
    if best:
        configs = {"fwd": best.get("fwd", gpu_gmm.DEFAULT_CONFIG), "dlhs": best.get("dlhs", gpu_gmm.DEFAULT_DLHS_CONFIG)}
        for t in gmm_tokens:
            for model in models:
                try:
                    gmm_level(model, shapes[model], t, configs, a, rows)
                except Exception:
                    traceback.print_exc()
                save()
    print("\nmodel tokens proj   kernel                      ms  TFLOP/s  of dense  rel vs triton / error")
    for r in rows:
        if "check" in r:
            print(f"ragged check {r['kernel']:22s} transpose={r['transpose']!s:5s} ok={r['ok']} "
                  f"{r.get('max_abs_err', r.get('error'))}")
        elif "kernel" in r and "proj" in r and ("ms_median" in r or "error" in r):
            print(f"{r['model']} {r['tokens']:6d} {r['proj']:5s} {r['kernel']:26s} {r.get('ms_median', float('nan')):6.3f} "
                  f"{r.get('tflop_s', float('nan')):7.1f} {r.get('vs_dense', float('nan')):8.1%}  "
                  f"{str(r.get('rel_vs_triton', r.get('error')))[:50]}")
        elif "mode" in r:
            print(f"{r['model']} {r['tokens']:6d} {r['mode']:7s} grouped matmuls vs dense: today "
                  f"{r['gmm_vs_dense_today']:.1%}, ws {r['gmm_vs_dense_ws']:.1%}; layer over gmm: today "
                  f"{r['layer_over_gmm_today']:+.1%}, ws {r['layer_over_gmm_ws']:+.1%}; "
                  f"rel {max(r['rel_ws_vs_today']):.1e}")


if __name__ == "__main__":
    main()
