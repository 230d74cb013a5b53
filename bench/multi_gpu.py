"""The multi-GPU runs of issue 33, each checking correctness before it times.

Three sub-commands:

``cp``: context parallelism. One M3-shaped MSA layer (configs/minimax-m3.yaml: 64 q / 4 kv heads of 128, 4
index heads of 128, block 128, top-16; bf16), forward + backward (the gradient of a scalar of its output and
the sparse indexer KL with respect to q, k, v, qi, ki), at ``--tokens`` on the mesh ``sequence=n,data=rest``
for each n of ``--sequence`` that divides the device count (``_msa_context_parallel``, as
bench/cp_memory.py compiles it; n = 1: one device, no mesh). Check first (fp32, 512 tokens in two
documents, 8 q / 2 kv heads of 32, block 16, top-4): every n's output and q/k/v/qi/ki gradients equal
n = 1's within 1e-4 (relative to the largest element). Then per n (largest first, so each n's
``peak_bytes_in_use`` is its own high-water mark): compile time, the median of ``--reps`` calls, XLA's
per-device memory plan (``memory_analysis``; on GPU also ``peak_bytes_in_use``, the largest over the
devices) and the scaling efficiency t(1) / (n t(n)). When n = 1 does not fit at ``--tokens`` (its memory
plan exceeds the device, or it runs out of memory) it is recorded as "skipped: does not fit", and the
efficiency is measured at the largest halving of ``--tokens`` that one device holds (every n timed there too).

``ep_train``: the training step with expert parallelism: bench/train_step.py's model (the M3-style 1.9B, or
its tiny one with ``--tiny``) and its ``bench_one`` (compile, warm-up, timed steps, tokens/s, MFU per device)
on the mesh ``expert=n,data=rest`` for each n of ``--experts`` dividing the device count; the batch
(``--batch``, default one row per device) splits over all of them (``data * expert``). Check first: the
tiny model in fp32, one step of the same batch on every mesh: loss (and gradient norm) equal n = 1's within
1e-5. ``--profile N`` profiles N more steps per n and reports the all-to-all time per step found in the
profile's busiest lines (GPU; the CPU profile has no device lines).

``m2_decode``: paged decode (``DecodeEngine`` under ``sharding.use_mesh``) of an M2-shaped model with random
weights over ``--mesh`` (default ``expert=4,tensor=2``): configs/tiny-m2.yaml, or configs/minimax-m2.yaml
with ``--full``; parameters initialised directly sharded (``jax.jit(init_params, out_shardings=...)``).
The decoder layers are split as ``load_model`` gives them (``--layers stacked``: left stacked, so every step copies
each layer's weights out of the stacks, to measure that cost); ``--num-layers N`` keeps the model's first N layers.
``--weights-dtype fp8`` keeps the routed experts in FP8 (``Fp8Weight``: the random bf16 weights cast to e4m3 with one
fixed scale, 128 x 128 blocks; ``fp8_attention``: the attention projections too, dequantised by XLA in each step), as
``load_model(weights_dtype="fp8")`` keeps a published checkpoint's. Check first (tiny-m2, fp32, the same weights
dtype): prefill two prompts and take 4 greedy decode steps on the mesh and on one device: the same tokens. Then per
context of ``--contexts`` and batch of ``--batches``: decode tokens/s (``decode_greedy``, ``--steps`` steps per call,
median of ``--reps`` calls), each row's context filled without computing it (pages allocated, their zero keys cost
what real ones do in dense attention; a cell whose replicated KV cache would not fit the free device memory is
skipped), and the prefill time of one ``--prefill-tokens`` prompt (``--prefill-chunk`` tokens per step, compiled
first).

Every sub-command prints a short table last and writes ``multi_gpu_<command>.json`` under ``--out``
(``check``: the check's numbers and ``passed``; ``rows``); a failed check writes the JSON, times nothing
and exits 1.

Usage on 8 simulated CPU devices (small shapes, seconds; the device count must be set before JAX starts)::

    export XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu
    python bench/multi_gpu.py cp --tiny --impl xla --out /tmp/mg
    python bench/multi_gpu.py ep_train --tiny --out /tmp/mg
    python bench/multi_gpu.py m2_decode --tiny --out /tmp/mg

On an 8-GPU H200 machine::

    python3 bench/multi_gpu.py cp --tokens 131072 --out $OUT
    python3 bench/multi_gpu.py cp --tokens 1048576 --out $OUT/1m
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 bench/multi_gpu.py ep_train --seq 65536 --profile 1 --out $OUT
    python3 bench/multi_gpu.py m2_decode --full --weights-dtype fp8 --out $OUT
    python3 bench/multi_gpu.py m2_decode --full --mesh expert=8 --out $OUT/ep8
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from minimax_jax import sharding as sh  # noqa: E402
from minimax_jax.config import ModelConfig  # noqa: E402
from minimax_jax.ops.registry import clear_implementation_report, implementation_report  # noqa: E402

TOL = 1e-4


def log(msg: str) -> None:
    print(f"[multi_gpu] {msg}", flush=True)


def _sizes(text: str, devices: int, what: str) -> list[int]:
    ns = [int(x) for x in text.split(",") if x.strip()]
    keep = [n for n in ns if devices % n == 0]
    if len(keep) < len(ns):
        log(f"{what}: {sorted(set(ns) - set(keep))} do not divide the {devices} devices; left out")
    return keep


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _times(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        out.append(time.perf_counter() - t0)
    return out


def _stats(device=None) -> dict:
    try:
        return (device or jax.devices()[0]).memory_stats() or {}
    except Exception:  # noqa: BLE001 - not every backend reports memory
        return {}


def _free_bytes() -> int | None:
    """Bytes device 0 can still allocate (None where the backend does not say: CPU)."""
    s = _stats()
    return s["bytes_limit"] - s.get("bytes_in_use", 0) if "bytes_limit" in s else None


def _peak_bytes() -> int | None:
    peaks = [_stats(d).get("peak_bytes_in_use") for d in jax.devices()]
    return max(peaks) if all(p is not None for p in peaks) and peaks else None


def _oom(e: Exception) -> bool:
    msg = str(e)
    return "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower()


def _mesh_ctx(mesh, rules=None):
    return sh.use_mesh(mesh, rules or sh.load_rules("default")) if mesh is not None else contextlib.nullcontext()


def _finish(args, command: str, check: dict, rows: list, extra: dict, table: list[str]) -> int:
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"multi_gpu_{command}.json")
    dev = jax.devices()[0]
    with open(path, "w") as f:
        json.dump({"command": command, "args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                   "jax": jax.__version__, "backend": jax.default_backend(), "device": dev.device_kind,
                   "devices": len(jax.devices()), "check": check, "rows": rows, **extra}, f, indent=1, default=str)
    log(f"wrote {path}")
    print("\n".join(table), flush=True)
    return 0 if check["passed"] else 1


def _fmt(v, spec=".4g"):
    return "-" if v is None else format(v, spec) if isinstance(v, (int, float)) else str(v)


# ============================================================================== cp

def _cp_cfg(impl: str, small: bool, dtype: str) -> ModelConfig:
    cfg = ModelConfig.from_yaml(os.path.join(ROOT, "configs", "minimax-m3.yaml"))
    if small:
        cfg = cfg.replace(num_heads=8, num_kv_heads=2, head_dim=32, rotary_dim=16, index_num_heads=2,
                          index_head_dim=32, index_block_size=16, index_topk=4)
    return cfg.replace(msa_impl=impl, dtype=dtype)


def _cp_step(cfg: ModelConfig):
    """jit of ``((loss, o), grads wrt q, k, v, qi, ki)`` of one MSA layer; context parallel under a mesh
    with a sequence axis (``context_parallel.plan``), else ``msa_block`` on one device."""
    from minimax_jax.model.msa_block import msa_block
    from minimax_jax.model.transformer import _msa_context_parallel
    from minimax_jax.ops import context_parallel

    def loss(q, k, v, qi, ki, pos, seg):
        p = context_parallel.plan(pos.shape[0], pos.shape[1], (cfg.num_heads, cfg.num_kv_heads))
        a = (q, k, v, qi, ki, cfg, pos, seg, "sparse")
        o, kl_sum, kl_cnt, _, _ = msa_block(*a) if p is None else _msa_context_parallel(p, *a)
        return jnp.sum(o.astype(jnp.float32) ** 2) + kl_sum / jnp.maximum(kl_cnt, 1), o

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))


def _cp_inputs(cfg: ModelConfig, t: int, mesh, cut: int = 0, seed: int = 0):
    """q, k, v, qi, ki (normal), positions, segment ids of one row of ``t`` tokens (two documents split at
    ``cut`` when > 0), made directly sharded over the sequence axis under ``mesh``."""
    dt = jnp.dtype(cfg.dtype)
    shapes = [(1, t, cfg.num_heads, cfg.head_dim), (1, t, cfg.num_kv_heads, cfg.head_dim),
              (1, t, cfg.num_kv_heads, cfg.head_dim), (1, t, cfg.index_num_heads, cfg.index_head_dim),
              (1, t, cfg.index_head_dim)]

    def gen(key):
        xs = [jax.random.normal(k, s, dt) for k, s in zip(jax.random.split(key, len(shapes)), shapes)]
        i = jnp.arange(t, dtype=jnp.int32)
        second = (i >= cut) if cut else jnp.zeros_like(i, bool)
        return (*xs, (i - cut * second)[None], (1 + second.astype(jnp.int32))[None])

    out = None if mesh is None else NamedSharding(mesh, P(None, "sequence"))
    return jax.jit(gen, out_shardings=out)(jax.random.key(seed))


def _cp_mesh(n: int, devices: int):
    return sh.make_mesh(f"sequence={n},data={devices // n}") if n > 1 else None


def cp_check(args, ns: list[int], devices: int) -> dict:
    cfg = _cp_cfg(args.impl, True, "float32")
    t = args.check_tokens
    base = _cp_inputs(cfg, t, None, cut=t * 3 // 8 + 5)
    errs, ref = {}, None
    with jax.default_matmul_precision("float32"):
        for n in sorted(set([1] + ns)):
            mesh = _cp_mesh(n, devices)
            inputs = base if mesh is None else jax.device_put(base, NamedSharding(mesh, P(None, "sequence")))
            with _mesh_ctx(mesh):
                (_, o), grads = _cp_step(cfg)(*inputs)
            got = [np.asarray(x) for x in (o, *grads)]
            if ref is None:
                ref = got
                continue
            errs[n] = dict(zip(("o", "dq", "dk", "dv", "dqi", "dki"), (_rel(a, b) for a, b in zip(got, ref))))
            log(f"cp check sequence={n}: max relative error {max(errs[n].values()):.2e}")
    passed = all(e <= TOL for d in errs.values() for e in d.values())
    return {"tokens": t, "dtype": "float32", "tolerance": TOL, "relative_errors": errs, "passed": passed}


def cp_time(cfg: ModelConfig, t: int, n: int, devices: int, reps: int) -> dict:
    row = {"sequence": n, "tokens": t, "mesh": f"sequence={n},data={devices // n}" if n > 1 else "one device"}
    mesh = _cp_mesh(n, devices)
    from train_step import memory_plan   # bench/train_step.py: XLA's plan as bytes

    try:
        with _mesh_ctx(mesh):
            inputs = _cp_inputs(cfg, t, mesh)
            t0 = time.perf_counter()
            compiled = _cp_step(cfg).lower(*inputs).compile()
            row["compile_s"] = round(time.perf_counter() - t0, 2)
            row["memory_plan"] = memory_plan(compiled)
            free = _free_bytes()
            need = row["memory_plan"].get("total_est_bytes")
            if free is not None and need is not None and need > free:
                row["status"] = f"skipped: does not fit (plan {need / 2**30:.1f} GiB > {free / 2**30:.1f} GiB free)"
                return row
            jax.block_until_ready(compiled(*inputs))         # first call
            times = _times(lambda: compiled(*inputs), reps)
    except Exception as e:  # noqa: BLE001 - out of memory is a result; anything else is not
        if not _oom(e):
            raise
        row.update(status="skipped: does not fit", error=f"{type(e).__name__}: {str(e)[:300]}")
        return row
    row.update(status="ok", time_s=statistics.median(times), times_s=times, peak_bytes_in_use=_peak_bytes())
    log(f"cp tokens={t} sequence={n}: {row['time_s'] * 1e3:.2f} ms (compile {row['compile_s']} s), plan temp "
        f"{row['memory_plan'].get('temp_size_in_bytes', 0) / 2**30:.3f} GiB per device")
    return row


def _efficiency(rows: list[dict], t: int) -> None:
    at = {r["sequence"]: r for r in rows if r["tokens"] == t and r.get("status") == "ok"}
    if 1 in at:
        for n, r in at.items():
            r["efficiency"] = at[1]["time_s"] / (n * r["time_s"])


def cmd_cp(args) -> int:
    devices = len(jax.devices())
    ns = _sizes(args.sequence, devices, "--sequence")
    if args.tiny:
        args.tokens, args.reps = min(args.tokens, 512), min(args.reps, 2)
    args.dtype = args.dtype or ("float32" if args.tiny else "bfloat16")
    clear_implementation_report()
    check = cp_check(args, ns, devices)
    rows: list[dict] = []
    extra = {"check_implementations": implementation_report()}
    if check["passed"]:
        cfg = _cp_cfg(args.impl, args.tiny, args.dtype)
        clear_implementation_report()
        order = sorted(set(ns) | {1}, reverse=True)            # largest n first: peaks grow as n shrinks
        rows = [cp_time(cfg, args.tokens, n, devices, args.reps) for n in order]
        one = [r for r in rows if r["sequence"] == 1]
        ref_t = args.tokens
        if one and one[0]["status"] != "ok":              # the largest length one device holds
            floor = 2 * max(order) * cfg.index_block_size
            ref_t = args.tokens // 2
            while ref_t >= floor:
                r = cp_time(cfg, ref_t, 1, devices, args.reps)
                rows.append(r)
                if r["status"] == "ok":
                    rows += [cp_time(cfg, ref_t, n, devices, args.reps) for n in order if n > 1]
                    break
                ref_t //= 2
            else:
                ref_t = None                                # one device holds none of them
        _efficiency(rows, ref_t)
        extra.update(implementations=implementation_report(), efficiency_tokens=ref_t,
                     shapes=dict(heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                 index_heads=cfg.index_num_heads, index_dim=cfg.index_head_dim,
                                 block=cfg.index_block_size, topk=cfg.index_topk, dtype=cfg.dtype, impl=cfg.msa_impl))
    table = [f"cp check: {'passed' if check['passed'] else 'FAILED'} (max relative error "
             f"{max([e for d in check['relative_errors'].values() for e in d.values()] or [0]):.1e})",
             f"{'tokens':>9} {'seq':>4} {'ms':>10} {'eff':>6} {'temp GiB':>9} {'peak GiB':>9}  status"]
    for r in rows:
        mem, pk = r.get("memory_plan", {}), r.get("peak_bytes_in_use")
        table.append(f"{r['tokens']:>9} {r['sequence']:>4} {_fmt(r.get('time_s') and r['time_s'] * 1e3, '.2f'):>10} "
                     f"{_fmt(r.get('efficiency'), '.2f'):>6} "
                     f"{_fmt(mem.get('temp_size_in_bytes') and mem['temp_size_in_bytes'] / 2**30, '.3f'):>9} "
                     f"{_fmt(pk and pk / 2**30, '.2f'):>9}  {r['status']}")
    return _finish(args, "cp", check, rows, extra, table)


# ============================================================================== ep_train

def _train_args(out: str, mesh: str, mode: str, seq: int, args, *more: str):
    import train_step

    flags = ["--out", out, "--mesh", mesh, "--modes", mode, f"--{mode}-seq", str(seq), "--batch", str(args.batch),
             "--steps", str(args.steps), "--warmup", str(args.warmup), *more]
    return train_step.parser().parse_args(flags + (["--tiny"] if args.tiny else []))


def ep_check(args, ns: list[int], devices: int, out: str) -> dict:
    """One step of the tiny model in fp32 on every mesh: loss and gradient norm equal n = 1's."""
    import train_step
    from minimax_jax.train.data import SyntheticIterator
    from minimax_jax.train.loop import Trainer

    seq, got = args.check_seq, {}
    with jax.default_matmul_precision("float32"):
        for n in sorted(set([1] + ns)):
            targs = train_step.parser().parse_args(["--out", out, "--tiny", "--mesh", f"expert={n},data={devices // n}",
                                                    "--batch", str(devices)])
            tc = train_step.make_trainer("msa", seq, targs).tc
            tr = Trainer(dataclasses.replace(tc, run=dataclasses.replace(tc.run, compute_dtype="float32")))
            batch = next(SyntheticIterator(seq, devices, tr.cfg.vocab_size, seed=0, mean_doc_len=seq // 3))
            _, m = tr.run_step(tr.phase_of(10**6), tr.initial_state(), batch)
            got[n] = {k: float(m[k]) for k in ("loss", "grad_norm") if k in m}
            log(f"ep check expert={n}: {got[n]}")
    errs = {n: {k: abs(v - got[1][k]) / max(abs(got[1][k]), 1e-30) for k, v in g.items()}
            for n, g in got.items() if n != 1}
    passed = all(np.isfinite(v) for g in got.values() for v in g.values()) and all(
        e <= 1e-5 for d in errs.values() for e in d.values())
    return {"seq": seq, "batch": devices, "dtype": "float32", "tolerance": 1e-5, "values": got,
            "relative_errors": errs, "passed": passed}


_A2A = re.compile(r"all-to-all|all_to_all|alltoall", re.I)


def _all_to_all_ms(profile: dict | None) -> float | None:
    """All-to-all ms per step in the profile's busiest lines (the busiest such line), or None."""
    if not profile:
        return None
    per_line = [sum(t["ms"] for t in ln["top"] if _A2A.search(t["name"])) for ln in profile.get("lines", [])]
    return max(per_line) if per_line and max(per_line) > 0 else None


def cmd_ep_train(args) -> int:
    import train_step

    devices = len(jax.devices())
    ns = _sizes(args.experts, devices, "--experts")
    args.batch = args.batch or devices
    if args.tiny:
        args.seq, args.steps, args.warmup = min(args.seq, 256), min(args.steps, 2), min(args.warmup, 1)
    out = args.out
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="multi_gpu_ep_") as tmp:
        check = ep_check(args, ns, devices, tmp)
    rows: list[dict] = []
    if check["passed"]:
        for n in ns:
            mesh = f"expert={n},data={devices // n}"
            more = ["--profile", str(args.profile)] if args.profile else []
            targs = _train_args(os.path.join(out, f"ep_train_expert{n}"), mesh, args.mode, args.seq, args, *more)
            os.makedirs(targs.out, exist_ok=True)
            try:
                r = train_step.bench_one(args.mode, args.seq, targs)
                r.update(status="ok", all_to_all_ms_per_step=_all_to_all_ms(r.get("profile")))
            except Exception as e:  # noqa: BLE001 - out of memory is a result
                if not _oom(e):
                    raise
                r = {"status": "skipped: does not fit", "error": f"{type(e).__name__}: {str(e)[:300]}"}
            r.update(expert=n, data=devices // n, mesh=mesh)
            rows.append(r)
    table = [f"ep_train check: {'passed' if check['passed'] else 'FAILED'} (losses {check['values']})",
             f"{'expert':>6} {'data':>4} {'step s':>9} {'tokens/s':>10} {'MFU':>6} {'a2a ms':>7}  status"]
    for r in rows:
        table.append(f"{r['expert']:>6} {r['data']:>4} {_fmt(r.get('step_s_median'), '.4f'):>9} "
                     f"{_fmt(r.get('tokens_per_s'), '.0f'):>10} {_fmt(r.get('mfu'), '.3f'):>6} "
                     f"{_fmt(r.get('all_to_all_ms_per_step'), '.2f'):>7}  {r['status']}")
    return _finish(args, "ep_train", check, [{k: v for k, v in r.items() if k != "step_s_all"} for r in rows],
                   {"mode": args.mode, "seq": args.seq, "batch": args.batch}, table)


# ============================================================================== m2_decode

#: the attention projections an FP8 checkpoint stores in FP8 (``--weights-dtype fp8_attention`` keeps them in FP8 too)
_FP8_ATTENTION = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj")


def _fp8_blocks(cfg: ModelConfig, block=(128, 128), attention: bool = False) -> dict:
    """``{leaf name: block}`` of the routed-expert weights (the leaves with an ``experts`` axis), and with
    ``attention`` of the decoder layers' attention projections."""
    from minimax_jax.model import param_axes
    from minimax_jax.model.fp8_params import leaf_name

    flat = jax.tree_util.tree_flatten_with_path(
        param_axes(cfg), is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(a, str) for a in x))[0]
    return {leaf_name(p): block for p, axes in flat
            if "experts" in axes or (attention and leaf_name(p).endswith(_FP8_ATTENTION))}


def param_shardings(cfg: ModelConfig, mesh, rules, weights_dtype=None):
    """``params_shardings``; with ``weights_dtype="fp8"`` / ``"fp8_attention"`` those of the tree with ``Fp8Weight``
    experts (and attention projections)."""
    from minimax_jax.model import abstract_params, params_shardings
    from minimax_jax.model.fp8_params import fp8_shardings, quantized_abstract

    s = params_shardings(cfg, mesh, rules)
    if weights_dtype not in ("fp8", "fp8_attention"):
        return s
    blocks = _fp8_blocks(cfg, attention=weights_dtype == "fp8_attention")
    return fp8_shardings(s, quantized_abstract(abstract_params(cfg), blocks))


def random_params(cfg: ModelConfig, mesh=None, rules=None, weights_dtype=None, seed: int = 0):
    """Random params made directly sharded over ``mesh`` (one device without); ``weights_dtype="fp8"``:
    the routed experts as ``Fp8Weight`` (the random weights over one fixed scale, cast to e4m3);
    ``"fp8_attention"``: the attention projections too."""
    from minimax_jax.model import init_params
    from minimax_jax.model.fp8_params import leaf_name
    from minimax_jax.ops.moe.fp8_weight import FP8_DTYPE, Fp8Weight, scale_shape

    blocks = _fp8_blocks(cfg, attention=weights_dtype == "fp8_attention") if weights_dtype else {}
    fmax = float(jnp.finfo(FP8_DTYPE).max)
    s = 16.0 * cfg.initializer_range / fmax          # 16 standard deviations fit e4m3's range

    def one(name, x):
        if name not in blocks:
            return x
        w = jnp.clip(x.astype(jnp.float32) / s, -fmax, fmax).astype(FP8_DTYPE)
        return Fp8Weight(w, jnp.full(scale_shape(x.shape, blocks[name]), s, jnp.float32), blocks[name])

    def init(key):
        return jax.tree_util.tree_map_with_path(lambda p, x: one(leaf_name(p), x), init_params(cfg, key))

    out = None if mesh is None else param_shardings(cfg, mesh, rules, weights_dtype)
    return jax.jit(init, out_shardings=out)(jax.random.key(seed))


def _greedy(params, cfg, prompts, steps: int, mesh, rules) -> tuple[np.ndarray, np.ndarray]:
    from minimax_jax.decode.engine import DecodeEngine

    with _mesh_ctx(mesh, rules):
        eng = DecodeEngine(params, cfg, max_seqs=len(prompts), max_len=max(map(len, prompts)) + steps + 1,
                           prefill_chunk=16, prefix_cache=False)
        slots, logits = eng.prefill(prompts)
        first = np.array([int(np.argmax(lg[-1])) for lg in logits], np.int32)
        chosen = eng.decode_greedy(first, slots, steps)
    return np.concatenate([first[:, None], chosen], 1), np.stack([lg[-1] for lg in logits])


def m2_check(args, mesh, rules) -> dict:
    cfg = ModelConfig.from_yaml(os.path.join(ROOT, "configs", "tiny-m2.yaml")).replace(dtype="float32",
                                                                                        param_dtype="float32")
    params = random_params(cfg, None, None, args.weights_dtype, seed=1)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (37, 20)]
    with jax.default_matmul_precision("float32"):
        shard = jax.device_put(params, param_shardings(cfg, mesh, rules, args.weights_dtype))
        one, l1 = _greedy(_layout(params, cfg, args), cfg, prompts, 4, None, None)
        many, lm = _greedy(_layout(shard, cfg, args), cfg, prompts, 4, mesh, rules)
    log(f"m2_decode check: one device {one.tolist()}, mesh {many.tolist()}")
    return {"model": "tiny-m2", "dtype": "float32", "weights_dtype": args.weights_dtype, "one_device": one.tolist(),
            "mesh": many.tolist(), "first_logits_relative_error": _rel(lm, l1),
            "passed": bool(np.array_equal(one, many))}


def _layout(params, cfg, args, delete: bool = False):
    """``params`` with the decoder layers as ``--layers`` asks (``split``: ``model.split_layers``, as
    ``load_model`` gives the engine, ``delete``: the stacked arrays deleted as they are split; ``stacked``: as made,
    each step then copies the layers out of the stacks)."""
    from minimax_jax.model import split_layers

    return split_layers(params, cfg, delete_stacked=delete) if args.layers == "split" else params


def _cache_bytes(cfg, seqs: int, max_len: int, page: int, kv_dtype) -> int:
    from minimax_jax.decode.cache import CacheSpec, init_cache

    pages = -(-max_len // page)
    spec = CacheSpec(page, seqs * pages + 1, pages, kv_dtype or cfg.dtype, kv_dtype or cfg.dtype,
                     tuple(cfg.layer_types))
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(lambda: init_cache(cfg, spec))))


def _engine(params, cfg, seqs, max_len, args, page):
    from minimax_jax.decode.engine import DecodeEngine

    need, free = _cache_bytes(cfg, seqs, max_len, page, args.kv_dtype), _free_bytes()
    if free is not None and need > 0.9 * free:
        return None, f"skipped: does not fit (KV cache {need / 2**30:.1f} GiB per device > 90% of {free / 2**30:.1f} free)"
    return DecodeEngine(params, cfg, max_seqs=seqs, max_len=max_len, kv_dtype=args.kv_dtype, prefix_cache=False,
                        prefill_chunk=min(args.prefill_chunk, max_len)), None


def decode_cell(params, cfg, mesh, rules, b: int, ctx: int, args, page: int) -> dict:
    row = {"kind": "decode", "batch": b, "context": ctx, "steps_per_call": args.steps}
    with _mesh_ctx(mesh, rules):
        try:
            eng, skip = _engine(params, cfg, b, ctx + args.steps * (args.reps + 1), args, page)
            if skip:
                return {**row, "status": skip}
            slots = []
            for _ in range(b):       # the context's pages allocated and counted as written, not computed
                slots.append(eng.prefill_start(np.ones(ctx, np.int32)))
                s = eng.seqs[slots[-1]]
                s.tokens, s.prompt = s.prompt, None
            tok = np.ones(b, np.int32)
            t0 = time.perf_counter()
            tok = eng.decode_greedy(tok, slots, args.steps)[:, -1]          # compile + first call
            row["first_call_s"] = round(time.perf_counter() - t0, 2)
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                tok = eng.decode_greedy(tok, slots, args.steps)[:, -1]
                times.append(time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - out of memory is a result
            if not _oom(e):
                raise
            return {**row, "status": "skipped: does not fit", "error": f"{type(e).__name__}: {str(e)[:300]}"}
    t = statistics.median(times)
    row.update(status="ok", call_s=t, times_s=times, tokens_per_s=b * args.steps / t,
               ms_per_step=t / args.steps * 1e3, peak_bytes_in_use=_peak_bytes())
    log(f"decode batch={b} context={ctx}: {row['tokens_per_s']:.1f} tokens/s ({row['ms_per_step']:.2f} ms per step)")
    return row


def prefill_cell(params, cfg, mesh, rules, n: int, args, page: int) -> dict:
    row = {"kind": "prefill", "batch": 1, "context": n, "prefill_chunk": min(args.prefill_chunk, n)}
    with _mesh_ctx(mesh, rules):
        try:
            eng, skip = _engine(params, cfg, 1, n, args, page)
            if skip:
                return {**row, "status": skip}
            t0 = time.perf_counter()
            eng.compile_prefill(n)
            row["compile_s"] = round(time.perf_counter() - t0, 2)
            prompt = np.random.default_rng(0).integers(3, cfg.vocab_size, n)
            t0 = time.perf_counter()
            eng.prefill([prompt])                # returns host logits: done when it returns
            dt = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001
            if not _oom(e):
                raise
            return {**row, "status": "skipped: does not fit", "error": f"{type(e).__name__}: {str(e)[:300]}"}
    row.update(status="ok", prefill_s=dt, tokens_per_s=n / dt, peak_bytes_in_use=_peak_bytes())
    log(f"prefill {n} tokens: {dt:.3f} s ({n / dt:.0f} tokens/s)")
    return row


def cmd_m2_decode(args) -> int:
    rules = sh.load_rules(args.rules)
    mesh = sh.make_mesh(args.mesh)
    args.batches = args.batches or ("1,4" if args.tiny else "1,32,128")
    args.contexts = args.contexts or ("64,192" if args.tiny else "8192,131072")
    if args.tiny:
        args.prefill_tokens, args.prefill_chunk = min(args.prefill_tokens, 256), min(args.prefill_chunk, 64)
        args.steps, args.reps = min(args.steps, 4), min(args.reps, 2)
    clear_implementation_report()
    check = m2_check(args, mesh, rules)
    rows: list[dict] = []
    extra = {"mesh": args.mesh, "weights_dtype": args.weights_dtype, "kv_dtype": args.kv_dtype}
    if check["passed"]:
        path = args.config or os.path.join(ROOT, "configs", "minimax-m2.yaml" if args.full else "tiny-m2.yaml")
        cfg = ModelConfig.from_yaml(path)
        if args.num_layers:     # the model's first N layers (per-layer cost without the whole model's memory)
            n = args.num_layers
            cfg = cfg.replace(num_layers=n, layer_types=tuple(cfg.layer_types[:n]), mlp_types=tuple(cfg.mlp_types[:n]))
        contexts = [int(x) for x in args.contexts.split(",")]
        longest = max(contexts + [args.prefill_tokens]) + args.steps * (args.reps + 1)
        cfg = cfg.replace(max_position_embeddings=max(cfg.max_position_embeddings, longest))
        from minimax_jax.decode.engine import DEFAULT_PAGE_SIZE
        from minimax_jax.model.fp8_params import fp8_blocks, leaf_bytes

        page = cfg.index_block_size if cfg.has_msa else DEFAULT_PAGE_SIZE
        t0 = time.perf_counter()
        params = jax.block_until_ready(_layout(random_params(cfg, mesh, rules, args.weights_dtype), cfg, args,
                                                     delete=True))
        extra.update(config=os.path.relpath(path, ROOT), init_s=round(time.perf_counter() - t0, 1), layers=args.layers,
                     param_bytes=leaf_bytes(params), param_count=cfg.param_counts(), fp8_leaves=len(fp8_blocks(params)))
        log(f"{extra['config']}: params {extra['param_bytes'] / 2**30:.2f} GiB ({args.weights_dtype or cfg.param_dtype}) "
            f"made on mesh {args.mesh} in {extra['init_s']} s")
        clear_implementation_report()
        for ctx in contexts:
            for b in (int(x) for x in args.batches.split(",")):
                rows.append(decode_cell(params, cfg, mesh, rules, b, ctx, args, page))
        rows.append(prefill_cell(params, cfg, mesh, rules, args.prefill_tokens, args, page))
        extra["implementations"] = implementation_report()
    table = [f"m2_decode check: {'passed' if check['passed'] else 'FAILED'} (greedy tokens mesh == one device)",
             f"{'kind':>7} {'batch':>5} {'context':>8} {'tokens/s':>10} {'ms':>9}  status"]
    for r in rows:
        ms = r.get("ms_per_step") if r["kind"] == "decode" else (r.get("prefill_s") or 0) * 1e3 or None
        table.append(f"{r['kind']:>7} {r['batch']:>5} {r['context']:>8} {_fmt(r.get('tokens_per_s'), '.1f'):>10} "
                     f"{_fmt(ms, '.2f'):>9}  {r['status']}")
    return _finish(args, "m2_decode", check, rows, extra, table)


# ============================================================================== main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="Module docstring: what each run measures, usage.")
    sub = ap.add_subparsers(dest="command", required=True)

    def common(p):
        p.add_argument("--tiny", action="store_true", help="small shapes (8 simulated CPU devices, seconds)")
        p.add_argument("--out", required=True, help="folder of multi_gpu_<command>.json")

    p = sub.add_parser("cp", help="context-parallel MSA layer forward + backward")
    common(p)
    p.add_argument("--tokens", type=int, default=131072)
    p.add_argument("--sequence", default="1,2,4,8", help="sequence-axis sizes (those dividing the device count)")
    p.add_argument("--impl", default="auto", help="ModelConfig.msa_impl (auto | xla | pallas_gpu | "
                                                  "pallas_gpu_interpret | ...)")
    p.add_argument("--dtype", default=None, help="bfloat16 (default; --tiny: float32) or float32")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--check-tokens", type=int, default=512)

    p = sub.add_parser("ep_train", help="training step with expert parallelism (bench/train_step.py's model)")
    common(p)
    p.add_argument("--experts", default="1,2,4,8", help="expert-axis sizes (those dividing the device count)")
    p.add_argument("--mode", default="msa", choices=["msa", "dense"])
    p.add_argument("--seq", type=int, default=65536, help="tokens per row")
    p.add_argument("--batch", type=int, default=0, help="rows (0 = one per device)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--profile", type=int, default=0, help="profile this many more steps per mesh (all-to-all time)")
    p.add_argument("--check-seq", type=int, default=128)

    p = sub.add_parser("m2_decode", help="paged decode of an M2-shaped model over an expert + tensor mesh")
    common(p)
    p.add_argument("--mesh", default="expert=4,tensor=2")
    p.add_argument("--rules", default="default", help="sharding rule table (configs/sharding.yaml preset)")
    p.add_argument("--full", action="store_true", help="configs/minimax-m2.yaml (GPUs) instead of tiny-m2")
    p.add_argument("--config", default=None, help="a model YAML (overrides --full)")
    p.add_argument("--num-layers", type=int, default=None, help="keep only the model's first N layers")
    p.add_argument("--weights-dtype", default=None, choices=["fp8", "fp8_attention"],
                   help="keep the routed experts in FP8 (fp8_attention: the attention projections too, as an FP8 "
                        "checkpoint stores them)")
    p.add_argument("--kv-dtype", default=None, help="KV cache dtype (default the model's)")
    p.add_argument("--layers", default="split", choices=["split", "stacked"],
                   help="decoder layer layout the engine gets (split: as load_model gives it; stacked: the layers "
                        "copied out of their stacks in every step)")
    p.add_argument("--batches", default=None, help="decode batches (default 1,32,128; --tiny 1,4)")
    p.add_argument("--contexts", default=None, help="decode contexts (default 8192,131072; --tiny 64,192)")
    p.add_argument("--steps", type=int, default=16, help="decode steps per timed call (decode_greedy)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--prefill-tokens", type=int, default=131072)
    p.add_argument("--prefill-chunk", type=int, default=8192)

    args = ap.parse_args(argv)
    log(f"jax {jax.__version__}, {len(jax.devices())} x {jax.devices()[0].device_kind} ({jax.default_backend()})")
    return {"cp": cmd_cp, "ep_train": cmd_ep_train, "m2_decode": cmd_m2_decode}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
