"""Long-context inference (issue #8): time to first token and decode tokens/s of one checkpoint at
long contexts, with its MSA attention and with dense attention, through the runtime ``infer.py`` uses.

Usage (GPU machine; issue 8's 1M-token run first, 128K with what is left)::

    PYTHONUNBUFFERED=1 python3 bench/long_context_infer.py --contexts 1048576,131072 --budget-s 280 \
        --out $OUT/long_context

CPU smoke run (the demo checkpoint at tiny contexts)::

    python bench/long_context_infer.py --contexts 1024,2048 --prefill-chunk 128 --out /tmp/lc

Prefill settings (per context; recorded in each row): ``--prefill-chunk`` (default 0 = ``auto_chunk``:
``context // 8`` clamped to [256, 16384], i.e. 16384-token chunks at 128K and 1M: 64 chunks at 1M,
and enough query rows per kernel call to fill the GPU), ``--prefill-impl`` (engine
``prefill_implementation``, default ``auto``: the Pallas MSA kernels and the suffix-attention
kernel on a GPU, the XLA reference ops on CPU) and ``--prefill-widths`` (engine ``prefill_widths``,
default ``auto``: one full-width compiled prefill step when the GPU kernels run, whose cost follows
the positions, instead of one step per power-of-two bucket: 7 compiled steps per mode at 1M with
16384-token chunks).

Cases, in order: for each ``--contexts`` entry (default 131072, 1048576), each ``--attentions`` mode
(default ``as_trained`` = the checkpoint's MSA layers, then ``dense`` = the same weights with every
MSA layer run as full causal attention, ``infer.py --attention dense``). Each case runs in its own
worker process under the remaining budget (killed at the deadline: its row says "timeout" and how
far the prefill got); a case is skipped when less than ``--min-case-s`` is left, or when an earlier
case of the same context already took (or was killed after) longer than what is left.

A worker: ``minimax_jax.infer.load_model(checkpoint, attention=mode)`` (as ``infer.py``), a
deterministic prompt of ``context - max_new_tokens - 1`` tokens (this repository's own source and
docs, tokenised with the checkpoint's tokenizer and tiled; so prompt + generated tokens + the
pending token fill exactly the engine window ``context``, a power of two), a warm-up of the paged
engine's compiled steps at the same shapes (so TTFT and tokens/s exclude compilation; the warm-up
time is reported), then ``Generator.generate`` (paged engine, chunked prefill ``--prefill-chunk``,
greedy, exactly ``--max-new-tokens`` tokens: no stop token). ``--max_position_embeddings`` overrides
the checkpoint's context limit (RoPE does not depend on it) to test a checkpoint saved with a
shorter one; the override is recorded. The compile phase is logged (page-table widths compiled and
the time they took).

Writes ``long_context_infer.json`` under ``--out`` after every case (rows: context, prompt_tokens,
attention, attention_note, status, implementation_report, ttft_s, prefill_s, prefill_tok_s,
decode_tok_s, new_tokens, warmup_s, compile_prefill_s, compiled_widths, load_s, engine,
prefill_chunk, prefill_implementation, prefill_widths, ...) and one log per case; prints a table
last.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

RESULT_FILE = "long_context_infer.json"

#: Choices of --prefill-impl / --prefill-widths (subsets of minimax_jax.decode.step.PREFILL_IMPLEMENTATIONS
#: and minimax_jax.decode.engine.PREFILL_WIDTHS; spelled out so the driver does not import jax).
PREFILL_IMPLS = ("auto", "xla", "pallas_gpu", "pallas_gpu_interpret")
WIDTHS = ("auto", "pow2", "full")
PROGRESS_RE = re.compile(r"^prefill progress: (\d+)/(\d+) tokens in ([0-9.]+) s", re.M)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def auto_chunk(context: int) -> int:
    """Prefill chunk for an engine window of ``context`` tokens: infer.py's own default
    (``minimax_jax.infer.backends.auto_prefill_chunk``; on a GPU ``context // 8`` in [256, 16384])."""
    from minimax_jax.infer.backends import auto_prefill_chunk

    return auto_prefill_chunk(context)


# ----------------------------------------------------------------------------- worker
def context_tokens(tokenizer, n: int) -> list[int]:
    """``n`` deterministic token ids: this repository's Python sources and docs (sorted paths) tokenised
    file by file and tiled, ending with the tokens of a short code prompt."""
    paths = sorted(glob.glob(os.path.join(ROOT, "minimax_jax", "**", "*.py"), recursive=True))
    paths += sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    if not paths:
        raise FileNotFoundError(f"no source files under {ROOT}/minimax_jax to build the context from")
    texts = []
    for p in paths:
        with open(p, encoding="utf-8") as f:
            texts.append(f"# file: {os.path.relpath(p, ROOT)}\n{f.read()}\n\n")
    ids = [t for enc in tokenizer.encode_batch(texts, add_special_tokens=False) for t in enc.ids]
    tail = tokenizer.encode("\n\ndef main():\n", add_special_tokens=False).ids
    if n <= len(tail):
        return tail[-n:]
    body = n - len(tail)
    reps = -(-body // len(ids))
    return (ids * reps)[:body] + tail


def run_worker(args) -> dict:
    """One case in this process; returns its row (module docstring)."""
    import jax
    import numpy as np

    from minimax_jax.infer import GenerationConfig, Generator, SamplingParams, load_model
    from minimax_jax.infer.backends import make_backend
    from minimax_jax.infer.generation import check_context
    from minimax_jax.ops import implementation_report

    t0 = time.perf_counter()
    model = load_model(args.checkpoint, attention=args.attention, log=_log)
    cfg = model.cfg
    if args.max_position_embeddings:
        cfg = cfg.replace(max_position_embeddings=args.max_position_embeddings)
    new = args.max_new_tokens
    prompt = context_tokens(model.tokenizer, args.context - new - 1)
    check_context(cfg, [len(prompt)], new)     # ContextTooLong names the limit
    load_s = time.perf_counter() - t0
    chunk = args.prefill_chunk or auto_chunk(args.context)
    opts = {"prefill_chunk": chunk, "prefill_implementation": args.prefill_impl,
            "prefill_widths": args.prefill_widths}
    # Compile the engine's two steps at the shapes the measured run uses (same cfg, max_seqs=1,
    # max_len=context: the jit cache of minimax_jax.decode.step.model_step is shared).
    t1 = time.perf_counter()
    warm = make_backend("paged", model.params, cfg, max_seqs=1, max_len=args.context, **opts)
    widths_mode = warm.engine.prefill_widths
    _log(f"load {load_s:.1f} s; prompt {len(prompt)} tokens, prefill chunk {chunk} "
         f"({-(-len(prompt) // chunk)} chunks), prefill impl {args.prefill_impl}, widths {widths_mode}; "
         f"compiling the prefill steps (one per page-table width) and the decode step")
    widths = warm.engine.compile_prefill(len(prompt))   # every page-table width this prompt's chunks use
    compile_prefill_s = time.perf_counter() - t1
    _log(f"compiled prefill for {len(widths)} page-table width(s) {widths} (pages of {warm.engine.page_size}) "
         f"in {compile_prefill_s:.1f} s")
    handles, last, _ = warm.prefill([prompt[: chunk + 1]])
    warm.step(handles, np.array([[int(np.argmax(last[0]))]], np.int32))
    warm.free(handles[0])
    del warm
    warmup_s = time.perf_counter() - t1
    _log(f"warm-up (compile) {warmup_s:.1f} s")

    gen = Generator(cfg, model.params, model.tokenizer, engine="paged", engine_options=opts, log=_log)
    done = [0, time.perf_counter(), 0.0]          # tokens, start, last print

    def progress(n):
        done[0] += n
        el = time.perf_counter() - done[1]
        if el - done[2] >= args.progress_every_s or done[0] >= len(prompt):
            # Chunks are dispatched asynchronously: wait for the computed ones, so the line (and a
            # timed-out row's prefill_progress) counts finished tokens. Only when printing.
            jax.block_until_ready(gen.backend.engine.cache)
            el = time.perf_counter() - done[1]
            done[2] = el
            print(f"prefill progress: {done[0]}/{len(prompt)} tokens in {el:.1f} s", flush=True)

    config = GenerationConfig(max_new_tokens=new, sampling=SamplingParams(temperature=0.0), stop_token_ids=())
    done[1] = time.perf_counter()
    out = gen.generate([prompt], config, on_prefill_tokens=progress)
    st = out.stats
    return {
        "context": args.context, "prompt_tokens": len(prompt), "attention": args.attention,
        "attention_note": model.attention_note, "status": "ok",
        "implementation_report": implementation_report(),
        "ttft_s": st.ttft_s, "prefill_s": st.prefill_s, "prefill_tok_s": len(prompt) / st.prefill_s,
        "decode_s": st.decode_s, "decode_tok_s": st.tokens_per_s, "new_tokens": st.generated_tokens,
        "warmup_s": warmup_s, "compile_prefill_s": compile_prefill_s, "compiled_widths": widths,
        "load_s": load_s, "engine": st.engine, "prefill_chunk": chunk,
        "prefill_implementation": args.prefill_impl, "prefill_widths": widths_mode,
        "max_position_embeddings": cfg.max_position_embeddings,
        "max_position_embeddings_overridden": bool(args.max_position_embeddings),
        "prompt_sha256": hashlib.sha256(np.asarray(prompt, np.int64).tobytes()).hexdigest()[:16],
        "text_head": out.sequences[0].text[:80],
    }


# ----------------------------------------------------------------------------- driver
def _worker_cmd(args, context: int, attention: str, result: str) -> list[str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", f"--context={context}", f"--attention={attention}",
           f"--result={result}", f"--checkpoint={args.checkpoint}", f"--max-new-tokens={args.max_new_tokens}",
           f"--prefill-chunk={args.prefill_chunk}", f"--prefill-impl={args.prefill_impl}",
           f"--prefill-widths={args.prefill_widths}", f"--progress-every-s={args.progress_every_s}"]
    if args.max_position_embeddings:
        cmd.append(f"--max_position_embeddings={args.max_position_embeddings}")
    return cmd


def _run_case(args, context: int, attention: str, timeout_s: float) -> dict:
    tag = f"{context}_{attention}"
    log_path = os.path.join(args.out, f"case_{tag}.log")
    result = os.path.join(args.out, f".case_{tag}.json")
    row = {"context": context, "attention": attention, "log": os.path.basename(log_path)}
    t0 = time.perf_counter()
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(_worker_cmd(args, context, attention, result), stdout=logf, stderr=subprocess.STDOUT,
                                cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    row["wall_s"] = time.perf_counter() - t0
    with open(log_path, errors="replace") as f:
        text = f.read()
    if rc == 0 and os.path.isfile(result):
        with open(result) as f:
            row.update(json.load(f))
        os.remove(result)
        return row
    row["status"] = "timeout" if rc is None else f"error (exit {rc})"
    if rc is not None:
        row["error"] = text[-1500:]
    prog = PROGRESS_RE.findall(text)
    if prog:
        got, total, secs = prog[-1]
        row["prefill_progress"] = {"tokens": int(got), "of": int(total), "seconds": float(secs)}
    return row


def _save(args, info, rows) -> None:
    tmp = os.path.join(args.out, RESULT_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"info": info, "rows": rows}, f, indent=1)
    os.replace(tmp, os.path.join(args.out, RESULT_FILE))


def _fmt(v, spec):
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def print_table(rows) -> None:
    print(f"\n{'context':>8} {'attention':10} {'status':10} {'TTFT s':>8} {'prefill tok/s':>13} "
          f"{'decode tok/s':>12} {'new':>4}  implementations")
    for r in rows:
        impl = ",".join(f"{k}={v}" for k, v in sorted(r.get("implementation_report", {}).items())
                        if not k.endswith("auto_reason"))
        extra = ""
        if "prefill_progress" in r:
            p = r["prefill_progress"]
            extra = f"prefill reached {p['tokens']}/{p['of']} in {p['seconds']:.0f} s"
        print(f"{r['context']:>8} {r['attention']:10} {r['status'][:10]:10} {_fmt(r.get('ttft_s'), '8.2f'):>8} "
              f"{_fmt(r.get('prefill_tok_s'), '13.0f'):>13} {_fmt(r.get('decode_tok_s'), '12.1f'):>12} "
              f"{_fmt(r.get('new_tokens'), '4d'):>4}  {impl or extra or r.get('reason', '')}")


def run_driver(args) -> int:
    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()
    info = {"checkpoint": os.path.abspath(args.checkpoint), "budget_s": args.budget_s, "argv": sys.argv[1:]}
    rows: list[dict] = []
    spent: dict[int, float] = {}          # context -> longest wall time of a case there (timeouts included)
    for context in args.contexts:
        for attention in args.attentions:
            left = args.budget_s - (time.perf_counter() - t_start)
            reason = None
            if left < args.min_case_s:
                reason = f"{left:.0f} s left < --min-case-s {args.min_case_s:.0f}"
            elif context in spent and spent[context] > left:
                reason = f"an earlier case at this context took {spent[context]:.0f} s > {left:.0f} s left"
            if reason:
                rows.append({"context": context, "attention": attention, "status": "skipped", "reason": reason})
                _log(f"skip {context} {attention}: {reason}")
            else:
                _log(f"case {context} {attention}: up to {left:.0f} s")
                row = _run_case(args, context, attention, left)
                spent[context] = max(spent.get(context, 0.0), row["wall_s"])
                rows.append(row)
                _log(f"  -> {row['status']} in {row['wall_s']:.1f} s")
            _save(args, info, rows)
    info["wall_s"] = time.perf_counter() - t_start
    _save(args, info, rows)
    print_table(rows)
    return 0


def _pow2_list(text: str) -> list[int]:
    vals = [int(v) for v in text.split(",") if v.strip()]
    bad = [v for v in vals if v < 64 or v & (v - 1)]
    if bad:
        raise argparse.ArgumentTypeError(f"contexts must be powers of two >= 64 (the engine window), got {bad}")
    return vals


def _modes(text: str) -> list[str]:
    from minimax_jax.infer.attention_mode import check_attention_mode

    vals = [v.strip() for v in text.split(",") if v.strip()]
    for v in vals:
        try:
            check_attention_mode(v)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return vals


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--checkpoint", default=os.path.join(ROOT, "checkpoints", "demo"))
    ap.add_argument("--out", default="/tmp/long_context_infer")
    ap.add_argument("--contexts", type=_pow2_list, default=[131072, 1048576], help="engine windows (powers of two)")
    ap.add_argument("--attentions", type=_modes, default=["as_trained", "dense"], help="infer.py --attention modes")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prefill-chunk", type=int, default=0,
                    help="infer.py --prefill_chunk; 0 = infer.py's default for the context (GPU: context // 8 in [256, 16384])")
    ap.add_argument("--prefill-impl", default="auto", choices=PREFILL_IMPLS,
                    help="DecodeEngine prefill_implementation (auto: GPU kernels on a GPU, XLA on CPU)")
    ap.add_argument("--prefill-widths", default="auto", choices=WIDTHS,
                    help="DecodeEngine prefill_widths (auto: one full-width step when the GPU kernels run)")
    ap.add_argument("--budget-s", type=float, default=120.0, help="wall-clock budget of all cases")
    ap.add_argument("--min-case-s", type=float, default=15.0, help="do not start a case with less time left")
    ap.add_argument("--max_position_embeddings", type=int, default=0, help="override the checkpoint's limit (0 = no)")
    ap.add_argument("--progress-every-s", type=float, default=5.0)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--context", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--attention", default="as_trained", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.max_new_tokens < 1 or args.prefill_chunk < 0:
        ap.error("--max-new-tokens must be >= 1 and --prefill-chunk >= 0 (0 = per context)")
    small = [c for c in args.contexts if c <= args.max_new_tokens + 1]
    if small:
        ap.error(f"contexts {small} leave no prompt tokens with --max-new-tokens {args.max_new_tokens}")
    if not args.worker:
        return run_driver(args)
    from minimax_jax.config import ConfigError
    from minimax_jax.infer.errors import InferenceError

    try:
        row = run_worker(args)
    except (InferenceError, ConfigError, ValueError, FileNotFoundError) as e:
        _log(f"error: {type(e).__name__}: {e}")
        return 1
    with open(args.result, "w") as f:
        json.dump(row, f, indent=1)
    _log(json.dumps({k: v for k, v in row.items() if k != "implementation_report"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
