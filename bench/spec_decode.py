"""Speculative (MTP) vs plain greedy decoding on the shipped demo model: equal output, tokens/s, acceptance.

Usage (GPU machine)::

    PYTHONUNBUFFERED=1 python3 bench/spec_decode.py --out $OUT

For each prompt length (random token prompts, seeded) and each decode-row setting (``--rows``: ``per-step``
= every step its own row count, ``padded`` = every step padded to 1 + drafts rows, ``--decode_rows``), one
warm-up call then one timed call of plain greedy and of ``--speculative mtp`` greedy, ``--new`` tokens each
(no stop token): tokens/s of the timed calls, the first new-token index where the two outputs differ (None:
identical), drafts accepted per step. ``--decode-loops 8,32``: then plain greedy decoding with
``GenerationConfig.decode_loop`` = each value (steps per device loop, one host round trip each), timed the same
way and compared with the one-step plain output (rows ``loop N``; speed-up = vs one step at a time).
``--spec-loops 8,32``: for each decode-row setting and prompt, greedy speculative decoding in device loops
(``speculative="mtp", decode_loop`` = each value: N speculative steps, drafting, verification and acceptance on
the device, per host round trip) and the plain decode loop of the same N (rows ``<rows> spec loop N``; speed-up =
vs one plain step at a time, ``vs loop`` = vs the plain loop of N steps; first difference vs one-step plain
greedy). Writes ``spec_decode.json`` under ``--out``; the table is printed last.
``--checkpoint DIR``: another model (default: the shipped demo); ``--num-draft N``: drafts per speculative step
(default: all of the model's MTP modules); ``--prompts FILE``: prompts cut from a text file (``.txt``, or ``.jsonl``
with a ``text`` field per line) tokenized with the checkpoint's tokenizer, prompt i starting at token 7919 * i,
instead of random tokens (which leave the MTP modules nothing to predict).
``--mtp-window W``: positions the MTP layers attend over while drafting (default 64; for a model trained with
``model.mtp_attention_window`` = w, drafting is exact from num_draft x (w - 1) + 1).
CPU smoke run: ``python bench/spec_decode.py --lengths 64 --new 16 --spec-loops 4 --out /tmp/spec``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from minimax_jax import cli_main  # noqa: E402
from minimax_jax.infer import GenerationConfig, Generator  # noqa: E402
from minimax_jax.infer.drafter import MAX_MTP_WINDOW  # noqa: E402

ROW_SETTINGS = ("per-step", "padded")


def _int_list(lo: int):
    """argparse type: a comma list of integers >= ``lo`` ("" = none)."""
    one = cli_main.int_at_least(lo)

    def parse(text: str) -> list[int]:
        return [one(x.strip()) for x in text.split(",") if x.strip()]
    return parse


def _choices(allowed):
    """argparse type: a non-empty comma list of ``allowed`` names."""
    def parse(text: str) -> list[str]:
        names = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in names if x not in allowed]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(allowed)}, got {text!r}")
        return names
    return parse
from minimax_jax.infer.loading import load_model  # noqa: E402


def _timed(gen, prompt, config):
    gen.generate([prompt], config)                                # warm-up (compiles)
    t0 = time.perf_counter()
    out = gen.generate([prompt], config)
    return out, time.perf_counter() - t0


def _first_difference(a, b):
    """First new-token index where two outputs differ (None: identical)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def _row(label, n, plain, tp, out, t):
    """A table row: ``out`` (timed ``t`` s) against one-step plain greedy ``plain`` (timed ``tp`` s)."""
    a, b, st = plain.sequences[0].tokens, out.sequences[0].tokens, out.stats
    return {"rows": label, "prompt": n, "new": len(a), "plain_tok_s": len(a) / tp, "spec_tok_s": len(b) / t,
            "speedup": tp / t, "first_difference": _first_difference(a, b), "acceptance_rate": st.acceptance_rate,
            "accepted_per_step": st.accepted / max(st.decode_steps, 1) if st.drafted else None,
            "drafted": st.drafted}


def _read_text(path):
    """The text of a ``.txt`` file, or the ``text`` fields of a ``.jsonl`` file (any case) joined by blank lines."""
    with open(path, encoding="utf-8") as f:
        if not path.lower().endswith(".jsonl"):
            return f.read()
        out = []
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    out.append(json.loads(line)["text"])
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f"line {i} is not a JSON object with a 'text' field ({type(e).__name__})") \
                        from None
        return "\n\n".join(out)


def _prompts(text, lengths, vocab_size, seed, tokenizer, source):
    """Token-id prompts of ``lengths``: random ids (``text`` None) or windows of ``text`` (read from ``source``)."""
    if text is None:
        rng = np.random.default_rng(seed)
        return [rng.integers(3, vocab_size, n).tolist() for n in lengths]
    ids = tokenizer.encode(text)
    ids = getattr(ids, "ids", ids)
    out = []
    for i, n in enumerate(lengths):
        if len(ids) < n:
            raise SystemExit(f"--prompts {source}: {len(ids)} tokens, fewer than the {n} a prompt needs")
        start = (7919 * i) % max(len(ids) - n, 1)
        out.append(list(ids[start:start + n]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="result folder (made if missing)")
    ap.add_argument("--lengths", type=_int_list(1), default="512,1000,4000", help="prompt lengths in tokens")
    ap.add_argument("--new", type=cli_main.int_at_least(1), default=1024, help="new tokens per call")
    ap.add_argument("--rows", type=_choices(ROW_SETTINGS), default="per-step,padded",
                    help="decode-row settings, comma list of " + ", ".join(ROW_SETTINGS))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--decode-loops", type=_int_list(1), default="",
                    help="comma list of decode_loop values to time after the rows")
    ap.add_argument("--spec-loops", type=_int_list(1), default="", help="comma list of decode_loop values of "
                    "speculative device loops (and plain loops of the same N), timed with each --rows setting")
    ap.add_argument("--checkpoint", default=None, help="model directory (default: the shipped demo)")
    ap.add_argument("--num-draft", type=int, default=None, help="drafts per speculative step (default: all modules)")
    ap.add_argument("--prompts", default="random", help="'random' token prompts, or a .txt / .jsonl text file")
    ap.add_argument("--mtp-window", type=cli_main.int_at_least(1, MAX_MTP_WINDOW), default=64,
                    help="positions the MTP layers attend over when drafting (default %(default)s)")
    args = ap.parse_args(argv)
    if not args.lengths:
        ap.error("--lengths: give at least one prompt length")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        ap.error(f"--out {args.out}: exists and is not a folder")
    try:
        text = None if args.prompts == "random" else _read_text(args.prompts)
    except (OSError, ValueError) as e:
        ap.error(f"--prompts {args.prompts}: {type(e).__name__}: {e}")
    os.makedirs(args.out, exist_ok=True)
    where = args.checkpoint or "checkpoints/demo"
    try:
        model = load_model(args.checkpoint)
    except Exception as e:     # one line naming the problem (CheckpointNotFound, mismatch, ...)
        ap.error(f"--checkpoint {where}: {type(e).__name__}: {str(e).splitlines()[0]}")
    cfg, params = model.cfg, model.params
    if not cfg.num_mtp_modules:
        ap.error(f"--checkpoint {where}: the model has no MTP modules (speculative decoding needs one)")
    k = cfg.num_mtp_modules if args.num_draft is None else args.num_draft
    if not 1 <= k <= cfg.num_mtp_modules:
        ap.error(f"--num-draft {k}: must be in [1, {cfg.num_mtp_modules}] (the model's MTP modules)")
    lengths = args.lengths
    prompts = _prompts(text, lengths, cfg.vocab_size, args.seed, model.tokenizer, args.prompts)
    spec_loops = args.spec_loops
    rows = []
    for setting in args.rows:
        gen = Generator(cfg, params, engine_options={"query_rows": 1 + k} if setting == "padded" else None)
        for n, prompt in zip(lengths, prompts):
            base = GenerationConfig(max_new_tokens=args.new, stop_token_ids=(), num_draft=args.num_draft,
                                    mtp_window=args.mtp_window)
            plain, tp = _timed(gen, prompt, base)
            spec, ts = _timed(gen, prompt, dataclasses.replace(base, speculative="mtp"))
            found = [_row(setting, n, plain, tp, spec, ts)]
            for loop in spec_loops:
                _, tl = _timed(gen, prompt, dataclasses.replace(base, decode_loop=loop))
                out, tsl = _timed(gen, prompt, dataclasses.replace(base, speculative="mtp", decode_loop=loop))
                found.append(dict(_row(f"{setting} spec loop {loop}", n, plain, tp, out, tsl),
                                  loop_tok_s=len(plain.sequences[0].tokens) / tl, speedup_vs_loop=tl / tsl))
            for row in found:
                print(json.dumps(row), flush=True)
            rows += found
    loops = args.decode_loops
    if loops:
        gen = Generator(cfg, params)
        for n, prompt in zip(lengths, prompts):
            base = GenerationConfig(max_new_tokens=args.new, stop_token_ids=())
            plain, tp = _timed(gen, prompt, base)
            for loop in loops:
                out, tl = _timed(gen, prompt, dataclasses.replace(base, decode_loop=loop))
                row = _row(f"loop {loop}", n, plain, tp, out, tl)
                print(json.dumps(row), flush=True)
                rows.append(row)
    with open(os.path.join(args.out, "spec_decode.json"), "w") as f:
        json.dump({"device": str(jax.devices()[0].device_kind), "checkpoint": where,
                   "mtp_modules": cfg.num_mtp_modules, "num_draft": k, "mtp_window": args.mtp_window, "prompts": args.prompts,
                   "rows": rows}, f,
                  indent=1)
    print(f"\n{'rows':22} {'prompt':>6} {'plain tok/s':>11} {'spec/loop tok/s':>15} {'speedup':>7} {'vs loop':>7} "
          f"{'accept':>6} {'first diff':>10}")
    for r in rows:
        vs = f"{r['speedup_vs_loop']:7.2f}" if "speedup_vs_loop" in r else f"{'-':>7}"
        print(f"{r['rows']:22} {r['prompt']:6d} {r['plain_tok_s']:11.1f} {r['spec_tok_s']:15.1f} {r['speedup']:7.2f} "
              f"{vs} {r['acceptance_rate'] or 0:6.2f} {str(r['first_difference']):>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
