"""Self-distillation data for MTP modules: the model's own greedy continuations of corpus prompts.

Speculative decoding accepts a draft when it equals the main model's greedy token *given the greedy tokens
before it*, so MTP modules learn best on text the model generated itself (the recipe of Medusa-2 / EAGLE
"self-distillation"): on such text every next token is the main model's greedy choice, inputs and targets
alike. Two steps around ``infer.py``::

    python -m minimax_jax.data.self_distill prompts --corpus 'data/corpus/train-*.jsonl' \\
        --tokenizer checkpoints/demo/tokenizer.json --num 2048 --out /tmp/sd/prompts.jsonl
    python infer.py --prompts_file /tmp/sd/prompts.jsonl --temperature 0 --max_new_tokens 512 \\
        --batch_size 256 --output /tmp/sd/generations.jsonl
    python -m minimax_jax.data.self_distill join --prompts /tmp/sd/prompts.jsonl \\
        --generations /tmp/sd/generations.jsonl --out data/self/train-00000.jsonl

then train with ``data.sources: [data/self/train-*.jsonl]`` (``configs/train/demo-mtp.yaml``, whose
``optim.mtp_targets: self`` also scores the prompt part against the model's greedy tokens).

``prompts``: ``num`` windows of whole tokens (length uniform in [min_tokens, max_tokens]) from documents of the
corpus (JSONL with a ``"text"`` field), seeded, decoded back to text; ``{"prompt", "id"}`` per line.
``join``: prompt text + generated text per record (matched by ``id``), ``{"text", "source": "self", "id"}`` per
line, the id ``<prompt id>-<sample>``. Both write atomically (a temporary file renamed into place) and refuse an existing output.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import sys

from minimax_jax.atomic_file import write_atomic
from minimax_jax.data.tokenizer import load_tokenizer

__all__ = ["sample_prompts", "join_generations"]


def _read_jsonl(path: str, cut_tail_ok: bool = False, need=()) -> list[dict]:
    """The JSON objects of a JSONL file, each with the keys ``need``. ``cut_tail_ok``: a last line that is not
    JSON and lacks its newline (a writer stopped mid-record, e.g. ``infer.py`` under ``timeout``) is dropped with
    a note instead of refused. Raises ValueError naming the file and line."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start})") from None
    rows = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if cut_tail_ok and n == len(lines):
                print(f"self_distill: {path}: dropped an unfinished last line", file=sys.stderr)
                continue
            raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{n}: not a JSON object")
        missing = [k for k in need if k not in row]
        if missing:
            raise ValueError(f"{path}:{n}: no {', '.join(repr(k) for k in missing)}")
        rows.append(row)
    return rows


def _check_out(path: str) -> None:
    """Refuse an output path that exists or whose folder cannot be made (before any work)."""
    if not path:
        raise ValueError("--out is empty; give a file path")
    if os.path.isdir(path):
        raise ValueError(f"--out {path} is a folder; give a file path")
    if os.path.exists(path):
        raise ValueError(f"--out {path} exists; remove it or choose another path")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"--out {path}: {parent} is a file, not a folder")


def _write_jsonl(path: str, rows: list[dict]) -> None:
    _check_out(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def _check_id(value, what: str):
    """``value`` if it is a string or an integer id, else ValueError naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"{what}: 'id' must be a string or an integer, got {type(value).__name__}")
    return value


def sample_prompts(corpus: list[str], tokenizer, num: int, min_tokens: int, max_tokens: int,
                   seed: int = 0) -> list[dict]:
    """``num`` prompts ``{"prompt": text, "id": "sd-<i>"}``: windows of whole tokens, lengths uniform in
    [min_tokens, max_tokens], from the documents of ``corpus`` (text strings) long enough to hold one.

    Raises: ValueError for bad counts or when no document holds ``min_tokens`` tokens.
    """
    if num < 1 or not 1 <= min_tokens <= max_tokens:
        raise ValueError(f"need num >= 1 and 1 <= min_tokens <= max_tokens, got {num}, {min_tokens}, {max_tokens}")
    if not corpus:
        raise ValueError("the corpus holds no document with a 'text' string")
    rng = random.Random(seed)
    docs = [ids for ids in (tokenizer.encode(t).ids for t in corpus) if len(ids) >= min_tokens]
    if not docs:
        raise ValueError(f"no corpus document has {min_tokens} tokens")
    out = []
    for i in range(num):
        ids = docs[rng.randrange(len(docs))]
        n = rng.randint(min_tokens, min(max_tokens, len(ids)))
        a = rng.randrange(len(ids) - n + 1)
        out.append({"prompt": tokenizer.decode(ids[a:a + n]), "id": f"sd-{i}"})
    return out


def join_generations(prompts: list[dict], generations: list[dict]) -> list[dict]:
    """Prompt + generated text per generation record (``infer.py --output``), matched by ``id``.

    Raises: ValueError naming an id with no prompt, a prompt id or (id, sample) given twice, a record without
    ``text``, or no record at all.
    """
    by_id = {}
    for p in prompts:
        pid = _check_id(p["id"], f"prompt {p['id']!r}")
        if not isinstance(p["prompt"], str):
            raise ValueError(f"prompt {pid!r}: 'prompt' must be a string, got {type(p['prompt']).__name__}")
        if pid in by_id:
            raise ValueError(f"prompt id {pid!r} appears twice")
        by_id[pid] = p["prompt"]
    out, seen = [], set()
    for g in generations:
        if "id" in g:
            _check_id(g["id"], f"generation record {g['id']!r}")
        if g.get("id") not in by_id:
            raise ValueError(f"generation record id {g.get('id')!r} matches no prompt")
        if not isinstance(g.get("text"), str):
            raise ValueError(f"generation record {g['id']!r} has no text")
        rid = f"{g['id']}-{g.get('sample', 0)}"
        if rid in seen:
            raise ValueError(f"generation record {g['id']!r} (sample {g.get('sample', 0)}) appears twice")
        seen.add(rid)
        out.append({"text": by_id[g["id"]] + g["text"], "source": "self", "id": rid})
    if not out:
        raise ValueError("no generation record to join (did the generator write any?)")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prompts", help="sample prompts from a corpus")
    p.add_argument("--corpus", required=True, help="JSONL file or glob, a 'text' string per line")
    p.add_argument("--tokenizer", required=True, help="tokenizer.json or its directory")
    p.add_argument("--num", type=int, default=2048, help="prompts to sample (default %(default)s)")
    p.add_argument("--min_tokens", type=int, default=128, help="shortest prompt in tokens (default %(default)s)")
    p.add_argument("--max_tokens", type=int, default=768, help="longest prompt in tokens (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default %(default)s)")
    p.add_argument("--out", required=True, help="prompts JSONL to write (infer.py --prompts_file); must not exist")
    j = sub.add_parser("join", help="prompt + generated text per record")
    j.add_argument("--prompts", required=True, help="the prompts JSONL of the 'prompts' step")
    j.add_argument("--generations", required=True, help="infer.py --output records")
    j.add_argument("--out", required=True, help="training JSONL to write ({'text': ...} per line); must not exist")
    a = ap.parse_args(argv)
    try:
        _check_out(a.out)
        if a.cmd == "prompts":
            files = sorted(glob.glob(a.corpus))
            if not files:
                raise ValueError(f"--corpus {a.corpus!r} matches no file")
            texts = [r["text"] for f in files for r in _read_jsonl(f) if isinstance(r.get("text"), str)]
            try:
                tok = load_tokenizer(a.tokenizer)
            except Exception as e:       # tokenizers raises a bare Exception for a file that is not a tokenizer
                raise ValueError(f"--tokenizer {a.tokenizer}: {str(e).splitlines()[0]}") from None
            rows = sample_prompts(texts, tok, a.num, a.min_tokens, a.max_tokens, a.seed)
        else:
            rows = join_generations(_read_jsonl(a.prompts, need=("prompt", "id")),
                                    _read_jsonl(a.generations, cut_tail_ok=True))
        _write_jsonl(a.out, rows)
    except (OSError, ValueError) as e:
        print(f"self_distill: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"cmd": a.cmd, "rows": len(rows), "out": a.out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
