"""Train and load byte-level BPE tokenizers (HF ``tokenizers``) carrying the MiniMax special tokens.

The real MiniMax-M2 tokenizer (200,064 ids, special tokens at ids 200000..200053, see
/work/shared/docs/MODEL_FACTS.md section 1) is only on the model hub. For small models trained
from scratch this module trains a compatible *kind* of tokenizer:

- byte-level BPE (every byte is in the initial alphabet, so any UTF-8 text round-trips);
- pre-tokenisation by the GPT-2 style regex of ``tokenizers.pre_tokenizers.ByteLevel`` (the real
  tokenizer uses an o200k-like regex; ids and merges are NOT compatible with it); optionally every
  digit is split into its own piece first (``split_digits``, as LLaMA's tokenizer does). Off by
  default: the three-way run 2 used it and its models never learned to copy a passkey, and in a CPU
  comparison (tiny model, retrieval-only data, ~1.4M tokens) only the tokenizer WITHOUT digit
  splitting started to copy (first answer token loss 2.72 -> 0.04), while one token per digit
  stayed at the guessing loss ln 10 (RESULTS.md);
- the MiniMax special tokens as *added special tokens* that are never split.

Id choice: the special tokens take the FIRST ids, 0..8, in the order of :data:`SPECIAL_TOKENS`
(pad first, so pad id == 0 matches the pipeline's zero padding). Their ids therefore differ from the
real tokenizer; use :func:`special_token_ids` to put bos/eos/pad ids into a ModelConfig.

CLI::

    python -m minimax_jax.data.tokenizer train --input DIR_OR_GLOB [...] --vocab_size 8192 --out DIR [--overwrite]

It writes ``DIR/tokenizer.json`` atomically; an existing one is replaced only with ``--overwrite`` (exit status 2
and one line otherwise, checked before training).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from minimax_jax.atomic_file import write_atomic
from minimax_jax.data.sources import DocumentSource

PAD = "]!p~["
BOS = "]~!b["
EOS = "[e~["
ROLE_START = "]~b]"
ROLE_END_D = "]!d~["
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_CALL_OPEN = "<minimax:tool_call>"
TOOL_CALL_CLOSE = "</minimax:tool_call>"

#: MiniMax special tokens, in the id order this module assigns (ids 0..8).
SPECIAL_TOKENS: tuple[str, ...] = (
    PAD, BOS, EOS, ROLE_START, ROLE_END_D, THINK_OPEN, THINK_CLOSE, TOOL_CALL_OPEN, TOOL_CALL_CLOSE,
)

TOKENIZER_FILE = "tokenizer.json"
_BYTE_ALPHABET = 256


class TokenizerError(ValueError):
    """A tokenizer cannot be trained or loaded as asked."""


def _empty_bpe(split_digits: bool = False) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if split_digits else byte_level)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def train_tokenizer(
    texts: Iterator[str] | Sequence[str],
    vocab_size: int,
    *,
    min_frequency: int = 2,
    length: int | None = None,
    split_digits: bool = False,
) -> Tokenizer:
    """Trains a byte-level BPE tokenizer on an iterable of texts.

    Args:
      texts: documents (str).
      vocab_size: final vocabulary size including the 256 byte symbols and the
        ``len(SPECIAL_TOKENS)`` special tokens; must be >= 256 + 9.
      min_frequency: minimum pair count for a merge.
      length: number of texts, only for the progress display.
      split_digits: one pre-token per digit (module docstring).
    Returns:
      A ``tokenizers.Tokenizer``; special tokens have ids 0..8 (see module docstring).
    Raises:
      TokenizerError: vocab_size too small.
    """
    minimum = _BYTE_ALPHABET + len(SPECIAL_TOKENS)
    if vocab_size < minimum:
        raise TokenizerError(
            f"vocab_size={vocab_size} is too small: need at least {minimum} "
            f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens)"
        )
    tok = _empty_bpe(split_digits)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    check_special_tokens(tok)
    return tok


def train_tokenizer_from_paths(
    inputs: Sequence[str], vocab_size: int, *, field: str = "text", min_frequency: int = 2,
    max_chars: int | None = None, split_digits: bool = False,
) -> Tokenizer:
    """Trains on files / directories / globs / JSONL (``field``), optionally capped at ``max_chars``
    (documents in source order: build the corpus shuffled, as :mod:`minimax_jax.data.corpus` does).

    Raises:
      SourceError (from :mod:`minimax_jax.data.sources`) for bad inputs, TokenizerError as above.
    """
    src = DocumentSource(inputs, field=field)

    def gen():
        used = 0
        for i in range(len(src)):
            text = src[i]
            if max_chars is not None:
                if used >= max_chars:
                    return
                text = text[: max_chars - used]
            used += len(text)
            yield text

    return train_tokenizer(gen(), vocab_size, min_frequency=min_frequency, length=len(src),
                           split_digits=split_digits)


def check_special_tokens(tok: Tokenizer) -> dict[str, int]:
    """Checks that every MiniMax special token encodes to exactly one id; returns token -> id.

    Raises:
      TokenizerError: naming the special token that is missing or split.
    """
    ids = {}
    for s in SPECIAL_TOKENS:
        tid = tok.token_to_id(s)
        if tid is None:
            raise TokenizerError(f"tokenizer has no special token {s!r}")
        enc = tok.encode(s, add_special_tokens=False).ids
        if enc != [tid]:
            raise TokenizerError(f"special token {s!r} encodes to {enc}, expected the single id {tid}")
        ids[s] = tid
    return ids


def special_token_ids(tok: Tokenizer) -> dict[str, int]:
    """Returns ``{"pad_token_id", "bos_token_id", "eos_token_id"}`` for a ModelConfig.

    Raises:
      TokenizerError: when a special token is missing.
    """
    ids = check_special_tokens(tok)
    return {"pad_token_id": ids[PAD], "bos_token_id": ids[BOS], "eos_token_id": ids[EOS]}


def write_tokenizer(tok: Tokenizer, path: str, *, overwrite: bool = False) -> str:
    """Writes ``tok`` to the file ``path`` atomically (temporary sibling + rename; parent folders created);
    returns ``path``. Raises FileExistsError for an existing ``path`` without ``overwrite``."""
    if os.path.lexists(path) and not overwrite:
        raise FileExistsError(f"{path!r} already exists; pass --overwrite to replace it, or choose another path")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    write_atomic(path, tok.to_str(pretty=True))
    return path


def save_tokenizer(tok: Tokenizer, out_dir: str, *, overwrite: bool = True) -> str:
    """Writes ``out_dir/tokenizer.json`` (creating the directory; atomically, see ``write_tokenizer``); returns
    the file path. ``overwrite=False``: FileExistsError when the file exists."""
    return write_tokenizer(tok, os.path.join(out_dir, TOKENIZER_FILE), overwrite=overwrite)


def load_tokenizer(dir_or_file: str) -> Tokenizer:
    """Loads a ``tokenizers`` tokenizer from a ``tokenizer.json`` file or a directory holding one.

    Raises:
      FileNotFoundError: naming the exact file looked for.
      ValueError: the file is not a ``tokenizers`` JSON file (naming it).
    """
    path = os.fspath(dir_or_file)
    if os.path.isdir(path):
        path = os.path.join(path, TOKENIZER_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"no tokenizer file at {path!r} (looked for {TOKENIZER_FILE} in the directory, or the "
            f"file itself); train one with `python -m minimax_jax.data.tokenizer train`"
        )
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for a file it cannot parse
        raise ValueError(f"{path} is not a tokenizers JSON file ({e})") from None


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m minimax_jax.data.tokenizer")
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a byte-level BPE tokenizer")
    t.add_argument("--input", nargs="+", required=True, help="files, directories, globs or JSONL")
    t.add_argument("--vocab_size", type=int, required=True)
    t.add_argument("--out", required=True, help="output directory (tokenizer.json is written there)")
    t.add_argument("--overwrite", action="store_true", help="replace an existing tokenizer.json in --out")
    t.add_argument("--field", default="text", help="JSON field of JSONL inputs")
    t.add_argument("--min_frequency", type=int, default=2)
    t.add_argument("--max_chars", type=int, default=None, help="stop reading after this many chars")
    t.add_argument("--split_digits", action="store_true",
                   help="make every digit its own token (default: BPE merges digits like other text)")
    args = parser.parse_args(argv)
    path = os.path.join(args.out, TOKENIZER_FILE)
    try:
        if os.path.exists(args.out) and not os.path.isdir(args.out):
            raise NotADirectoryError(f"--out {args.out!r} is a file; give the folder to write {TOKENIZER_FILE} in")
        if not os.path.exists(args.out) and args.out.endswith(".json"):     # would become a folder of that name
            raise ValueError(f"--out {args.out!r} names a file; give the folder to write {TOKENIZER_FILE} in "
                             f"(e.g. {os.path.dirname(args.out) or '.'!r})")
        if os.path.lexists(path) and not args.overwrite:     # before the training, which can take minutes
            raise FileExistsError(f"--out {args.out!r} already holds {TOKENIZER_FILE}; pass --overwrite to replace "
                                  "it, or choose another folder")
        tok = train_tokenizer_from_paths(
            args.input, args.vocab_size, field=args.field, min_frequency=args.min_frequency,
            max_chars=args.max_chars, split_digits=args.split_digits,
        )
        path = save_tokenizer(tok, args.out, overwrite=args.overwrite)
    except (OSError, ValueError) as e:      # bad inputs (SourceError), a vocabulary too small, the destination
        print(f"{parser.prog} train: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}: vocab {tok.get_vocab_size()}, special ids {special_token_ids(tok)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
