"""Build the offline corpus and tokenizer a training config points at, when they are missing.

``train.py`` without ``--config`` trains ``configs/train/demo.yaml``, whose data section names
``data/corpus/train-*.jsonl`` and ``data/tokenizer/tokenizer.json``. ``prepare_data`` makes them:

- sources that match no file: ``minimax_jax.data.corpus.build_corpus`` writes the corpus into the
  directory of the first source pattern (Shakespeare, stdlib code, synthetic retrieval documents;
  ``heldout.jsonl`` beside it), only when that directory is new or empty: sources that match nothing
  in a folder with files are a mistyped ``data.sources`` (TrainConfigError, nothing written), never
  a place to write a corpus into;
- a missing tokenizer: a byte-level BPE tokenizer with the model's vocabulary size (one token per
  digit) is trained on the (now existing) sources and saved at exactly the path the config names
  (``data.tokenizer``: a ``.json`` file, or a folder that gets ``tokenizer.json``), never over an existing file.

Only single-process runs prepare data (a multi-host run must find it ready on shared storage).
"""

from __future__ import annotations

import fnmatch
import os

from minimax_jax.train.config import TrainConfig, TrainConfigError

__all__ = ["missing_data", "prepare_data", "corpus_destination_problem"]


def _resolves(paths) -> bool:
    from minimax_jax.data.sources import SourceError, resolve_paths

    try:
        return bool(resolve_paths(list(paths)))
    except SourceError:
        return False


def missing_data(tc: TrainConfig) -> list[str]:
    """What of ``tc.data`` (kind grain) does not exist yet: ``"sources <patterns>"`` and/or
    ``"tokenizer <path>"``; empty when everything is there or the data is not file-based."""
    if tc.data.kind != "grain":
        return []
    f = tc.data.fields
    out = []
    sources = list(f.get("sources") or [])
    if not _resolves(sources):
        out.append(f"sources {sources}" + _relative_note(sources))
    tok = f.get("tokenizer")
    if not tok or not os.path.exists(tok):
        out.append(f"tokenizer {tok}" + _relative_note([tok] if tok else []))
    return out


def _relative_note(paths: list[str]) -> str:
    """Where relative data paths are read from (the current directory, not the config's folder)."""
    return f" (relative to the current directory {os.getcwd()})" if any(not os.path.isabs(p) for p in paths) else ""


TOKENIZER_MAX_CHARS = 40_000_000


def corpus_destination_problem(sources: list[str]) -> str | None:
    """Why ``prepare_data`` would not build the corpus of ``sources`` (glob patterns; the first one's folder is the
    destination): it builds train-NNNNN.jsonl files, only into a new or empty folder. None when it would."""
    out = (os.path.dirname(sources[0]) or ".") if sources else "."
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        return (f"--prepare_data builds a corpus only into a new or empty folder, but {out!r} holds files: fix "
                f"data.sources, or build the corpus yourself (python -m minimax_jax.data.corpus --out DIR)")
    if sources and not fnmatch.fnmatch("train-00000.jsonl", os.path.basename(sources[0])):
        return (f"--prepare_data builds a corpus of train-NNNNN.jsonl files, which {sources[0]!r} would not read: "
                f"set data.sources to {os.path.join(out, 'train-*.jsonl')!r}, or build your data yourself")
    if sources and fnmatch.fnmatch("heldout.jsonl", os.path.basename(sources[0])):
        return (f"--prepare_data writes the corpus's held-out text to heldout.jsonl, which {sources[0]!r} would "
                f"train on: set data.sources to {os.path.join(out, 'train-*.jsonl')!r}")
    return None


def prepare_data(tc: TrainConfig, vocab_size: int, *, max_mb: float = 64.0, log=print) -> list[str]:
    """Create missing corpus / tokenizer files for ``tc.data`` (kind grain). Returns what was made.

    Raises TrainConfigError when preparation is impossible (multi-process run, no source pattern).
    """
    if tc.data.kind != "grain":
        return []
    import jax

    f = tc.data.fields
    sources = list(f.get("sources") or [])
    tok = f.get("tokenizer")
    missing_src = not _resolves(sources)
    missing_tok = not tok or not os.path.exists(tok)
    if not (missing_src or missing_tok):
        return []
    if jax.process_count() > 1:
        raise TrainConfigError("data is missing and a multi-process run does not build it; prepare the corpus and "
                               "tokenizer first (python -m minimax_jax.data.corpus / .tokenizer)")
    if not sources:
        raise TrainConfigError("data.sources is empty: nothing to prepare")
    made = []
    if missing_tok:
        from minimax_jax.data.tokenizer import TOKENIZER_FILE

        if not tok:
            raise TrainConfigError("data.tokenizer is not set")
        tok_file = tok if tok.endswith(".json") else os.path.join(tok, TOKENIZER_FILE)
        if os.path.lexists(tok_file):
            raise TrainConfigError(f"data.tokenizer {tok!r}: {tok_file!r} is a broken link; --prepare_data does not "
                                   "replace it")
    if missing_src:
        from minimax_jax.data.corpus import DEFAULT_SYNTHETIC_MAX_CHARS, build_corpus

        out = os.path.dirname(sources[0]) or "."
        problem = corpus_destination_problem(sources)
        if problem:
            raise TrainConfigError(f"data.sources {sources} match no file, and {problem}")
        log(f"prepare_data: building the offline corpus in {out} ({max_mb} MB of text)")
        # a retrieval document longer than a training row would be cut between its needle and its
        # question; ~3 characters per token of the 4K-vocabulary BPE keeps each one inside a row
        max_chars = min(DEFAULT_SYNTHETIC_MAX_CHARS, 3 * int(tc.data.seq_len))
        build_corpus(out, max_mb=max_mb, seed=int(f.get("seed", 0)), workers=min(16, os.cpu_count() or 1),
                     synthetic_max_chars=max(max_chars, 600))
        if not _resolves(sources):
            raise TrainConfigError(f"the corpus built in {out} does not match data.sources {sources}")
        made.append(out)
    if missing_tok:
        from minimax_jax.data.tokenizer import train_tokenizer_from_paths, write_tokenizer

        log(f"prepare_data: training a {vocab_size}-token BPE tokenizer into {tok_file}")
        # BPE merges settle long before 40M characters; the cap bounds the time on big corpora.
        # One token per digit: the retrieval answers are numbers, and copying them then needs the 10
        # digit tokens only (with merged digits a 4K vocabulary holds ~1,000 rare 2-3 digit tokens,
        # each of which a small model must learn to copy separately; RESULTS.md, run 4).
        made.append(write_tokenizer(train_tokenizer_from_paths(sources, vocab_size, field=f.get("field", "text"),
                                                               max_chars=TOKENIZER_MAX_CHARS, split_digits=True),
                                    tok_file))
    return made
