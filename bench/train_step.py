"""Training-step benchmark: tokens/s and MFU of the production train step (``minimax_jax.train``).

Usage (GPU machine, one H200)::

    PYTHONUNBUFFERED=1 python3 bench/train_step.py --out $OUT            # dense 8K and MSA 64K
    python3 bench/train_step.py --modes msa --compile-only --out $OUT     # compile + XLA's memory plan only
    python3 bench/train_step.py --modes msa --steps 3 --warmup 1 --out $OUT
    # the MSA 64K step saving kernel outputs (no KL / attention / indexer recompute): ~111 GB of XLA's plan,
    # more than JAX's default 75 % of an H200, hence the memory fraction
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 bench/train_step.py --modes msa --remat dots_kernels --out $OUT

CPU, no GPU needed: ``--lower-for cuda`` traces the step as the GPU runs it (ops' "auto" choices as
on a GPU, ``minimax_jax.ops.registry.assume_backend``), lowers it for CUDA and reports the Pallas
(Triton) kernels it contains and its largest arrays; nothing is compiled or run::

    python bench/train_step.py --modes msa --lower-for cuda --out /tmp/train_bench

CPU, no GPU needed, the GPU compiler's memory plan: ``--gpu-target h200`` compiles the step for compile-only
H200s (``minimax_jax.aot``; needs ``pip install "jax[cuda13]"``, no GPU) and reports XLA's buffer plan
against the target's memory, e.g. to see which ``--remat`` fits before spending device time::

    JAX_PLATFORMS=cpu python bench/train_step.py --modes msa --remat dots_kernels --gpu-target h200 --out /tmp/tb

CPU smoke run (a tiny model, seconds)::

    python bench/train_step.py --tiny --out /tmp/train_bench

Model (``--tiny`` off): an M3-style decoder of ~1.9B total / ~0.55B active parameters: Gemma norms,
per-head q/k norm, swigluoai, layer 0 dense full attention + dense MLP, layers 1-9 MSA + MoE
(16 experts, top-2, shared expert), 1 MTP module, 16 query / 4 kv heads of 128, index dim 128,
block 128, top-16 blocks. The vocabulary is 32768 (``--vocab``): by default the loss materialises
float32 logits ``[B, T, V]`` (8.6 GB at 64K tokens); at M3's 200K vocabulary that would be ~52 GB, so
``--logits-chunk N`` (``run.logits_chunk``) computes the lm head + cross-entropy N tokens at a time.

Modes: ``dense`` = the same model with every MSA layer turned into full attention (``--dense-seq``,
default 8192); ``msa`` = sparse attention with the sparse indexer KL (``--msa-seq``, default 65536).
Both: bf16 compute, fp32 master params, ``remat=full``, AdamW, batch ``--batch`` rows of packed
synthetic documents (one document per row unless ``--doc-len``), one device (mesh ``data=1``; ``--mesh``
another, e.g. ``expert=8`` as bench/multi_gpu.py ep_train runs it: MFU per device of the mesh).

Implementations: ``--attention-impl``, ``--moe-impl``, ``--msa-impl`` set the model's op choices
("auto" by default: on GPU the MoE uses the project's Pallas grouped matmul ``pallas_gpu``, 283-432
TFLOP/s on the H200 (bench/moe.py, 2026-11-30); elsewhere XLA ragged_dot, ``--moe-impl xla_ragged``, which
on GPU PLATFORM.md measured at ~4% of matmul speed and out of memory at full size; tokamax is
opt-in, ``--moe-impl tokamax``). What actually ran is in the result's ``implementations``.

Progress goes to stdout as it happens (``[train_step   12.3s] msa@65536: compile start``): per mode
building, lowering (with the number of Triton kernels), compile start / done (AOT
``.lower().compile()``, so the compile is timed apart from the first run), XLA's memory plan of the
compiled step (``memory_analysis()``: temp / argument / output / alias bytes), every step's
duration, then the JSON row. On SIGTERM / SIGINT / SIGHUP (``timeout``) a watcher thread reports at
once, even while the main thread is inside XLA (compile or a step), which phase the run was in and
for how long, with the Python stacks, writes ``train_step.json`` with the rows done so far and the
interrupted phase, and exits 128 + signal. ``--compile-only`` stops after the memory plan (no
parameters are allocated).

Measured: compile time, the median step time over ``--steps`` timed steps after ``--warmup``
steps (each ``block_until_ready``), tokens/s, model TFLOP/s and MFU by
``minimax_jax.train.metrics.train_flops`` (6 x matmul params + attention + indexer FLOPs, causal
context per token; ``flops_parts`` splits model / indexer / KL FLOPs, ``mfu_model`` counts the model's
alone and ``mfu_all`` all three), peak device memory, and the op implementations that ran. Writes
``train_step.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import os
import re
import signal
import statistics
import sys
import threading
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from minimax_jax import aot  # noqa: E402
from minimax_jax.ops.registry import assume_backend, clear_implementation_report, implementation_report  # noqa: E402
from minimax_jax.train.config import from_dict  # noqa: E402
from minimax_jax.train.data import SyntheticIterator, to_global  # noqa: E402
from minimax_jax.train.loop import Trainer  # noqa: E402
from minimax_jax.sharding import MeshSpec  # noqa: E402
from minimax_jax.train.metrics import matmul_params_per_token, peak_flops_per_device, train_flops_parts  # noqa: E402
from minimax_jax.train.plan import PhasePlan  # noqa: E402

M3_STYLE = dict(
    vocab_size=32768, hidden_size=2048, num_layers=10, num_heads=16, num_kv_heads=4, head_dim=128, rotary_dim=64,
    max_position_embeddings=131072, norm_kind="gemma", qk_norm="per_head", mlp_activation="swigluoai",
    layer_types=["full"] + ["msa"] * 9, mlp_types=["dense"] + ["moe"] * 9, dense_intermediate_size=5632,
    num_experts=16, num_experts_per_tok=2, moe_intermediate_size=1536, shared_intermediate_size=1536,
    routed_scaling_factor=2.0, index_head_dim=128, index_block_size=128, index_topk=16, num_mtp_modules=1,
    bos_token_id=1, eos_token_id=2)

TINY = dict(M3_STYLE, vocab_size=512, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
            rotary_dim=8, layer_types=["full", "msa", "msa"], mlp_types=["dense", "moe", "moe"],
            dense_intermediate_size=96, num_experts=4, moe_intermediate_size=32, shared_intermediate_size=32,
            index_head_dim=16, index_block_size=16, index_topk=4, max_position_embeddings=4096)


def model_fields(mode: str, tiny: bool) -> dict:
    m = dict(TINY if tiny else M3_STYLE)
    if mode == "dense":
        m["layer_types"] = ["full"] * m["num_layers"]
    return m


# ----------------------------------------------------------------------------- progress reporting

_T0 = time.perf_counter()
_STATE = {"where": "starting", "since": _T0}
_RESULTS: dict = {"rows": [], "errors": [], "out": None}
_EXIT_LOCK = threading.Lock()
_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")


def log(msg: str) -> None:
    """One progress line on stdout, flushed, with the seconds since the script started."""
    print(f"[train_step {time.perf_counter() - _T0:7.1f}s] {msg}", flush=True)


def phase(where: str) -> None:
    """Enter a phase: what a signal report says the run was doing."""
    _STATE.update(where=where, since=time.perf_counter())
    log(where)


def _write_results() -> None:
    if _RESULTS["out"] is None:
        return
    with open(os.path.join(_RESULTS["out"], "train_step.json"), "w") as f:
        json.dump({"results": _RESULTS["rows"], "errors": _RESULTS["errors"], "jax": jax.__version__}, f, indent=1)


def _report_and_exit(signum: int) -> None:
    if not _EXIT_LOCK.acquire(blocking=False):
        return                                  # the other reporter (thread / handler) is on it
    name = signal.Signals(signum).name
    now = time.perf_counter()
    log(f"{name}: stopped during '{_STATE['where']}' (in it for {now - _STATE['since']:.1f} s); rows done: "
        f"{[r['mode'] for r in _RESULTS['rows']] or 'none'}")
    try:
        sys.stdout.flush()
        faulthandler.dump_traceback(file=sys.stdout, all_threads=True)
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 - the report line above is what matters
        pass
    try:
        _RESULTS["errors"].append({"interrupted": name, "where": _STATE["where"],
                                   "phase_s": round(now - _STATE["since"], 1), "total_s": round(now - _T0, 1)})
        _write_results()
    finally:
        os._exit(128 + signum)


def install_signal_report() -> None:
    """Report ``timeout``'s SIGTERM (and SIGINT / SIGHUP) immediately.

    A Python signal handler runs only when the main thread returns to the interpreter, i.e. not while
    it sits in XLA's compiler or waits for a step. So the C-level handler also writes the signal
    number to a pipe (``signal.set_wakeup_fd``) that a daemon thread reads: it prints the phase and
    the stacks, saves the partial results and exits (XLA's compile and waits release the GIL).
    """
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    nums = {int(getattr(signal, n)) for n in _SIGNALS if hasattr(signal, n)}
    for n in nums:
        signal.signal(n, lambda signum, frame: _report_and_exit(signum))

    def watch():
        while True:
            data = os.read(r, 1)
            if data and data[0] in nums:        # the fd gets every signal that has a Python handler
                _report_and_exit(data[0])

    threading.Thread(target=watch, name="signal-report", daemon=True).start()


# ----------------------------------------------------------------------------- lowered-module summary

_TENSOR = re.compile(r"tensor<((?:\d+x)*)([a-z]+\d*)>")
_DT_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "i1": 1, "i8": 1, "ui8": 1, "i16": 2, "i32": 4, "ui32": 4,
             "i64": 8, "ui64": 8}


def kernel_counts(txt: str) -> Counter:
    """``{kernel name: count}`` of the Pallas kernels (Triton / Mosaic custom calls) in StableHLO text."""
    c: Counter = Counter()
    for ln in txt.splitlines():
        if "stablehlo.custom_call" in ln and ("triton" in ln or "tpu_custom_call" in ln):
            m = re.search(r'\bname = "([^"]+)"', ln)
            c[m.group(1) if m else "?"] += 1
    return c


def largest_arrays(txt: str, n: int = 12) -> list[tuple[int, str, int]]:
    """The ``n`` largest array types produced by ops of StableHLO text: ``(bytes, "1x65536x32768xf32",
    how many ops make one)``. Arrays inside loops (``lax.map`` chunks, the layer scan) count once."""
    seen: Counter = Counter()
    for ln in txt.splitlines():
        if " = " not in ln or " : " not in ln:
            continue
        for dims, dt in _TENSOR.findall(ln.rsplit(" : ", 1)[-1].split("->")[-1]):
            seen[dims + dt] += 1
    out = []
    for key, cnt in seen.items():
        dims, dt = _TENSOR.match(f"tensor<{key}>").groups()
        size = _DT_BYTES.get(dt, 4)
        for d in dims.rstrip("x").split("x"):
            size *= int(d) if d else 1
        out.append((size, key, cnt))
    return sorted(out, reverse=True)[:n]


def _gib(x) -> float:
    return round(x / 2**30, 3)


def memory_plan(compiled) -> dict:
    """XLA's buffer plan of a compiled step (``memory_analysis()``), bytes; {} where not reported.

    ``total_est_bytes`` = argument + output - alias + temp: what the step needs at its peak with the
    donated state aliased (the generated code is not counted)."""
    try:
        ma = compiled.memory_analysis()
    except Exception as e:  # noqa: BLE001 - not every backend reports it
        return {"memory_analysis_error": f"{type(e).__name__}: {e}"[:300]}
    if ma is None:
        return {}
    out = {}
    for k in ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
              "generated_code_size_in_bytes", "peak_memory_in_bytes"):
        v = getattr(ma, k, None)
        if v is not None:
            out[k] = int(v)
    if {"temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes"} <= out.keys():
        out["total_est_bytes"] = (out["argument_size_in_bytes"] + out["output_size_in_bytes"]
                                  - out.get("alias_size_in_bytes", 0) + out["temp_size_in_bytes"])
    return out


def fits_report(mem: dict, device_bytes: int) -> dict:
    """XLA's plan against a compile-only device's memory, with ``train.py --plan_for``'s verdict
    (``minimax_jax.train.plan.PhasePlan``): plan / device bytes, the fraction, the verdict."""
    p = PhasePlan("step", mem["temp_size_in_bytes"], mem["argument_size_in_bytes"], mem["output_size_in_bytes"],
                  mem.get("alias_size_in_bytes", 0), device_bytes)
    return {"plan_bytes": p.total, "device_bytes": device_bytes, "fraction": round(p.total / device_bytes, 4),
            "verdict": f"plan {_gib(p.total)} GiB of {_gib(device_bytes)} GiB ({100 * p.total / device_bytes:.1f} "
                       f"%): {p.verdict()}"}


def _device_memory() -> dict:
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - not every backend reports memory
        return {}
    return {k: stats[k] for k in ("peak_bytes_in_use", "bytes_limit") if k in stats}


# ----------------------------------------------------------------------------- one mode

def make_trainer(mode: str, seq: int, args, devices=None) -> Trainer:
    fields = model_fields(mode, args.tiny)
    fields.update(attention_impl=args.attention_impl, moe_impl=args.moe_impl, msa_impl=args.msa_impl)
    if args.vocab:
        fields["vocab_size"] = args.vocab
    tc = from_dict({
        "model": fields,
        "data": {"kind": "synthetic", "seq_len": seq, "batch_size": args.batch, "seed": 0,
                 "mean_doc_len": args.doc_len or seq * 100},
        "mesh": args.mesh,
        "optim": {"lr": 1e-4, "mtp_weights": 0.3, "grad_accum": 1, "mu_dtype": args.mu_dtype},
        "schedule": {"kind": "constant", "warmup_steps": 1},
        "msa": {"kl_coeff": args.kl_coeff},
        "checkpoint": {"every": 0},
        "run": {"run_dir": os.path.join(args.out, "unused"), "steps": 10**6, "compute_dtype": "bfloat16",
                "param_dtype": "float32", "remat": args.remat, "logits_chunk": args.logits_chunk,
                "progress": False, "tensorboard": False},
    })
    return Trainer(tc, devices)


def bench_one(mode: str, seq: int, args) -> dict:
    """Compile (and unless ``--compile-only`` / ``--lower-for``, time) the train step of one mode;
    returns a result row. Progress lines on stdout (module docstring)."""
    tag = f"{mode}@{seq}"
    phase(f"{tag}: building (model config, optimizer, shardings)")
    devices = None
    if args.gpu_target:                 # main checked the target and that the mesh has no -1 axis
        devices = aot.compile_only_gpus(args.gpu_target, math.prod(MeshSpec.parse(args.mesh).sizes()))
    tr = make_trainer(mode, seq, args, devices)
    cfg = tr.cfg
    counts = cfg.param_counts()
    clear_implementation_report()
    it = SyntheticIterator(seq, args.batch, cfg.vocab_size, seed=0, mean_doc_len=args.doc_len or seq * 100)
    step_phase = tr.phase_of(10**6)
    batch = next(it)
    row = {"mode": mode, "seq_len": seq, "batch": args.batch, "params_total": counts["total"],
           "params_active": counts["active"], "matmul_params_per_token": matmul_params_per_token(cfg),
           "remat": args.remat, "kl_coeff": args.kl_coeff, "vocab_size": cfg.vocab_size,
           "logits_chunk": args.logits_chunk, "mu_dtype": args.mu_dtype}
    abstract = args.compile_only or args.lower_for or args.gpu_target
    if abstract:                                      # shapes only: nothing is allocated
        state = tr.abstract_state(step_phase)
        gbatch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=tr.batch_sh) for k, v in batch.items()}
    else:
        phase(f"{tag}: initialising parameters and optimizer state")
        state = tr.initial_state()
        jax.block_until_ready(state)
        gbatch = to_global(batch, tr.batch_sh)
    phase(f"{tag}: tracing + lowering the train step" + (f" for {args.lower_for}" if args.lower_for else ""))
    t = time.perf_counter()
    with tr.mesh_context():
        if args.lower_for:
            with assume_backend("gpu" if args.lower_for == "cuda" else args.lower_for):
                lowered = tr.step_fn(step_phase).trace(state, gbatch).lower(lowering_platforms=(args.lower_for,))
        elif args.gpu_target:                       # compile-only GPUs: the shardings carry the platform
            with assume_backend("gpu"):
                lowered = tr.step_fn(step_phase).lower(state, gbatch)
        else:
            lowered = tr.step_fn(step_phase).lower(state, gbatch)
    row["lower_s"] = round(time.perf_counter() - t, 2)
    row["implementations"] = implementation_report()
    if "cudnn_packed" in row["implementations"].get("attention", "").split("; "):
        from minimax_jax.ops.attention import cudnn as cudnn_packed
        row["cudnn_packed"] = {"max_segments": cudnn_packed.DEFAULT_MAX_SEGMENTS,
                               "overflow": cudnn_packed.DEFAULT_OVERFLOW}
    txt = lowered.as_text()
    kernels = kernel_counts(txt)
    row["pallas_kernels"] = dict(sorted(kernels.items()))
    log(f"{tag}: lowered in {row['lower_s']} s: {sum(kernels.values())} Pallas kernel calls "
        f"({', '.join(f'{k} x{v}' for k, v in sorted(kernels.items())) or 'none'}); "
        f"implementations {row['implementations']}")
    if args.lower_for:
        big = largest_arrays(txt, args.top_arrays)
        row["largest_arrays"] = [{"shape": k, "bytes": b, "ops": c} for b, k, c in big]
        log(f"{tag}: largest arrays in the lowered step (loop bodies count once):")
        for b, k, c in big:
            log(f"    {b / 2**20:10.1f} MiB  {k}  ({c} ops)")
        row["lowered_for"] = args.lower_for
        print(json.dumps(row), flush=True)
        return row
    phase(f"{tag}: compile start")
    t = time.perf_counter()
    compiled = lowered.compile()
    row["compile_s"] = round(time.perf_counter() - t, 2)
    log(f"{tag}: compile done in {row['compile_s']} s")
    mem = memory_plan(compiled)
    row["memory_plan"] = mem
    if "total_est_bytes" in mem:
        limit = _device_memory().get("bytes_limit") if not args.gpu_target else None
        log(f"{tag}: memory plan: temp {_gib(mem['temp_size_in_bytes'])} GiB, argument "
            f"{_gib(mem['argument_size_in_bytes'])} GiB, output {_gib(mem['output_size_in_bytes'])} GiB, alias "
            f"{_gib(mem.get('alias_size_in_bytes', 0))} GiB -> total ~{_gib(mem['total_est_bytes'])} GiB"
            + (f" of {_gib(limit)} GiB usable" if limit else ""))
    else:
        log(f"{tag}: memory plan: {mem or 'not reported by this backend'}")
    dev = tr.mesh.devices.flat[0]
    row.update(device=dev.device_kind, backend=jax.default_backend())
    if args.gpu_target:
        row.update(gpu_target=args.gpu_target, compile_only=True, backend="cuda (compile-only devices)",
                   fits=fits_report(mem, aot.gpu_target_memory(args.gpu_target)))
        log(f"{tag}: on {dev.device_kind}: {row['fits']['verdict']}")
        print(json.dumps(row), flush=True)
        return row
    if args.compile_only:
        row["compile_only"] = True
        row.update(_device_memory())
        print(json.dumps(row), flush=True)
        return row

    def run(label):
        nonlocal state
        b = next(it)
        phase(f"{tag}: {label}")
        t0 = time.perf_counter()
        state, m = compiled(state, to_global(b, tr.batch_sh))
        jax.block_until_ready(m)
        dt = time.perf_counter() - t0
        log(f"{tag}: {label} took {dt:.3f} s (loss {float(m['loss']):.4f})")
        return dt, b, m

    first_s, _, _ = run("first step")
    row["first_step_s"] = round(first_s, 3)
    for i in range(args.warmup):
        run(f"warmup step {i + 1}/{args.warmup}")
    times, parts, loss = [], [], None
    for i in range(args.steps):
        dt, b, m = run(f"timed step {i + 1}/{args.steps}")
        times.append(dt)
        parts.append(train_flops_parts(cfg, b["positions"]))
        loss = float(m["loss"])
    step_s = statistics.median(times)
    fl = statistics.median(p["model"] + p["indexer"] for p in parts)       # = train_flops
    peak = peak_flops_per_device(dev.device_kind, args.peak_tflops)
    if peak:
        peak *= tr.mesh.devices.size                # the whole mesh's peak (1 device with the default mesh)
    row.update({
        "step_s_median": step_s, "step_s_all": times, "tokens_per_s": args.batch * seq / step_s,
        "model_tflops_per_s": fl / step_s / 1e12, "mfu": (fl / step_s / peak) if peak else None,
        "flops_per_step": fl, **_flop_parts(parts, step_s, peak), "loss_last": loss,
        "implementations": implementation_report(), **_device_memory(),
    })
    if args.profile:
        row["profile"] = profile_steps(tag, args, lambda i: run(f"profiled step {i + 1}/{args.profile}"))
    print(json.dumps({k: v for k, v in row.items() if k not in ("step_s_all", "profile")}), flush=True)
    return row


def _flop_parts(per_step: list[dict], step_s, peak) -> dict:
    """Per-step FLOPs by part (model / indexer / KL, ``train_flops_parts``; the median over the timed
    steps' batches) and the MFU of the model FLOPs alone (``mfu_model``) and of all three (``mfu_all``)."""
    parts = {k: statistics.median(p[k] for p in per_step) for k in per_step[0]}
    total = sum(parts.values())
    return {"flops_parts": parts, "mfu_model": parts["model"] / step_s / peak if peak else None,
            "mfu_all": total / step_s / peak if peak else None}


def profile_steps(tag: str, args, run_step) -> dict:
    """Runs ``args.profile`` more steps under ``jax.profiler.trace`` (perfetto JSON under
    ``<out>/profile_<tag>``) and returns bench/trace_summary.py's per-line top ops (ms per step)."""
    from trace_summary import format_summary, load_events, newest_trace, summarize

    pdir = os.path.join(args.out, f"profile_{tag.replace('@', '_')}")
    with jax.profiler.trace(pdir, create_perfetto_trace=True):
        for i in range(args.profile):
            run_step(i)
    events = load_events(newest_trace(pdir))
    rows, scope = summarize(events, top=30, steps=args.profile), "device"
    if not rows:        # a CPU run has no /device: process; its work is on the host's XLA threads
        rows, scope = summarize(events, top=30, steps=args.profile, device_only=False), "host (no device lines)"
    log(f"{tag}: profile of {args.profile} step(s), {scope}, ms per step:\n{format_summary(rows)}")
    return {"dir": pdir, "scope": scope, "lines": rows[:6]}


def parser() -> argparse.ArgumentParser:
    """The command line (bench/multi_gpu.py builds its runs' arguments with it)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="dense,msa", help="comma list of dense,msa")
    p.add_argument("--dense-seq", type=int, default=8192)
    p.add_argument("--msa-seq", type=int, default=65536)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--doc-len", type=int, default=0, help="mean packed document length (0 = one per row)")
    p.add_argument("--remat", default="full", choices=["none", "full", "dots", "dots_kernels"])
    p.add_argument("--vocab", type=int, default=0, help="vocabulary size (0 = the model's: 32768, tiny 512)")
    p.add_argument("--logits-chunk", type=int, default=0,
                   help="tokens per lm-head + cross-entropy slice (run.logits_chunk; 0 = whole logits)")
    p.add_argument("--mu-dtype", default=None, choices=["float32", "bfloat16"],
                   help="optim.mu_dtype: Adam first-moment dtype (default: the parameters')")
    p.add_argument("--kl-coeff", type=float, default=1.0, help="MSA indexer KL weight (0 = no KL)")
    p.add_argument("--peak-tflops", type=float, default=None, help="per-device peak (default: table by device)")
    p.add_argument("--attention-impl", default="auto", help="ModelConfig.attention_impl")
    p.add_argument("--cudnn-packed-segments", default=None,
                   help="cudnn_packed runs-per-row bounds, e.g. 2,8,32 (sets cudnn_packed.DEFAULT_MAX_SEGMENTS)")
    p.add_argument("--cudnn-packed-overflow", default=None, choices=["flash", "nan"],
                   help="cudnn_packed overflow (sets cudnn_packed.DEFAULT_OVERFLOW)")
    p.add_argument("--moe-impl", default="auto", help="ModelConfig.moe_impl: auto | xla_dense | xla_ragged | "
                                                      "xla_capacity | pallas_gpu | tokamax ('auto' = xla_dense for "
                                                      "small problems, else "
                                                      "the Pallas grouped matmul 'pallas_gpu' on GPU, XLA ragged_dot "
                                                      "elsewhere; 'tokamax' (carry it) is opt-in: see "
                                                      "minimax_jax/ops/moe/experts.py)")
    p.add_argument("--msa-impl", default="auto", help="ModelConfig.msa_impl (auto = Pallas kernels when present: "
                                                      "block selection, sparse attention and the indexer KL)")
    p.add_argument("--compile-only", action="store_true",
                   help="lower + compile each mode's step and print XLA's memory plan; no parameters, no steps")
    p.add_argument("--lower-for", default=None, choices=["cuda", "tpu"],
                   help="trace as that platform runs it and lower for it (works on a CPU machine); report the "
                        "Pallas kernels and the largest arrays; no compile")
    p.add_argument("--top-arrays", type=int, default=12, help="how many arrays --lower-for lists")
    p.add_argument("--gpu-target", default=None,
                   help="compile for compile-only GPUs of this target (configs/gpu_targets name, e.g. h200, or a "
                        "GpuTargetConfig file; minimax_jax.aot) and report the memory plan; no GPU needed")
    p.add_argument("--profile", type=int, default=0,
                   help="after the timed steps, profile this many more (jax.profiler; bench/trace_summary.py)")
    p.add_argument("--tiny", action="store_true", help="tiny model and short sequences (CPU smoke test)")
    p.add_argument("--mesh", default="data=1",
                   help="train.mesh (minimax_jax.sharding.MeshSpec), e.g. expert=8 or expert=2,data=4: the batch "
                        "splits over data*fsdp*expert; MFU is per device of the mesh (default: one device)")
    p.add_argument("--out", required=True)
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.tiny:
        args.dense_seq, args.msa_seq = min(args.dense_seq, 128), min(args.msa_seq, 256)
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    from minimax_jax.ops.attention import cudnn as cudnn_packed
    if args.cudnn_packed_segments:
        bounds = tuple(int(x) for x in args.cudnn_packed_segments.split(","))
        cudnn_packed.DEFAULT_MAX_SEGMENTS = bounds[0] if len(bounds) == 1 else bounds
    if args.cudnn_packed_overflow:
        cudnn_packed.DEFAULT_OVERFLOW = args.cudnn_packed_overflow
    for mode in modes:
        if mode not in ("dense", "msa"):
            p.error(f"unknown mode {mode!r}")
    if args.gpu_target is not None and args.lower_for:
        p.error("--gpu-target compiles for the GPU itself; leave out --lower-for")
    if args.gpu_target is not None:
        try:
            if -1 in MeshSpec.parse(args.mesh).sizes():
                raise ValueError(f"--gpu-target needs every --mesh axis size given (no -1): {args.mesh!r}")
            aot.compile_only_gpus(args.gpu_target, 1)          # the target and the CUDA plugin, checked up front
        except ValueError as e:
            p.error(str(e))
    os.makedirs(args.out, exist_ok=True)
    _RESULTS["out"] = args.out
    if threading.current_thread() is threading.main_thread():
        install_signal_report()
    log(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}; modes {modes}"
        + (" (compile only)" if args.compile_only else "")
        + (f" (lower for {args.lower_for})" if args.lower_for else ""))
    rows, errors = _RESULTS["rows"], _RESULTS["errors"]
    for mode in modes:
        seq = args.dense_seq if mode == "dense" else args.msa_seq
        try:
            rows.append(bench_one(mode, seq, args))
        except Exception as e:  # noqa: BLE001 - record and go on to the next mode
            errors.append({"mode": mode, "seq_len": seq, "where": _STATE["where"],
                           "error": f"{type(e).__name__}: {str(e)[:2000]}"})
            log(f"{mode} @ {seq}: FAILED during '{_STATE['where']}': {errors[-1]['error'][:500]}")
        _write_results()
    phase("done")
    _write_results()
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
