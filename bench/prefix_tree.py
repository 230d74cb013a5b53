"""Prefix-tree merged training vs the same trajectories unmerged: time per training step (forward + backward).

Usage (GPU machine, one H200)::

    PYTHONUNBUFFERED=1 python3 bench/prefix_tree.py --out $OUT                 # dense and MSA, default workload
    python3 bench/prefix_tree.py --modes dense --steps 3 --out $OUT

CPU smoke run (tiny model and workload, float32; prints the equality check)::

    python bench/prefix_tree.py --tiny --out /tmp/tree_bench

CPU, no GPU needed: ``--lower-for cuda`` traces every step as the GPU runs it (the ops' "auto" choices
under ``assume_backend("gpu")``, abstract parameters) and lowers it for CUDA, reporting the
implementations and the number of Triton kernels; nothing is compiled or run::

    python bench/prefix_tree.py --lower-for cuda --out /tmp/tree_bench

Workload (synthetic agent rollouts, ``synthetic_rollouts``): ``--rollouts`` trajectories sharing a
``--prompt``-token system prompt + task; the rollouts split ``--branch-min``..``--branch-max`` ways at each
branch point until each has its own leaf, every edge a turn of ``--turn-min``..``--turn-max`` tokens
(assistant turns carry the loss, tool results do not); each leaf then continues for 0..``--tail-turns``
more turns alone (default 0).

Layouts, one step each over the same trajectories and the same parameters:
- ``unmerged``: the pipeline layout (inputs ``t[:-1]``, targets ``t[1:]``), trajectories packed first-fit
  into rows of ``--seq-len`` as separate documents (segment ids): the ordinary packed path (on GPU the
  attention op's ``auto``: cuDNN's packed layout or the flash kernel; MSA: the Pallas kernels);
- ``merged``: ``minimax_jax.data.prefix_tree.pack_trajectories`` (shared prefixes once; prefix-tree
  visibility: on GPU the attention op's ``pallas_tree_gpu`` kernel; MSA layers through the per-trajectory
  key layout, ``key_len``, i.e. the ordinary MSA kernels; their indexer KL runs over the unmerged inputs).
Measured: compile time, median step time over ``--steps`` after ``--warmup``, tokens per step of each layout,
the ideal ratio (unmerged tokens / merged tokens) and the measured one (unmerged time / merged time), the
loss of both (equal up to compute-dtype rounding; ``--tiny`` runs float32 and checks 1e-5), and the
implementations that ran. Model (``--tiny`` off): bench/train_step.py's M3-style 1.9B model (``dense``:
every MSA layer full attention), bf16 compute, fp32 params, ``remat=full``, no MTP, chunked lm head.
Writes ``prefix_tree.json`` under ``--out``; the table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from minimax_jax.config import ModelConfig  # noqa: E402
from minimax_jax.data.prefix_tree import ROW_KEYS, Trajectory, pack_trajectories  # noqa: E402
from minimax_jax.model import init_params  # noqa: E402
from minimax_jax.ops.registry import assume_backend, clear_implementation_report, implementation_report  # noqa: E402
from minimax_jax.train.step import StepSpec, _loss_fn, batch_norms  # noqa: E402

import train_step  # noqa: E402  (bench/train_step.py: the same models)

# bench/train_step.py's models (no MTP: prefix-tree batches refuse it), compute dtype as ``run`` sets there.
M3_STYLE = dict(train_step.M3_STYLE, num_mtp_modules=0, dtype="bfloat16", param_dtype="float32")
TINY = dict(train_step.TINY, num_mtp_modules=0, dtype="float32", param_dtype="float32")
TINY_WORKLOAD = dict(prompt=96, rollouts=6, turn_min=8, turn_max=40, seq_len=512)


def synthetic_rollouts(rng, *, prompt: int, rollouts: int, turn_min: int, turn_max: int, branch_min: int,
                       branch_max: int, vocab: int, tail_turns: int = 0) -> list[Trajectory]:
    """Agent-style trajectories sharing a prompt and branching (module docstring); loss on assistant turns."""
    def turn(assistant: bool):
        n = int(rng.integers(turn_min, turn_max + 1))
        return rng.integers(3, vocab, n).astype(np.int32), np.full(n, 1.0 if assistant else 0.0, np.float32)

    out: list[Trajectory] = []

    def grow(toks, mask, leaves, assistant):
        if leaves == 1:
            for _ in range(int(rng.integers(0, tail_turns + 1))):
                t, m = turn(assistant)
                toks, mask, assistant = np.concatenate([toks, t]), np.concatenate([mask, m]), not assistant
            out.append(Trajectory(toks, mask))
            return
        k = min(int(rng.integers(branch_min, branch_max + 1)), leaves)
        split = np.diff(np.linspace(0, leaves, k + 1).round().astype(int))
        for n in split:
            t, m = turn(assistant)
            grow(np.concatenate([toks, t]), np.concatenate([mask, m]), int(n), not assistant)

    grow(rng.integers(3, vocab, prompt).astype(np.int32), np.zeros(prompt, np.float32), rollouts, True)
    return out


def unmerged_rows(trajs, seq_len: int) -> dict[str, np.ndarray]:
    """The pipeline layout: per trajectory inputs ``t[:-1]`` / targets ``t[1:]``, packed first-fit into rows
    of ``seq_len`` as separate documents (segments 1, 2, ...; padding segment -1)."""
    fill: list[int] = []
    place = []
    for t in sorted(trajs, key=lambda t: -t.tokens.size):
        n = t.tokens.size - 1
        r = next((r for r, f in enumerate(fill) if f + n <= seq_len), None)
        if r is None:
            fill.append(0)
            r = len(fill) - 1
        place.append((t, r, fill[r]))
        fill[r] += n
    rows = len(fill)
    b = {k: np.zeros((rows, seq_len), np.int32) for k in ("tokens", "targets", "positions")}
    b["segment_ids"] = np.full((rows, seq_len), -1, np.int32)
    b["loss_mask"] = np.zeros((rows, seq_len), np.float32)
    segs = [0] * rows
    for t, r, s in place:
        n = t.tokens.size - 1
        segs[r] += 1
        b["tokens"][r, s:s + n], b["targets"][r, s:s + n] = t.tokens[:-1], t.tokens[1:]
        b["positions"][r, s:s + n], b["segment_ids"][r, s:s + n] = np.arange(n), segs[r]
        b["loss_mask"][r, s:s + n] = t.loss_mask[1:]
    return b


#: The arrays of a layout indexed by row slot (the key layout's arrays have their own length).
SLOT_KEYS = frozenset(ROW_KEYS) | {"query_segment_ids"}


def fit_rows(batch: dict[str, np.ndarray], multiple: int) -> dict[str, np.ndarray]:
    """The layout with its rows cut after the fullest row's last token, rounded up to ``multiple`` slots
    (padding is a packing choice; ``--fit-rows`` gives both layouts the same treatment)."""
    length = batch["tokens"].shape[1]
    used = int(np.flatnonzero((batch["segment_ids"] > 0).any(axis=0)).max()) + 1
    cut = min(length, -(-used // multiple) * multiple)
    return {k: (v[:, :cut] if k in SLOT_KEYS and v.shape[1] == length else v) for k, v in batch.items()}


def _impls() -> dict:
    return {k: v for k, v in implementation_report().items() if not k.endswith("auto_reason")}


def lower_step(cfg: ModelConfig, params, batch: dict, *, kl_mode, logits_chunk: int, platform: str) -> dict:
    """Trace the step as on ``platform`` ("cuda") and lower it: the implementations and Triton kernel count."""
    spec = StepSpec(cfg=cfg, kl_mode=kl_mode, remat="full", logits_chunk=logits_chunk)
    fn = jax.jit(jax.value_and_grad(_loss_fn(spec, jax.tree.map(lambda _: True, params)), has_aux=True))
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    clear_implementation_report()
    t0 = time.perf_counter()
    with assume_backend("gpu"):
        txt = fn.trace(params, batch, batch_norms(batch, 0)).lower(lowering_platforms=(platform,)).as_text()
    return {"lower_s": round(time.perf_counter() - t0, 1), "triton_kernels": txt.count("__gpu$xla.gpu.triton"),
            "implementations": _impls()}


def time_step(cfg: ModelConfig, params, batch: dict, *, kl_mode, steps: int, warmup: int, logits_chunk: int,
              rows_per_call: int = 0, profile: tuple | None = None):
    """Compile and time ``value_and_grad`` of the training loss on ``batch``: (loss, compile s, median s, impls).

    ``rows_per_call`` > 0 splits the rows into calls of that many (gradient accumulation with the batch's
    global token count, so the summed LM loss equals the one-call one; the indexer KL, a per-call mean, does
    not sum to the one-call value); a step is all calls plus the sums. Returns (loss, lm loss, ...).
    """
    spec = StepSpec(cfg=cfg, kl_mode=kl_mode, remat="full", logits_chunk=logits_chunk)
    fn = jax.jit(jax.value_and_grad(_loss_fn(spec, jax.tree.map(lambda _: True, params)), has_aux=True))
    norms = batch_norms({k: jnp.asarray(v) for k, v in batch.items()}, 0)
    rows = next(iter(batch.values())).shape[0]
    per = rows_per_call if 0 < rows_per_call < rows else rows
    if rows % per:
        raise ValueError(f"--rows-per-call {per} does not divide the layout's {rows} rows")
    calls = [{k: jnp.asarray(v[i:i + per]) for k, v in batch.items()} for i in range(0, rows, per)]
    add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b))
    clear_implementation_report()
    t0 = time.perf_counter()
    compiled = fn.lower(params, calls[0], norms).compile()
    compile_s = time.perf_counter() - t0
    impls = _impls()
    def one_step(_=None):
        total = None
        for mb in calls:
            (part, aux), grads = compiled(params, mb, norms)
            part = (part, aux["lm_loss"], grads)
            total = part if total is None else add(total, part)
        return jax.block_until_ready(total)

    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        loss, lm_loss, _ = one_step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    if profile is not None:             # (tag, args): bench/train_step.py's profiler summary
        train_step.profile_steps(profile[0], profile[1], one_step)
    return float(loss), float(lm_loss), compile_s, statistics.median(times), impls


def bench_mode(mode: str, trajs, args) -> dict:
    fields = dict(TINY if args.tiny else M3_STYLE)
    if mode == "dense":
        fields["layer_types"] = ["full"] * fields["num_layers"]
    cfg = ModelConfig.from_dict(fields)
    if args.lower_for:
        params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    else:
        params = init_params(cfg, jax.random.key(0))
    kl = "sparse" if cfg.has_msa else None
    key_len = -(-sum(t.tokens.size for t in trajs) // 1024) * 1024          # room for every row's paths
    layouts = {"unmerged": unmerged_rows(trajs, args.seq_len),
               "merged": pack_trajectories(trajs, args.seq_len, key_len=key_len if cfg.has_msa else None)[0]}
    if args.fit_rows:
        layouts = {n: fit_rows(b, args.fit_rows) for n, b in layouts.items()}
    row = {"mode": mode, "rollouts": len(trajs)}
    for name, batch in layouts.items():
        if name not in args.layouts.split(","):
            continue
        tokens = int((batch["segment_ids"] > 0).sum())
        base = {"rows": int(batch["tokens"].shape[0]), "row_len": int(batch["tokens"].shape[1]), "tokens": tokens}
        if args.lower_for:
            row[name] = {**base,
                         **lower_step(cfg, params, batch, kl_mode=kl, logits_chunk=args.logits_chunk,
                                      platform=args.lower_for)}
            print(f"[prefix_tree] {mode} {name}: lowered for {args.lower_for}: {row[name]}", flush=True)
            continue
        try:
            loss, lm_loss, comp, step, impls = time_step(
                cfg, params, batch, kl_mode=kl, steps=args.steps, warmup=args.warmup, logits_chunk=args.logits_chunk,
                rows_per_call=args.rows_per_call, profile=(f"{mode}_{name}", args) if args.profile else None)
        except Exception as e:  # noqa: BLE001  (an OOM in one layout must not lose the others' numbers)
            row[name] = {**base, "error": f"{type(e).__name__}: {e}"[:500]}
            print(f"[prefix_tree] {mode} {name}: FAILED {row[name]['error']}", flush=True)
            continue
        row[name] = {**base, "loss": loss, "lm_loss": lm_loss, "compile_s": round(comp, 2), "step_s": step,
                     "implementations": impls}
        print(f"[prefix_tree] {mode} {name}: {batch['tokens'].shape[0]} rows, {tokens} tokens, loss {loss:.6f}, "
              f"compile {comp:.1f} s, step {step * 1e3:.1f} ms, {impls}", flush=True)
    if "unmerged" not in row or "merged" not in row:
        return row
    u, m = row["unmerged"], row["merged"]
    row["ideal_ratio"] = u["tokens"] / m["tokens"]
    if args.lower_for or "error" in u or "error" in m:
        return row
    row["speedup"] = u["step_s"] / m["step_s"]
    key = "lm_loss" if args.rows_per_call else "loss"      # split calls: the KL term is a per-call mean
    row["checked"] = key
    row["loss_rel_diff"] = abs(u[key] - m[key]) / abs(u[key])
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--modes", default="dense,msa")
    p.add_argument("--tiny", action="store_true", help="tiny float32 model and workload (CPU smoke run)")
    p.add_argument("--prompt", type=int, default=6144)
    p.add_argument("--rollouts", type=int, default=16)
    p.add_argument("--turn-min", type=int, default=200)
    p.add_argument("--turn-max", type=int, default=1500)
    p.add_argument("--branch-min", type=int, default=2)
    p.add_argument("--branch-max", type=int, default=4)
    p.add_argument("--tail-turns", type=int, default=0)
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--logits-chunk", type=int, default=4096)
    p.add_argument("--profile", type=int, default=0,
                   help="after the timed steps, profile this many more per layout (bench/train_step.py's summary)")
    p.add_argument("--layouts", default="unmerged,merged", help="comma list of unmerged,merged")
    p.add_argument("--fit-rows", type=int, default=0, metavar="MULTIPLE",
                   help="cut each layout's rows after its fullest row, rounded up to MULTIPLE slots (0: --seq-len)")
    p.add_argument("--rows-per-call", type=int, default=0,
                   help="rows per value_and_grad call (gradient accumulation; 0: all rows in one call)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lower-for", choices=("cuda",), default=None,
                   help="trace and lower each step for this platform on the CPU; nothing runs")
    args = p.parse_args(argv)
    if args.tiny:
        for k, v in TINY_WORKLOAD.items():
            setattr(args, k, v)
        args.logits_chunk = 0
    os.makedirs(args.out, exist_ok=True)
    vocab = (TINY if args.tiny else M3_STYLE)["vocab_size"]
    trajs = synthetic_rollouts(np.random.default_rng(args.seed), prompt=args.prompt, rollouts=args.rollouts,
                               turn_min=args.turn_min, turn_max=args.turn_max, branch_min=args.branch_min,
                               branch_max=args.branch_max, vocab=vocab, tail_turns=args.tail_turns)
    rows = []
    result = {"device": str(jax.devices()[0].device_kind), "tiny": args.tiny,
              "workload": {k: getattr(args, k) for k in ("prompt", "rollouts", "turn_min", "turn_max", "branch_min",
                                                         "branch_max", "tail_turns", "seq_len", "seed",
                                                         "fit_rows")},
              "rows_per_call": args.rows_per_call, "rows": rows}
    for m in args.modes.split(","):
        rows.append(bench_mode(m, trajs, args))
        with open(os.path.join(args.out, "prefix_tree.json"), "w") as f:      # after each mode: a crash keeps it
            json.dump(result, f, indent=1)
    if args.lower_for:
        for r in rows:
            print(f"{r['mode']:6} ideal {r['ideal_ratio']:.2f}: " + ", ".join(
                f"{n} {r[n]['triton_kernels']} Triton kernels {r[n]['implementations']}"
                for n in ("unmerged", "merged")))
        return 0
    ok = all(r.get("loss_rel_diff", float("inf")) < (1e-5 if args.tiny else 2e-2) for r in rows)
    what, tol = ("LM loss" if args.rows_per_call else "loss"), ("1e-5" if args.tiny else "2e-2")
    print(f"\nequality check ({what} merged vs unmerged, rel. tol {tol}): {'PASS' if ok else 'FAIL'}")
    print(f"{'mode':6} {'unmerged tok':>12} {'merged tok':>10} {'ideal':>6} {'slots u/m':>13} {'unmerged ms':>11} "
          f"{'merged ms':>9} {'speedup':>7} {'of ideal':>8}")
    for r in rows:
        if "speedup" not in r:
            print(f"{r['mode']:6} " + "; ".join(f"{n}: {r[n].get('error') or r[n].get('step_s')}"
                                                for n in ("unmerged", "merged") if n in r))
            continue
        u, m = r["unmerged"], r["merged"]
        slots = f"{u['rows'] * u['row_len']}/{m['rows'] * m['row_len']}"
        print(f"{r['mode']:6} {u['tokens']:12d} {m['tokens']:10d} {r['ideal_ratio']:6.2f} {slots:>13} "
              f"{u['step_s'] * 1e3:11.1f} {m['step_s'] * 1e3:9.1f} {r['speedup']:7.2f} "
              f"{r['speedup'] / r['ideal_ratio']:8.2f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
