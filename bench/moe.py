"""MoE expert-compute benchmark: grouped matmul (Pallas GPU kernels, tokamax) vs XLA ragged_dot vs
a dense matmul.

Usage (GPU machine, tokamax carried as wheels):  PYTHONUNBUFFERED=1 python3 bench/moe.py --out $OUT
Only the project's Pallas grouped matmul (short GPU call):
    PYTHONUNBUFFERED=1 python3 bench/moe.py --variants pallas_gpu,pallas_gpu_gmm,dense_matmul --out $OUT
CPU smoke run (tiny shapes; the Pallas kernels run in interpret mode):
    python bench/moe.py --tiny --out /tmp/moe_bench

0. Pallas grouped matmul (``pallas_kernels.moe.gpu_gmm``; implementation "pallas_gpu", on CPU
   "pallas_gpu_interpret"), when a pallas variant is selected: a kernel-level check (bf16 inputs,
   groups with empty ones and sizes off the tiles, rows past the sum) of y, dlhs, drhs against an
   fp32 reference (masked dense einsum, Precision.HIGHEST): relative Frobenius error, pass < 1e-2;
   then a sweep of the tile configs (``CANDIDATES`` / ``TGMM_CANDIDATES``, incl. tail folding; on a GPU also
   the warp-specialized Mosaic GPU weight gradient's ``WS_TGMM_CANDIDATES`` unless ``--no-ws``) at one
   shape (``--sweep-model`` / ``--sweep-tokens``, default M2 first projection at 8K tokens:
   [65536, 3072] x [256, 3072, 3072]) timing the forward, dlhs (transposed) and tgmm kernels
   (``--sweep-kernels`` picks a subset) separately next to a dense matmul of the same FLOPs
   (``vs_dense`` = rate / dense rate). Each config's output is compared with the first config's
   (``CANDIDATES[0]``, a default without folding; ``rel_err_vs_first``, relative Frobenius error): a
   config above 1e-2 is flagged and never adopted. The fastest config per kernel is passed explicitly to the
   Pallas timings below (printed, marked ``*`` in the sweep table, recorded in ``info.pallas_configs``, and
   checked again as above); the kernels' own defaults are ``gpu_gmm.DEFAULT_CONFIGS``. ``--no-sweep`` keeps
   the defaults. ``--tiny`` sweeps the first 3 candidates (interpret-mode
   timings on a CPU mean nothing: there the sweep only exercises the code).

1. Checks (small shapes, fresh random bf16 inputs): every available implementation of
   ``moe_experts`` against the fp32 dense reference (relative Frobenius error, forward and the
   gradients of x, wi, wo), and the expert-parallel path (mesh ``expert=<all local GPUs>``; on one
   GPU the exchange is forced, so it still runs) with the ragged_all_to_all and all_to_all
   transports against the same reference.
2. Timing (median of repeats, ``block_until_ready``, after compile + warm-up) per model shape and
   tokens per step: the whole dropless MoE expert computation (sort, permute, two grouped matmuls,
   activation, un-permute + combine) with the Pallas kernels, the activation fused into the first
   grouped matmul's epilogue in the forward as the model runs it ("pallas_gpu") or after it
   ("pallas_gpu_separate"), with tokamax ("tokamax") and with XLA ragged_dot ("xla_ragged", run on
   1/16 of the tokens because XLA materialises [rows, experts, dim]), the two grouped matmuls alone on
   pre-sorted rows with the gated activation between ("pallas_gpu_gmm", "tokamax_gmm";
   "pallas_gpu_gmm_gated": the activation in the first one's epilogue; bf16 outputs and, for
   forward+backward, the VJP of a given cotangent, as the dense variant), the fixed-shape capacity path
   with capacity factor 1.25 ("xla_capacity"), and "dense_matmul": plain matmuls [T*k, H] x [H, 2I] and
   [T*k, I] x [I, H] with the same FLOPs. FLOPs = 6 * T * k * H * I forward, 3x that for
   forward+backward (gradients of x and both weights); each row's ``vs_dense`` = its rate / the
   dense matmul's rate at the same model, tokens and mode in the same run (also a table column). A
   wall-clock budget (``--budget-s``, counted from the start, checks and sweep included) stops
   starting new cases; skipped cases are listed. ``--variants`` picks a subset (names above; default all).
   ``--rounds R``: then, per model and tokens, "pallas_gpu_gmm" and "dense_matmul" alternately R times
   (each the median of ``--reps`` calls) and the median of the per-round ratios (the chip's clock drifts
   by several percent within a call). ``--profile N``: N forward+backward calls of each Pallas variant under
   ``jax.profiler``, device ms per kernel (traces under ``<out>/profile_*``).
3. ``--ep-timing`` (off by default; needs >= 2 visible devices, otherwise it is skipped with the
   reason in moe.json and the table): expert parallelism over ALL visible devices (mesh
   ``expert=<N>``, tokens sharded over the same axis, ``N * T`` tokens in all) for the M2 and M3 expert
   shapes at ``T`` tokens per device (``--tokens``), rows with ``devices``:
   - "ep_moe": the expert-parallel MoE layer (``moe_experts(implementation="auto")`` inside
     ``use_mesh``: grouped matmul "pallas_gpu" on GPU, XLA elsewhere), forward and forward+backward,
     per transport; the path that ran is recorded from the implementation report (``moe``);
   - "ep_exchange": the token exchange alone, the dispatch + return exchange of the same sizes
     (``all_to_all``: the fixed [N, T*k, H] buffers plus the per-expert counts; ``ragged_all_to_all``:
     the real send sizes of this routing, plus the all_gather of the sizes), per transport, with the
     bytes each device sends to other devices (max over devices) and the rate;
   - "ep_1dev": the same MoE layer on one device with T tokens (the first device's share of the
     routing; implementation = what the expert-parallel path's grouped matmul resolves to).
   The EP rows then carry ``exchange_ms`` (forward: one dispatch + return; forward+backward: two, the
   backward's transposed exchanges have the same sizes), ``exchange_share`` (= exchange_ms / ms),
   ``one_device_ms``, ``ep_over_1dev`` (ms / one_device_ms; 1.0 = perfect weak scaling) and
   ``speedup_vs_1dev`` (N * one_device_ms / ms: tokens per second of N devices vs one). Transports:
   ragged_all_to_all and all_to_all on GPU/TPU; on CPU only all_to_all (ragged_all_to_all does not
   run there; recorded in ``info.ep_timing.not_run``). The EP cases run first, under the same budget.
   ``--variants none`` skips the single-device variants (checks and EP timing only). CPU smoke:
       XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \
           python bench/moe.py --tiny --ep-timing --variants none --tokens 64 --out /tmp/moe_ep
   GPU (two GPUs):  CUDA_VISIBLE_DEVICES=0,1 python3 bench/moe.py --ep-timing --variants none \
           --tokens 8192,32768 --out $OUT
Writes moe.json (and prints a table last).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as PS  # noqa: E402

from minimax_jax import sharding as sh  # noqa: E402
from minimax_jax.ops import moe  # noqa: E402
from minimax_jax.ops import registry  # noqa: E402
from minimax_jax.ops.moe.activation import GatedActivation  # noqa: E402
from minimax_jax.ops.moe.grouped_matmul import grouped_matmul, tokamax_status  # noqa: E402
from minimax_jax.ops.moe.permute import group_starts, permute_rows, sort_by_expert, unpermute_combine  # noqa: E402
from minimax_jax.ops.registry import clear_implementation_report, implementation_report  # noqa: E402
from pallas_kernels.common import gpu_sm_count, match_vma  # noqa: E402
from pallas_kernels.moe import gpu_gmm, gpu_gmm_gated  # noqa: E402
from pallas_kernels.moe.gpu_tgmm_ws import WS_TGMM_CANDIDATES  # noqa: E402

SHAPES = {"m2": dict(h=3072, i=1536, e=256, k=8), "m3": dict(h=6144, i=3072, e=128, k=4)}
TINY = {"m2": dict(h=64, i=32, e=16, k=4), "m3": dict(h=96, i=48, e=8, k=2)}
CHECK = dict(h=1024, i=512, e=32, k=8)   # correctness shapes on the GPU (tile-friendly, small)
# Pallas kernel-level check (rows, K, N, groups, empty groups): sizes off the tiles, sum < rows
GMM_CHECK = dict(m=4096, kd=1024, nd=1536, g=32, empty=3)
GMM_CHECK_TINY = dict(m=200, kd=64, nd=96, g=6, empty=2)
ALL_VARIANTS = ("pallas_gpu", "pallas_gpu_separate", "pallas_gpu_gmm", "pallas_gpu_gmm_gated", "tokamax", "tokamax_gmm",
                "xla_capacity", "dense_matmul",
                "xla_ragged")
HI = jax.lax.Precision.HIGHEST
SWEEP_KERNELS = ("fwd", "dlhs", "tgmm")
SWEEP_MAX_REL_ERR = 1e-2   # a swept config whose output is further from the first config's is not adopted


def _act(g):
    a, b = jnp.split(g.astype(jnp.float32), 2, axis=-1)
    return (jax.nn.silu(a) * b).astype(g.dtype)


def _problem(s, tokens, dtype, seed):
    ks = jax.random.split(jax.random.key(seed), 5)
    h, i, e, k = s["h"], s["i"], s["e"], s["k"]
    x = jax.random.normal(ks[0], (tokens, h), dtype)
    router = jax.random.normal(ks[1], (h, e), jnp.float32) / np.sqrt(h)
    w, ex, _ = jax.jit(moe.route, static_argnums=3)(x, router, jnp.zeros((e,), jnp.float32), k)
    wi = (jax.random.normal(ks[2], (e, h, 2 * i), dtype) / np.sqrt(h)).astype(dtype)
    wo = (jax.random.normal(ks[3], (e, i, h), dtype) / np.sqrt(i)).astype(dtype)
    cot = jax.random.normal(ks[4], (tokens, h), dtype)
    return x, w, ex, wi, wo, cot


def _timeit(f, args, reps, budget_s):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(f(*args))
    times = []
    start = time.perf_counter()
    while len(times) < reps and (time.perf_counter() - start < budget_s or len(times) < 3):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times), compile_s, len(times)


#: the model's form of ``_act``: the Pallas grouped matmul fuses it into its epilogue (forward only)
GATED = GatedActivation("silu")


def _moe_fns(impl, act=_act, **kw):
    """(forward, forward+backward) of the whole MoE expert computation, args (x, w, ex, wi, wo, cot); ``act``
    ``GATED`` fuses the activation into the first grouped matmul of the Pallas path (``_act``: separate)."""
    def fwd(x, w, ex, wi, wo, cot):
        return moe.moe_experts(x, w, ex, wi, wo, act, implementation=impl, **kw)

    def fwdbwd(x, w, ex, wi, wo, cot):
        # value_and_grad: the loss is an output, so XLA cannot drop the last forward matmul
        # (the counted FLOPs include it)
        return jax.value_and_grad(lambda x, wi, wo: jnp.sum((fwd(x, w, ex, wi, wo, cot) * cot).astype(jnp.float32)),
                                  argnums=(0, 1, 2))(x, wi, wo)
    return fwd, fwdbwd


def _pallas_gmm(impl, configs):
    """``grouped_matmul(implementation=impl)`` for a Pallas ``impl`` with the tile ``configs``
    (``{"fwd", "dlhs", "tgmm"} -> config``) passed to the kernels: ``f(lhs, rhs, gs, out_dtype)``;
    ``gpu_gmm.DEFAULT_CONFIGS`` itself means the per-shape defaults (``gpu_gmm.shape_configs``)."""
    def f(lhs, rhs, gs, out_dtype):
        cfgs = (gpu_gmm.shape_configs(rhs.shape[1], rhs.shape[2], lhs.dtype) if configs is gpu_gmm.DEFAULT_CONFIGS
                else configs)
        return gpu_gmm.gmm(lhs, rhs.astype(lhs.dtype), gs.astype(jnp.int32), config=cfgs["fwd"],
                           dlhs_config=cfgs["dlhs"], tgmm_config=cfgs["tgmm"],
                           interpret=impl == "pallas_gpu_interpret").astype(out_dtype)
    return f


def _pallas_layer_fns(impl, configs):
    """(forward, forward+backward) of ``moe_experts(implementation=impl)`` with the tile ``configs``: the
    default tiles run ``moe_experts`` itself; others the same dropless path (sort, permute, both grouped
    matmuls with the activation between, un-permute + combine) with the kernels called with ``configs``: so a
    swept config's row is the separate path (no gated epilogue, no gathered rows), like "pallas_gpu_separate"."""
    if dict(configs) == dict(gpu_gmm.DEFAULT_CONFIGS):
        return _moe_fns(impl, GATED)
    gmm = _pallas_gmm(impl, configs)

    def fwd(x, w, ex, wi, wo, cot):
        order, inv, gs = sort_by_expert(ex, wi.shape[0])
        xs = permute_rows(x, order, inv)
        ys = gmm(_act(gmm(xs, wi, gs, jnp.float32).astype(xs.dtype)), wo, gs, jnp.float32).astype(x.dtype)
        return unpermute_combine(ys, w, order, inv).astype(x.dtype)   # the kernels store 0 past the sum

    def fwdbwd(x, w, ex, wi, wo, cot):
        return jax.value_and_grad(lambda x, wi, wo: jnp.sum((fwd(x, w, ex, wi, wo, cot) * cot).astype(jnp.float32)),
                                  argnums=(0, 1, 2))(x, wi, wo)
    return fwd, fwdbwd


def _variants(avail_tokamax, pallas_impl, configs=gpu_gmm.DEFAULT_CONFIGS):
    """name -> (kind, (forward, forward+backward)); the Pallas variants run with the tile ``configs``."""
    full = _moe_fns

    def gmm_only(impl, gated=False):
        # The same harness as dense() below: bf16 outputs, and for fwd+bwd the VJP of a given cotangent
        # with the primal output returned. What remains in this path beyond the dense matmuls is the
        # gated activation between the two grouped matmuls and its VJP.
        if impl.startswith("pallas_gpu"):
            gmm = _pallas_gmm(impl, configs)
        else:
            def gmm(lhs, rhs, gs, out_dtype):
                return grouped_matmul(lhs, rhs, gs, implementation=impl, preferred_element_type=out_dtype)

        def fwd(xs, gs, wi, wo, cot):
            if gated:   # the activation in the first kernel's epilogue (forward only; the backward: separate)
                return gmm(gpu_gmm_gated.gmm_gated(xs, wi.astype(xs.dtype), gs.astype(jnp.int32), GATED.gate_fn,
                                             interpret=impl.endswith("interpret")), wo, gs, xs.dtype)
            return gmm(_act(gmm(xs, wi, gs, xs.dtype)), wo, gs, xs.dtype)

        def fwdbwd(xs, gs, wi, wo, cot):
            out, vjp = jax.vjp(lambda xs, wi, wo: fwd(xs, gs, wi, wo, cot), xs, wi, wo)
            return out, vjp(cot)
        return fwd, fwdbwd

    def dense():
        def fwd(a, w1, b, w2, c1, c2):
            return (a @ w1, b @ w2)

        def fwdbwd(a, w1, b, w2, c1, c2):
            # Random cotangents: with sum() XLA would reduce d(a @ w) to a rank-1 product.
            # the primal outputs are returned too: otherwise XLA drops the forward matmuls and the
            # counted 3x FLOPs overstate the rate (a first run showed 1114 TFLOP/s, above peak)
            outs, vjp = jax.vjp(lambda a, w1, b, w2: fwd(a, w1, b, w2, c1, c2), a, w1, b, w2)
            return outs, vjp((c1, c2))
        return fwd, fwdbwd

    out = {}
    if pallas_impl is not None:
        out["pallas_gpu"] = ("full", _pallas_layer_fns(pallas_impl, configs))
        out["pallas_gpu_separate"] = ("full", _moe_fns(pallas_impl))
        out["pallas_gpu_gmm"] = ("gmm", gmm_only(pallas_impl))
        out["pallas_gpu_gmm_gated"] = ("gmm", gmm_only(pallas_impl, gated=True))
    if avail_tokamax:
        out["tokamax"] = ("full", full("tokamax"))
        out["tokamax_gmm"] = ("gmm", gmm_only("tokamax"))
    out["xla_capacity"] = ("full", full("xla_capacity", capacity_factor=1.25))
    out["dense_matmul"] = ("dense", dense())
    out["xla_ragged"] = ("full_1/16", full("xla_ragged"))
    return out


def check(shapes, dtype, results, impls, ep_impls):
    """Correctness on small shapes (relative Frobenius error vs fp32 dense reference).

    impls: moe implementations to check; ep_impls: implementations to check expert-parallel
    (GPU only; "auto" = the default grouped matmul)."""
    s = shapes
    x, w, ex, wi, wo, cot = _problem(s, 1024 if s["h"] > 200 else 64, dtype, seed=11)

    def loss(impl, x, wi, wo, **kw):
        return jnp.sum(moe.moe_experts(x, w, ex, wi, wo, GATED, implementation=impl, **kw).astype(jnp.float32)
                       * cot.astype(jnp.float32))

    f32 = [a.astype(jnp.float32) for a in (x, wi, wo)]
    ref_y = moe.moe_experts(f32[0], w, ex, f32[1], f32[2], GATED, implementation="xla_dense")
    ref_g = jax.grad(lambda *a: loss("xla_dense", *a), argnums=(0, 1, 2))(*f32)
    cases = [(impl, {"capacity_factor": float(s["e"]) / s["k"]} if impl == "xla_capacity" else {}) for impl in impls]
    for impl, kw in cases:
        y = jax.jit(lambda x, wi, wo: moe.moe_experts(x, w, ex, wi, wo, GATED, implementation=impl, **kw))(x, wi, wo)
        g = jax.jit(jax.grad(lambda *a: loss(impl, *a, **kw), argnums=(0, 1, 2)))(x, wi, wo)
        errs = [_rel(y, ref_y)] + [_rel(a, b) for a, b in zip(g, ref_g)]
        results.append({"check": impl, "rel_err_y_dx_dwi_dwo": errs, "ok": bool(max(errs) < 2e-2)})
        print("check", impl, errs, flush=True)
    # GPU/TPU: both transports (1 GPU: forced exchange; several: real EP); CPU: all_to_all only
    # (ragged_all_to_all does not run there), with >= 2 devices (e.g. --xla_force_host_platform_device_count)
    if jax.default_backend() != "cpu":
        ep_transports = ("ragged_all_to_all", "all_to_all")
    else:
        ep_transports = ("all_to_all",) if len(jax.devices()) >= 2 else ()
    if ep_transports:
        mesh = sh.make_mesh(f"expert={len(jax.devices())}")
        for impl in ep_impls:
            for transport in ep_transports:
                with sh.use_mesh(mesh, sh.load_rules("default")):
                    fn = jax.jit(lambda x, wi, wo, t=transport: moe.moe_experts(x, w, ex, wi, wo, GATED, ep_transport=t,
                                                                              implementation=impl))
                    y = fn(x, wi, wo)
                    g = jax.jit(jax.grad(lambda x, wi, wo, t=transport: jnp.sum(
                        moe.moe_experts(x, w, ex, wi, wo, GATED, ep_transport=t,
                                        implementation=impl).astype(jnp.float32)
                        * cot.astype(jnp.float32)), argnums=(0, 1, 2)))(x, wi, wo)
                errs = [_rel(y, ref_y)] + [_rel(a, b) for a, b in zip(g, ref_g)]
                name = f"expert_parallel[{transport},ep={len(jax.devices())}]" + ("" if impl == "auto" else f"[{impl}]")
                results.append({"check": name, "rel_err_y_dx_dwi_dwo": errs, "ok": bool(max(errs) < 2e-2)})
                print("check ep", impl, transport, errs, flush=True)


def _gmm_ref(lhs, rhs, gs):
    """fp32 reference grouped matmul: dense per-group products (HIGHEST), each row taking its
    group's; rows past sum(gs) are 0."""
    g = rhs.shape[0]
    gid = jnp.searchsorted(jnp.cumsum(gs), jnp.arange(lhs.shape[0]), side="right")
    full = jnp.einsum("mk,gkn->gmn", lhs, rhs, precision=HI)
    y = jnp.take_along_axis(full, jnp.minimum(gid, g - 1)[None, :, None], axis=0)[0]
    return jnp.where((gid < g)[:, None], y, 0.0)


def check_gmm(c, dtype, results, impl, configs, name):
    """Pallas kernels (forward, dlhs, drhs) vs the fp32 reference on one random problem.

    c: GMM_CHECK-like dict; configs: (fwd, dlhs, tgmm) TileConfigs. Appends a result row."""
    rng = np.random.default_rng(5)
    m, kd, nd, g = c["m"], c["kd"], c["nd"], c["g"]
    sizes = rng.multinomial(m - 37, rng.dirichlet(np.ones(g)))          # sum < m: rows past the sum
    sizes[rng.choice(g, c["empty"], replace=False)] = 0                 # empty groups
    gs = jnp.asarray(sizes, jnp.int32)
    lhs = jnp.asarray(rng.normal(size=(m, kd)), dtype)
    rhs = jnp.asarray(rng.normal(size=(g, kd, nd)) / np.sqrt(kd), dtype)
    cot = jnp.asarray(rng.normal(size=(m, nd)), dtype)
    fcfg, dcfg, tcfg = configs

    @jax.jit
    def kern(lhs, rhs, cot):
        y, vjp = jax.vjp(lambda a, b: gpu_gmm.gmm(a, b, gs, config=fcfg, dlhs_config=dcfg, tgmm_config=tcfg,
                                                  interpret=impl == "pallas_gpu_interpret"), lhs, rhs)
        return (y, *vjp(cot))

    @jax.jit
    def ref(lhs, rhs, cot):
        y, vjp = jax.vjp(lambda a, b: _gmm_ref(a, b, gs), lhs.astype(jnp.float32), rhs.astype(jnp.float32))
        return (y, *vjp(cot.astype(jnp.float32)))

    got, want = kern(lhs, rhs, cot), ref(lhs, rhs, cot)
    errs = [_rel(a, b) for a, b in zip(got, want)]
    total = int(sizes.sum())
    empty = np.flatnonzero(sizes == 0)
    exact = bool(not np.any(np.asarray(got[0])[total:]) and not np.any(np.asarray(got[1])[total:])
                 and not np.any(np.asarray(got[2])[empty]))
    row = {"check": name, "configs": [x.label() for x in configs], "rel_err_y_dlhs_drhs": errs,
           "zeros_past_sum_and_empty_groups": exact, "ok": bool(max(errs) < 1e-2 and exact)}
    results.append(row)
    print("check", json.dumps(row), flush=True)


@jax.jit
def _rel_dev(a, b):
    """Relative Frobenius error ||a - b|| / ||b|| in fp32, on the device (large outputs)."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30)


def sweep(model, s, tokens, dtype, impl, args, tiny, kernel_names=SWEEP_KERNELS):
    """Time each tile config of the forward, dlhs and tgmm kernels (``kernel_names``) at one shape (the
    first projection [T*k, H] x [E, H, 2I]) next to a dense matmul of the same FLOPs; check each
    config's output against the first config's (module docstring, 0.).

    Returns (rows, best {kernel name -> TileConfig or None}): the fastest config whose output passed,
    None where no config ran; its row carries ``adopted: True``."""
    x, w, ex, wi, wo, cot = _problem(s, tokens, dtype, seed=tokens)
    order, inv, gs = sort_by_expert(ex, s["e"])
    xs = permute_rows(x, order, inv)
    m, kd, nd = xs.shape[0], s["h"], 2 * s["i"]
    dh = jax.random.normal(jax.random.key(7), (m, nd), dtype)
    flops = 2.0 * m * kd * nd
    interp = impl == "pallas_gpu_interpret"
    # on a GPU the warp-specialized Mosaic GPU weight gradient joins the Triton tgmm candidates (after them: the
    # first config stays the reference of rel_err_vs_first)
    ws = not interp and not getattr(args, "no_ws", False)
    ws_tgmm = tuple(dataclasses.replace(c, num_sms=gpu_sm_count()) for c in WS_TGMM_CANDIDATES) if ws else ()
    kernels = {
        "fwd": (gpu_gmm.CANDIDATES, lambda c: jax.jit(lambda a, b, g: gpu_gmm.gmm_forward(
            a, b, g, config=c, interpret=interp)), (xs, wi, gs)),
        "dlhs": (gpu_gmm.CANDIDATES, lambda c: jax.jit(lambda a, b, g: gpu_gmm.gmm_forward(
            a, b, g, transpose_rhs=True, config=c, interpret=interp)), (dh, wi, gs)),
        "tgmm": (gpu_gmm.TGMM_CANDIDATES + ws_tgmm, lambda c: jax.jit(lambda a, b, g: gpu_gmm.tgmm(
            a, b, g, config=c, interpret=interp)), (xs, dh, gs)),
    }
    rows, best = [], {}
    base = {"sweep": f"{model} {tokens} tokens: [{m}, {kd}] x [{s['e']}, {kd}, {nd}]", "tflops_counted": flops / 1e12}
    med, _, _ = _timeit(jax.jit(lambda a, b: a @ b), (xs, wi[0]), args.reps, budget_s=3.0)
    dense = flops / med / 1e12
    rows.append({**base, "kernel": "dense_matmul", "config": "-", "ms": med * 1e3, "tflop_s": dense})
    print(json.dumps(rows[-1]), flush=True)
    for kname in kernel_names:
        cands, make, fargs = kernels[kname]
        top, first = None, None    # (tflop_s, config, row); (label, output) of the first config that ran
        for c in (cands[:3] if tiny else cands):
            row = {**base, "kernel": kname, "config": c.label()}
            try:
                f = make(c)
                med, comp, n = _timeit(f, fargs, args.reps, budget_s=3.0)
                out = f(*fargs)
                first = first or (c.label(), out)
                err = float(_rel_dev(out, first[1]))
                del out
                row.update(ms=med * 1e3, tflop_s=flops / med / 1e12, vs_dense=flops / med / 1e12 / dense,
                           compile_s=comp, reps=n, rel_err_vs_first=err, first=first[0],
                           ok=err < SWEEP_MAX_REL_ERR)
                if row["ok"] and (top is None or row["tflop_s"] > top[0]):
                    top = (row["tflop_s"], c, row)
            except Exception as e:  # a config that does not compile (e.g. shared memory): record it
                row.update(error=f"{type(e).__name__}: {str(e)[:300]}")
            rows.append(row)
            print(json.dumps(row), flush=True)
        first = None
        best[kname] = None if top is None else top[1]
        if top is not None:
            top[2]["adopted"] = True
    return rows, best


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/moe_bench", help="folder for moe.json (and profiles); the curated "
                    "bench/results/moe.json is edited by hand, never overwritten by a run")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run with tiny shapes (Pallas kernels interpreted)")
    ap.add_argument("--tokens", default=None, help="order = priority under the budget (default 8192,65536,32768; "
                    "--tiny: 64,256); with --ep-timing also the tokens PER DEVICE of the EP cases")
    ap.add_argument("--models", default="", help="comma-separated subset of the model shapes (default: all)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="seconds from the start after which no new case starts (default 110; --tiny: 900)")
    ap.add_argument("--reps", type=int, default=10, help="timed calls per case (the median is reported)")
    ap.add_argument("--variants", default="", help="comma-separated subset of " + ",".join(ALL_VARIANTS)
                    + " (default: all available; 'none': no single-device variant, e.g. with --ep-timing)")
    ap.add_argument("--ep-timing", action="store_true",
                    help="time expert parallelism over all visible devices (>= 2): EP MoE layer, the token exchange "
                         "alone per transport, and the same layer on one device (module docstring, 3.)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the Pallas tile-config sweep (defaults)")
    ap.add_argument("--no-ws", action="store_true",
                    help="sweep the Triton configs only (not the warp-specialized Mosaic GPU weight gradient's "
                         "candidates)")
    ap.add_argument("--sweep-model", default="m2", choices=sorted(SHAPES), help="model shape of the tile sweep")
    ap.add_argument("--sweep-tokens", type=int, default=8192, help="tokens of the tile sweep's problem")
    ap.add_argument("--sweep-kernels", default=",".join(SWEEP_KERNELS),
                    help="comma-separated subset of " + ",".join(SWEEP_KERNELS) + " to sweep (the others keep "
                    "their defaults)")
    ap.add_argument("--rounds", type=int, default=0,
                    help="after the table, time pallas_gpu_gmm and dense_matmul alternately in R rounds per model, "
                         "tokens and mode (each round: median of --reps calls of each) and report the median of the "
                         "per-round ratios: the chip's clock drifts by several percent within a call, which one "
                         "measurement of each can land on either side of")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after the table, run N more fwd+bwd calls of each Pallas variant at the first --tokens "
                         "under jax.profiler and print the device time per kernel (bench/trace_summary.py)")
    args = ap.parse_args()
    if args.budget_s is None:
        args.budget_s = 900.0 if args.tiny else 110.0
    for flag, value, least in (("--reps", args.reps, 1), ("--sweep-tokens", args.sweep_tokens, 1),
                               ("--rounds", args.rounds, 0), ("--profile", args.profile, 0)):
        if value < least:
            ap.error(f"{flag} must be >= {least}, got {value}")
    chosen = [v for v in args.variants.split(",") if v] or list(ALL_VARIANTS)
    if chosen == ["none"]:
        chosen = []
    bad = [v for v in chosen if v not in ALL_VARIANTS]
    if bad:
        ap.error(f"unknown variants {bad}; choose from {ALL_VARIANTS}")
    sweep_kernels = [k for k in args.sweep_kernels.split(",") if k]
    if not sweep_kernels or set(sweep_kernels) - set(SWEEP_KERNELS):
        ap.error(f"--sweep-kernels: choose from {SWEEP_KERNELS}, got {args.sweep_kernels!r}")
    t_start = time.perf_counter()
    shapes = TINY if args.tiny else SHAPES
    if args.models:
        unknown = sorted(set(args.models.split(",")) - set(shapes))
        if unknown:
            ap.error(f"--models: unknown {unknown}; choose from {sorted(shapes)}")
        shapes = {k: v for k, v in shapes.items() if k in args.models.split(",")}
    try:
        tokens_list = [int(t) for t in (args.tokens or ("64,256" if args.tiny else "8192,65536,32768")).split(",")]
    except ValueError:
        ap.error(f"--tokens: comma-separated positive integers, got {args.tokens!r}")
    if not tokens_list or min(tokens_list) < 1:
        ap.error(f"--tokens: comma-separated positive integers, got {args.tokens!r}")
    dtype = jnp.bfloat16
    tk_err = tokamax_status()
    tokamax_ok = tk_err is None and jax.default_backend() != "cpu"
    tk_version = getattr(sys.modules.get("tokamax"), "__version__", "?") if tk_err is None else f"unavailable: {tk_err}"
    if any(v.startswith("tokamax") for v in chosen) and not tokamax_ok:
        print(f"tokamax variants skipped: {tk_err or 'needs a GPU or TPU backend'}", flush=True)
    backend = jax.default_backend()
    want_pallas = any(v.startswith("pallas_gpu") for v in chosen)
    # the Pallas kernels: compiled on GPU; interpret mode only for the tiny CPU smoke run
    pallas_impl = "pallas_gpu" if backend == "gpu" else ("pallas_gpu_interpret" if args.tiny else None)
    info = {"backend": backend, "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
            "tokamax": tk_version, "pallas_impl": pallas_impl if want_pallas else "not selected",
            "variants": chosen, "devices": len(jax.devices())}
    if args.ep_timing:
        transports, not_run, why = ep_plan(backend, len(jax.devices()))
        info["ep_timing"] = ({"skipped": why} if why else
                             {"devices": len(jax.devices()), "mesh": f"expert={len(jax.devices())}",
                              "tokens_sharded_over": EP_AXIS, "tokens_per_device": tokens_list,
                              "moe_impl": "auto", "one_device_impl": _one_device_impl(),
                              "transports": transports, "not_run": not_run})
        if why:
            print(f"--ep-timing skipped: {why}", flush=True)
    print(json.dumps(info), flush=True)
    checks, rows, skipped, sweep_rows = [], [], [], []
    impls = ["xla_ragged"]
    if "xla_capacity" in chosen:
        impls.append("xla_capacity")
    if tokamax_ok and any(v.startswith("tokamax") for v in chosen):
        impls.append("tokamax")
    if want_pallas and pallas_impl:
        impls.append(pallas_impl)
    ep_impls = (["auto"] if not args.variants or "xla_ragged" in chosen or args.ep_timing else []) + (
        [pallas_impl] if want_pallas and pallas_impl else [])
    try:
        check(TINY["m2"] if args.tiny else CHECK, dtype, checks, impls, ep_impls)
    except Exception:  # a failed check is reported, and the timings still run
        checks.append({"check": "error", "traceback": traceback.format_exc()[-3000:], "ok": False})
        print(checks[-1]["traceback"], flush=True)
    configs = gpu_gmm.DEFAULT_CONFIGS   # the Pallas variants' tiles: the defaults, or the sweep's best
    if want_pallas and pallas_impl:
        gc = GMM_CHECK_TINY if args.tiny else GMM_CHECK
        default_cfgs = (configs["fwd"], configs["dlhs"], configs["tgmm"])
        def guarded(name, fn):   # a failure is recorded as a failed check; the bench goes on
            try:
                return fn()
            except Exception:
                checks.append({"check": f"{name} error", "traceback": traceback.format_exc()[-3000:], "ok": False})
                print(checks[-1]["traceback"], flush=True)

        guarded("pallas_gmm[default]", lambda: check_gmm(gc, dtype, checks, pallas_impl, default_cfgs,
                                                         "pallas_gmm[default]"))
        if not args.no_sweep:
            ss = (TINY if args.tiny else SHAPES)[args.sweep_model]
            res = guarded("pallas_sweep", lambda: sweep(args.sweep_model, ss, 64 if args.tiny else args.sweep_tokens,
                                                        dtype, pallas_impl, args, args.tiny, sweep_kernels))
            if res is not None:
                sweep_rows, best = res
                configs = {**configs, **{k: v for k, v in best.items() if v is not None}}
                print("sweep adopted: " + ", ".join(f"{k}={v.label()}" for k, v in configs.items()), flush=True)
                tuned = (configs["fwd"], configs["dlhs"], configs["tgmm"])
                if tuned != default_cfgs:
                    guarded("pallas_gmm[best]", lambda: check_gmm(gc, dtype, checks, pallas_impl, tuned,
                                                                  "pallas_gmm[best]"))
    elif want_pallas:
        print(f"pallas variants skipped: backend {backend!r} (the kernels need a GPU; --tiny runs them interpreted)",
              flush=True)
    info["pallas_configs"] = {k: v.label() for k, v in configs.items()}
    variants = {k: v for k, v in _variants(tokamax_ok, pallas_impl, configs).items() if k in chosen}
    plan = [(tokens, model, name) for tokens in tokens_list for model in shapes for name in variants
            if name != "xla_ragged"]
    plan += [(tokens_list[0], model, "xla_ragged") for model in shapes if "xla_ragged" in variants]   # slow: last
    ep = info.get("ep_timing")
    if ep and "skipped" in ep:
        skipped.append(f"ep_timing: {ep['skipped']}")
    elif ep:   # first: asked for explicitly
        run_ep(shapes, tokens_list, dtype, args, t_start, rows, skipped, ep)
    for tokens, model, name in plan:
        s = shapes[model]
        kind, (fwd, fwdbwd) = variants[name]
        for mode, fn in (("fwd", fwd), ("fwd+bwd", fwdbwd)):
            if time.perf_counter() - t_start > args.budget_s:
                skipped.append(f"{model} {tokens} {name} {mode}")
                continue
            row = _run_case(model, s, tokens, name, kind, mode, fn, dtype, args)
            rows.append(row)
            print(json.dumps(row), flush=True)
    interleaved = []
    if args.rounds and {"pallas_gpu_gmm", "dense_matmul"} <= set(variants):
        for tokens in tokens_list:
            for model in shapes:
                if time.perf_counter() - t_start > args.budget_s:
                    skipped.append(f"{model} {tokens} interleaved rounds")
                    continue
                interleaved += _interleaved(model, shapes[model], tokens, variants, dtype, args)
    profiles = []
    if args.profile:
        for model in shapes:
            for name in (v for v in variants if v.startswith("pallas_gpu")):
                kind, (_, fwdbwd) = variants[name]
                profiles.append(_profile_case(model, shapes[model], tokens_list[0], name, kind, fwdbwd, dtype, args))
    _annotate_vs_dense(rows)
    out = {"info": info, "checks": checks, "sweep": sweep_rows, "rows": rows, "skipped": skipped,
           "interleaved": interleaved, "profiles": profiles, "wall_s": time.perf_counter() - t_start}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "moe.json"), "w") as f:
        json.dump(out, f, indent=1)
    _sweep_table(sweep_rows)
    _table(rows, checks, skipped, info)
    _interleaved_table(interleaved)
    _ep_table(rows, info.get("ep_timing"))


def _case_args(s, t, tokens, kind, dtype):
    """The arguments of a variant's functions (``kind`` from ``_variants``) at ``t`` tokens."""
    h, i, k = s["h"], s["i"], s["k"]
    x, w, ex, wi, wo, cot = _problem(s, t, dtype, seed=tokens)
    if kind == "dense":
        a = jax.random.normal(jax.random.key(1), (t * k, h), dtype)
        b = jax.random.normal(jax.random.key(2), (t * k, i), dtype)
        c1 = jax.random.normal(jax.random.key(4), (t * k, 2 * i), dtype)
        return (a, wi[0], b, wo[0], c1, jax.random.normal(jax.random.key(5), (t * k, h), dtype))
    if kind == "gmm":
        order, inv, gs = sort_by_expert(ex, s["e"])
        xs = permute_rows(x, order, inv)
        return (xs, gs, wi, wo, jax.random.normal(jax.random.key(3), (t * k, h), dtype))
    return (x, w, ex, wi, wo, cot)


def _profile_case(model, s, tokens, name, kind, fn, dtype, args):
    """``args.profile`` fwd+bwd calls under ``jax.profiler.trace`` (perfetto JSON under
    ``<out>/profile_<model>_<tokens>_<name>``); prints and returns the device time per kernel (ms per call)."""
    from trace_summary import format_summary, load_events, newest_trace, summarize  # noqa: PLC0415

    tag = f"{model}_{tokens}_{name}"
    try:
        fargs = _case_args(s, tokens, tokens, kind, dtype)
        f = jax.jit(fn)
        jax.block_until_ready(f(*fargs))
        pdir = os.path.join(args.out, f"profile_{tag}")
        with jax.profiler.trace(pdir, create_perfetto_trace=True):
            for _ in range(args.profile):
                jax.block_until_ready(f(*fargs))
        events = load_events(newest_trace(pdir))
        lines, scope = summarize(events, top=20, steps=args.profile), "device"
        if not lines:   # a CPU run has no /device: process
            lines, scope = summarize(events, top=20, steps=args.profile, device_only=False), "host (no device lines)"
        print(f"\nprofile {tag} fwd+bwd, {scope} ms per call:\n{format_summary(lines, max_lines=3)}", flush=True)
        return {"case": tag, "lines": lines[:3]}
    except Exception as e:   # the profile is extra: record why it failed, keep the results
        print(f"profile {tag} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return {"case": tag, "error": f"{type(e).__name__}: {str(e)[:300]}"}


def _interleaved(model, s, tokens, variants, dtype, args):
    """``args.rounds`` rounds of (grouped matmuls, dense matmul), each timed as the median of ``args.reps``
    synced calls, for fwd and fwd+bwd; one row per mode with the per-round ratios and their median."""
    out = []
    for mode_i, mode in enumerate(("fwd", "fwd+bwd")):
        flops = 6.0 * tokens * s["k"] * s["h"] * s["i"] * (3.0 if mode == "fwd+bwd" else 1.0)
        row = {"model": model, "tokens": tokens, "mode": mode, "rounds": args.rounds}
        try:
            fns = {}
            for name in ("pallas_gpu_gmm", "dense_matmul"):
                kind, pair = variants[name]
                fns[name] = (jax.jit(pair[mode_i]), _case_args(s, tokens, tokens, kind, dtype))
            ms = {name: [] for name in fns}
            for _ in range(args.rounds):
                for name, (f, fargs) in fns.items():
                    med, _, _ = _timeit(f, fargs, args.reps, budget_s=5.0)
                    ms[name].append(med * 1e3)
            ratios = [d / g for g, d in zip(ms["pallas_gpu_gmm"], ms["dense_matmul"])]
            row.update(gmm_ms=ms["pallas_gpu_gmm"], dense_ms=ms["dense_matmul"], ratios=ratios,
                       ratio_median=statistics.median(ratios),
                       gmm_tflop_s_median=flops / statistics.median(ms["pallas_gpu_gmm"]) / 1e9,
                       dense_tflop_s_median=flops / statistics.median(ms["dense_matmul"]) / 1e9)
        except Exception as e:  # recorded; the other rows go on
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def _interleaved_table(rows):
    if not rows:
        return
    print("\nInterleaved rounds (grouped matmuls vs dense matmul of the same FLOPs, alternating; ratio = dense ms / "
          "gmm ms per round)")
    print(f"{'model':5} {'tokens':>6} {'mode':8} {'gmm TFLOP/s':>11} {'dense TFLOP/s':>13} {'median ratio':>12}  "
          "per-round ratios (%)")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:5} {r['tokens']:6d} {r['mode']:8} error: {r['error'][:100]}")
            continue
        print(f"{r['model']:5} {r['tokens']:6d} {r['mode']:8} {r['gmm_tflop_s_median']:11.1f} "
              f"{r['dense_tflop_s_median']:13.1f} {100 * r['ratio_median']:11.1f}%  "
              + " ".join(f"{100 * x:.1f}" for x in r["ratios"]))


def _run_case(model, s, tokens, name, kind, mode, fn, dtype, args):
    t = tokens // 16 if kind == "full_1/16" else tokens
    h, i, k = s["h"], s["i"], s["k"]
    flops = 6.0 * t * k * h * i * (3.0 if mode == "fwd+bwd" else 1.0)
    row = {"model": model, "tokens": tokens, "tokens_run": t, "devices": 1, "variant": name, "mode": mode,
           "tflops_counted": flops / 1e12}
    try:
        fargs = _case_args(s, t, tokens, kind, dtype)
        med, comp, n = _timeit(jax.jit(fn), fargs, args.reps, budget_s=5.0)
        row.update(ms=med * 1e3, tflop_s=flops / med / 1e12, compile_s=comp, reps=n)
    except Exception as e:  # OOM or a kernel failure: record it, keep going
        row.update(error=f"{type(e).__name__}: {str(e)[:300]}")
    return row


# ----------------------------------------------------------------------------- expert-parallel timing
EP_AXIS = "expert"


def ep_plan(backend, n_dev):
    """What ``--ep-timing`` runs here: ``(transports, not_run {transport: reason}, skip_reason or None)``."""
    if n_dev < 2:
        return [], {}, f"EP timing needs >= 2 devices; {n_dev} visible ({backend})"
    if backend == "cpu":
        return ["all_to_all"], {"ragged_all_to_all": "jax.lax.ragged_all_to_all does not run on CPU "
                                                     "(minimax_jax.ops.moe.expert_parallel refuses it)"}, None
    return ["ragged_all_to_all", "all_to_all"], {}, None


def _one_device_impl():
    """The moe implementation the expert-parallel path's grouped matmul ("auto") resolves to."""
    gmm = registry.resolve("grouped_matmul", "auto").name
    return {"xla": "xla_ragged"}.get(gmm, gmm)


def _exchange_fn(mesh, transport, p):
    """The token exchange alone (dispatch + return, as ``minimax_jax.ops.moe.expert_parallel``), in shard_map.

    all_to_all: args (send [P*P, M, H], counts [P*P, E/P]) sharded over the expert axis (per device
      [P, M, H] and [P, E/P]); returns the returned rows and the received counts.
    ragged_all_to_all: args (xs [P*M, H], send_sizes [P*P] int32) (per device: [M, H] rows sorted by
      destination and [P] rows per destination); returns the rows back [M, H] per device.
    """
    ax = EP_AXIS
    if transport == "all_to_all":
        def body(send, counts):
            recv = jax.lax.all_to_all(send, ax, 0, 0)                   # [P source, M, H]
            recv_counts = jax.lax.all_to_all(counts, ax, 0, 0)
            back = jax.lax.all_to_all(recv, ax, 0, 0)                   # [P dest, M, H]
            return back, recv_counts
        specs = (PS(ax, None, None), PS(ax, None))
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=specs))

    def body(xs, send_sizes):
        m, h = xs.shape
        me = jax.lax.axis_index(ax)
        send_start = group_starts(send_sizes)
        sizes = jax.lax.all_gather(send_sizes, ax)                      # [P src, P dst]
        starts = jax.lax.all_gather(send_start, ax)
        recv_sizes = sizes[:, me]
        recv_start = group_starts(recv_sizes)
        peer_off = jnp.sum(jnp.where(jnp.arange(p)[:, None] < me, sizes, 0), axis=0).astype(jnp.int32)
        back_off = starts[:, me]
        out = match_vma(jnp.zeros((p * m, h), xs.dtype), xs)
        recv = jax.lax.ragged_all_to_all(xs, out, send_start, send_sizes, peer_off, recv_sizes, axis_name=ax)
        out2 = match_vma(jnp.zeros((m, h), xs.dtype), recv)
        return jax.lax.ragged_all_to_all(recv, out2, recv_start, recv_sizes, back_off, send_sizes, axis_name=ax)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(PS(ax, None), PS(ax)), out_specs=PS(ax, None)))


def _ep_send_sizes(ex, s, p, tokens):
    """Rows each device sends to each device for this routing: ``[P src, P dst]`` (numpy int)."""
    e_pad = -(-s["e"] // p) * p
    ex = np.asarray(ex).reshape(p, tokens * s["k"])
    counts = np.stack([np.bincount(r, minlength=e_pad) for r in ex])   # [P, E_pad]
    return counts.reshape(p, p, e_pad // p).sum(axis=2), counts.reshape(p * p, e_pad // p)


def run_ep(shapes, tokens_list, dtype, args, t_start, rows, skipped, ep_info):
    """The ``--ep-timing`` cases (module docstring, 3.), appended to ``rows``; budget-skipped ones to
    ``skipped``."""
    transports = ep_info["transports"]
    p = ep_info["devices"]
    mesh = sh.make_mesh(f"expert={p}")
    rules = sh.load_rules("default")
    one_impl = ep_info["one_device_impl"]
    tok_sh = NamedSharding(mesh, PS(EP_AXIS, None))
    exp_sh = NamedSharding(mesh, PS(EP_AXIS, None, None))
    for tokens in tokens_list:
        for model, s in shapes.items():
            h, i, k = s["h"], s["i"], s["k"]
            cases = [("ep_1dev", None, mode) for mode in ("fwd", "fwd+bwd")]
            cases += [(v, t, mode) for t in transports
                      for v, mode in (("ep_exchange", "dispatch+return"), ("ep_moe", "fwd"), ("ep_moe", "fwd+bwd"))]
            data = None
            for variant, transport, mode in cases:
                label = f"{model} {tokens}/dev {variant}" + (f"[{transport}]" if transport else "") + f" {mode}"
                if time.perf_counter() - t_start > args.budget_s:
                    skipped.append(label)
                    continue
                devices = 1 if variant == "ep_1dev" else p
                flops = (0.0 if variant == "ep_exchange"
                         else 6.0 * tokens * k * h * i * (3.0 if mode == "fwd+bwd" else 1.0))
                row = {"model": model, "tokens": tokens, "tokens_run": tokens, "tokens_global": tokens * devices,
                       "devices": devices, "variant": variant, "transport": transport, "mode": mode,
                       "tflops_counted": flops / 1e12}
                try:
                    if data is None:   # the global problem (N * T tokens), once per (tokens, model)
                        x, w, ex, wi, wo, cot = _problem(s, tokens * p, dtype, seed=tokens)
                        sizes, counts = _ep_send_sizes(ex, s, p, tokens)
                        data = {"one": (x[:tokens], w[:tokens], ex[:tokens], wi, wo, cot[:tokens]),
                                "ep": tuple(jax.device_put(a, tok_sh) for a in (x, w, ex))
                                + tuple(jax.device_put(a, exp_sh) for a in (wi, wo)) + (jax.device_put(cot, tok_sh),),
                                "sizes": sizes, "counts": counts}
                        del x, w, ex, wi, wo, cot
                    row.update(_ep_case(variant, transport, mode, data, s, tokens, p, mesh, rules, one_impl, dtype,
                                        args))
                except Exception as e:  # OOM or a failure: record it, keep going
                    row.update(error=f"{type(e).__name__}: {str(e)[:300]}")
                if "ms" in row and flops:
                    row["tflop_s"] = flops / (row["ms"] / 1e3) / 1e12
                rows.append(row)
                print(json.dumps(row), flush=True)
            data = None
    _ep_annotate(rows)


def _ep_case(variant, transport, mode, data, s, tokens, p, mesh, rules, one_impl, dtype, args):
    """Time one EP case; returns the fields to add to its row."""
    out = {}
    if variant == "ep_1dev":
        fwd, fwdbwd = _moe_fns(one_impl)
        clear_implementation_report()
        med, comp, n = _timeit(jax.jit(fwd if mode == "fwd" else fwdbwd), data["one"], args.reps, budget_s=5.0)
        rec = implementation_report().get("moe")
        if rec != one_impl:
            raise RuntimeError(f"the one-device MoE ran {rec!r}, not {one_impl!r}")
        out["moe"] = rec
    elif variant == "ep_moe":
        fwd, fwdbwd = _moe_fns("auto", ep_transport=transport)
        clear_implementation_report()
        with sh.use_mesh(mesh, rules):   # the first call traces: expert parallel inside the mesh
            med, comp, n = _timeit(jax.jit(fwd if mode == "fwd" else fwdbwd), data["ep"], args.reps, budget_s=5.0)
        rec = implementation_report().get("moe") or ""
        if not rec.startswith(f"expert_parallel[{transport},") or f"ep={p}," not in rec:
            raise RuntimeError(f"the expert-parallel MoE ran {rec!r}, not expert_parallel[{transport},...,ep={p},...]")
        out["moe"] = rec
    else:
        h, m = s["h"], tokens * s["k"]
        item = jnp.dtype(dtype).itemsize
        sizes = data["sizes"]
        key = jax.random.key(9)
        if transport == "all_to_all":
            send = jax.jit(lambda: jax.random.normal(key, (p * p, m, h), dtype),
                           out_shardings=NamedSharding(mesh, PS(EP_AXIS, None, None)))()
            counts = jax.device_put(jnp.asarray(data["counts"], jnp.int32), NamedSharding(mesh, PS(EP_AXIS, None)))
            fargs = (send, counts)
            offdev = 2 * (p - 1) * m * h * item                       # the whole fixed slot to each peer
        else:
            xs = jax.jit(lambda: jax.random.normal(key, (p * m, h), dtype),
                         out_shardings=NamedSharding(mesh, PS(EP_AXIS, None)))()
            ss = jax.device_put(jnp.asarray(sizes.reshape(-1), jnp.int32), NamedSharding(mesh, PS(EP_AXIS)))
            fargs = (xs, ss)
            off = sizes * (1 - np.eye(p, dtype=sizes.dtype))
            offdev = int((off.sum(axis=1) + off.sum(axis=0)).max()) * h * item   # dispatch out + return out
        fn = _exchange_fn(mesh, transport, p)
        med, comp, n = _timeit(fn, fargs, args.reps, budget_s=5.0)
        # every row goes out and comes back: the returned rows must equal the sent ones (on device)
        back = fn(*fargs)
        back = back[0] if transport == "all_to_all" else back
        if not bool(jax.jit(jnp.array_equal)(back, fargs[0])):
            raise RuntimeError(f"{transport} dispatch + return did not give back the rows sent")
        del back
        out.update(offdev_bytes_max=int(offdev), gb_s=offdev / med / 1e9, roundtrip_exact=True,
                   rows_sent_per_dest_max=int(sizes.max()), rows_buffer=m)
    out.update(ms=med * 1e3, compile_s=comp, reps=n)
    return out


def _ep_annotate(rows):
    """Join each ep_moe row with its exchange and one-device rows (module docstring, 3.)."""
    def find(variant, r, transport=None, mode=None):
        for q in rows:
            if (q["variant"] == variant and q["model"] == r["model"] and q["tokens"] == r["tokens"] and "ms" in q
                    and (transport is None or q.get("transport") == transport) and (mode is None or q["mode"] == mode)):
                return q
        return None

    for r in rows:
        if r["variant"] != "ep_moe" or "ms" not in r:
            continue
        xch = find("ep_exchange", r, transport=r["transport"])
        if xch is not None:
            r["exchange_ms"] = xch["ms"] * (2 if r["mode"] == "fwd+bwd" else 1)
            r["exchange_share"] = r["exchange_ms"] / r["ms"]
        one = find("ep_1dev", r, mode=r["mode"])
        if one is not None:
            r["one_device_ms"] = one["ms"]
            r["ep_over_1dev"] = r["ms"] / one["ms"]
            r["speedup_vs_1dev"] = r["devices"] * one["ms"] / r["ms"]


def _annotate_vs_dense(rows):
    """Add ``vs_dense`` (rate / the dense matmul's rate, same model, tokens and mode) to the
    single-device rows that ran, where this run timed that dense matmul."""
    dense = {(r["model"], r["tokens"], r["mode"]): r["tflop_s"] for r in rows
             if r["variant"] == "dense_matmul" and "tflop_s" in r}
    for r in rows:
        key = (r["model"], r["tokens"], r["mode"])
        if not r["variant"].startswith("ep_") and "tflop_s" in r and key in dense:
            r["vs_dense"] = r["tflop_s"] / dense[key]


def _sweep_table(rows):
    if not rows:
        return
    print(f"\nPallas tile sweep, {rows[0]['sweep']} (* = adopted; err = rel. error vs the first config)")
    print(f"{'kernel':13} {'config':22} {'ms':>9} {'TFLOP/s':>8} {'vs dense':>8} {'err':>8}")
    for r in rows:
        if "ms" not in r:
            val = f"  error: {r['error'][:60]}"
        elif "vs_dense" not in r:
            val = f"{r['ms']:9.3f} {r['tflop_s']:8.1f}"
        else:
            val = (f"{r['ms']:9.3f} {r['tflop_s']:8.1f} {r['vs_dense']:8.1%} {r['rel_err_vs_first']:8.1e}"
                   + ("" if r["ok"] else "  FAIL (not adopted)"))
        print(f"{r['kernel']:13} {r['config'] + ('*' if r.get('adopted') else ''):22} {val}")


def _ep_table(rows, ep):
    if not ep:
        return
    if "skipped" in ep:
        print(f"\nEP timing skipped: {ep['skipped']}")
        return
    nr = "; ".join(f"{t} not run: {why}" for t, why in ep["not_run"].items())
    print(f"\nEP timing: mesh {ep['mesh']}, tokens sharded over '{ep['tokens_sharded_over']}', T = tokens per device; "
          f"one device runs '{ep['one_device_impl']}'" + (f"; {nr}" if nr else ""))
    print("xchg = dispatch + return exchange alone (x2 for fwd+bwd); share = xchg / EP; EP/1dev = EP ms / one-device "
          "ms at the same T (1.0 = perfect weak scaling)")
    print(f"{'model':5} {'T/dev':>6} {'dev':>3} {'transport':17} {'mode':8} {'EP ms':>9} {'xchg ms':>9} {'share':>6} "
          f"{'1dev ms':>9} {'EP/1dev':>7} {'TFLOP/s/dev':>11}")
    for r in rows:
        if r["variant"] != "ep_moe":
            continue
        if "ms" not in r:
            print(f"{r['model']:5} {r['tokens']:>6} {r['devices']:>3} {r['transport']:17} {r['mode']:8}  "
                  f"error: {r['error'][:70]}")
            continue
        f = lambda key, fmt: format(r[key], fmt) if key in r else "-"  # noqa: E731
        print(f"{r['model']:5} {r['tokens']:>6} {r['devices']:>3} {r['transport']:17} {r['mode']:8} {r['ms']:9.3f} "
              f"{f('exchange_ms', '9.3f'):>9} {f('exchange_share', '6.1%'):>6} {f('one_device_ms', '9.3f'):>9} "
              f"{f('ep_over_1dev', '7.2f'):>7} {r['tflop_s']:11.1f}")
    for r in rows:
        if r["variant"] in ("ep_exchange", "ep_1dev") and "ms" not in r:
            print(f"{r['model']} {r['tokens']}/dev {r['variant']} {r.get('transport') or ''} {r['mode']}: "
                  f"error: {r['error'][:80]}")


def _table(rows, checks, skipped, info):
    print("\nchecks: " + ", ".join(f"{c['check']}={'ok' if c.get('ok') else 'FAIL'}" for c in checks))
    if skipped:
        print(f"skipped ({len(skipped)}; over --budget-s, or EP timing without >= 2 devices): " + "; ".join(skipped))
    if info.get("pallas_impl") not in (None, "not selected"):
        print("Pallas configs: " + ", ".join(f"{k}={v}" for k, v in info["pallas_configs"].items()))
    print(f"{'model':5} {'tokens':>6} {'dev':>3} {'variant':14} {'mode':15} {'ms':>9} {'TFLOP/s':>8} {'vs dense':>8}")
    for r in rows:
        if r["variant"] == "ep_moe":   # in the EP table
            continue
        if r["variant"] == "ep_exchange" and "ms" in r:
            val = f"{r['ms']:9.3f} {r['gb_s']:8.2f} GB/s off-device, {r['transport']}"
        else:
            val = f"{r['ms']:9.3f} {r['tflop_s']:8.1f}" if "ms" in r else f"  error: {r['error'][:60]}"
            val += f" {r['vs_dense']:8.1%}" if "vs_dense" in r else ""
        tok = f"{r['tokens']}" + ("/16" if r["tokens_run"] != r["tokens"] else "")
        print(f"{r['model']:5} {tok:>6} {r.get('devices', 1):>3} {r['variant']:14} {r['mode']:15} {val}")


if __name__ == "__main__":
    main()
