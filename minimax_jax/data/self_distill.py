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
line. Both write atomically (a temporary file renamed into place) and refuse an existing output.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import sys

from minimax_jax.data.tokenizer import load_tokenizer

__all__ = ["sample_prompts", "join_generations"]


def _read_jsonl(path: str, cut_tail_ok: bool = False) -> list[dict]:
    """The JSON objects of a JSONL file. ``cut_tail_ok``: a last line without its newline (a writer stopped
    mid-record, e.g. ``infer.py`` under ``timeout``) is dropped with a note instead of refused."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    if cut_tail_ok and lines[-1].strip():
        print(f"self_distill: {path}: dropped an unfinished last line", file=sys.stderr)
        lines[-1] = ""
    rows = []
    for n, line in enumerate(lines, start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
    return rows


def _write_jsonl(path: str, rows: list[dict]) -> None:
    if os.path.exists(path):
        raise FileExistsError(f"{path} exists; remove it or choose another --out")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def sample_prompts(corpus: list[str], tokenizer, num: int, min_tokens: int, max_tokens: int,
                   seed: int = 0) -> list[dict]:
    """``num`` prompts ``{"prompt": text, "id": "sd-<i>"}``: windows of whole tokens, lengths uniform in
    [min_tokens, max_tokens], from the documents of ``corpus`` (text strings) long enough to hold one.

    Raises: ValueError for bad counts or when no document holds ``min_tokens`` tokens.
    """
    if num < 1 or not 1 <= min_tokens <= max_tokens:
        raise ValueError(f"need num >= 1 and 1 <= min_tokens <= max_tokens, got {num}, {min_tokens}, {max_tokens}")
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

    Raises: ValueError naming an id with no prompt, or a record without ``text``.
    """
    by_id = {p["id"]: p["prompt"] for p in prompts}
    out = []
    for g in generations:
        if g.get("id") not in by_id:
            raise ValueError(f"generation record id {g.get('id')!r} matches no prompt")
        if not isinstance(g.get("text"), str):
            raise ValueError(f"generation record {g['id']!r} has no text")
        out.append({"text": by_id[g["id"]] + g["text"], "source": "self", "id": f"{g['id']}-{g.get('sample', 0)}"})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prompts", help="sample prompts from a corpus")
    p.add_argument("--corpus", required=True, help="JSONL glob with a 'text' field per line")
    p.add_argument("--tokenizer", required=True, help="tokenizer.json or its directory")
    p.add_argument("--num", type=int, default=2048)
    p.add_argument("--min_tokens", type=int, default=128)
    p.add_argument("--max_tokens", type=int, default=768)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    j = sub.add_parser("join", help="prompt + generated text per record")
    j.add_argument("--prompts", required=True)
    j.add_argument("--generations", required=True, help="infer.py --output records")
    j.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "prompts":
            files = sorted(glob.glob(a.corpus))
            if not files:
                raise ValueError(f"--corpus {a.corpus!r} matches no file")
            texts = [r["text"] for f in files for r in _read_jsonl(f) if isinstance(r.get("text"), str)]
            rows = sample_prompts(texts, load_tokenizer(a.tokenizer), a.num, a.min_tokens, a.max_tokens, a.seed)
        else:
            rows = join_generations(_read_jsonl(a.prompts), _read_jsonl(a.generations, cut_tail_ok=True))
        _write_jsonl(a.out, rows)
    except (OSError, ValueError) as e:
        print(f"self_distill: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"cmd": a.cmd, "rows": len(rows), "out": a.out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
