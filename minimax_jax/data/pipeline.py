"""grain input pipeline: text documents -> tokens -> packed rows -> per-host batches.

Stages (all grain datasets, so the iterator state is checkpointable and resumable):

1. ``grain.MapDataset.source(DocumentSource)``: one document per file / JSONL line / record.
2. ``shuffle(seed)`` (a fresh order every epoch), ``repeat(num_epochs)``, then per-host slicing
   ``[shard_index::shard_count]`` so hosts read disjoint documents.
3. tokenisation with a ``tokenizers`` tokenizer (+ optional bos / eos ids around each document),
   ``tokenize_batch`` documents per ``encode_batch`` call.
4. packing into rows of ``seq_len + 1`` tokens, with grain's packers:
   - ``packing="concat"``: ``ConcatThenSplitIterDataset``, no padding except at the very end of a
     finite stream; documents may be cut across rows (each piece restarts at position 0);
   - ``packing="first_fit"``: documents longer than ``seq_len + 1`` are first cut into pieces of
     ``seq_len + 1``, then ``FirstFitPackIterDataset`` places whole pieces into padded rows (no
     document shorter than a row is ever cut: best for retrieval-style documents).
5. each row becomes inputs/targets (``tokens = row[:-1]``, ``targets = row[1:]``) and rows are
   batched to ``[batch_size // shard_count, seq_len]``.

Batch layout (numpy arrays)::

    tokens      int32 [b, L]   input ids
    targets     int32 [b, L]   next-token ids
    segment_ids int32 [b, L]   1-based document index within the row, 0 = padding
    positions   int32 [b, L]   position within the document (piece), restarting at 0
    loss_mask   f32   [b, L]   1 where the target belongs to the same document as the input,
                               0 on padding and where the target is the next document's first token

Resuming: ``it.get_state()`` / ``it.set_state(state)`` (or :func:`save_iterator_state` /
:func:`restore_iterator_state`, JSON on disk) reproduce exactly the same next batches. grain's orbax
handler (``grain.checkpoint.CheckpointSave``/``CheckpointRestore``) works on the same iterator.

Multi-host note: with a finite ``num_epochs`` hosts may hold different numbers of batches (documents
differ in length); train with ``num_epochs=None`` (repeat) and let the trainer count steps.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import grain
import grain.experimental as gex
import numpy as np

from minimax_jax.data.sources import DocumentSource
from minimax_jax.data.tokenizer import BOS, EOS, load_tokenizer

PACKING_MODES = ("concat", "first_fit")
MAX_TOKENIZE_BATCH = 1 << 16


class DataConfigError(ValueError):
    """Invalid DataConfig field (the message names it)."""


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Input pipeline settings.

    Attributes:
      sources: files, directories, globs, JSONL or array_record paths.
      tokenizer: ``tokenizer.json`` or a directory holding it.
      seq_len: tokens per training row (the row packs ``seq_len + 1`` tokens).
      batch_size: GLOBAL batch size (rows); each host gets ``batch_size // shard_count``.
      seed: shuffling / packing seed.
      shuffle: shuffle documents (a new order each epoch).
      num_epochs: passes over the data; ``None`` repeats forever.
      field: JSON field holding the text in JSONL / JSON records.
      packing: ``"concat"`` or ``"first_fit"`` (see module docstring).
      num_packing_bins: bins for first-fit packing (0 = 4 x per-host batch).
      add_bos, add_eos: wrap each document in the tokenizer's ``]~!b[`` / ``[e~[`` ids.
      shard_index, shard_count: this host's shard; ``None`` = ``jax.process_index()/process_count()``.
      num_threads: grain read threads for loading + tokenising (0 = in the calling thread).
      prefetch: grain read-ahead buffer (elements) when ``num_threads > 0``.
      tokenize_batch: documents per ``encode_batch`` call (tokenizers parallelises a batch over
        its own threads, ``RAYON_NUM_THREADS``); 1 = one ``encode`` per document. The packed
        stream does not depend on it.
    """

    sources: tuple[str, ...]
    tokenizer: str
    seq_len: int
    batch_size: int
    seed: int = 0
    shuffle: bool = True
    num_epochs: int | None = 1
    field: str = "text"
    packing: str = "concat"
    num_packing_bins: int = 0
    add_bos: bool = True
    add_eos: bool = True
    shard_index: int | None = None
    shard_count: int | None = None
    num_threads: int = 0
    prefetch: int = 64
    tokenize_batch: int = 16

    def __post_init__(self):
        if isinstance(self.sources, (str, os.PathLike)):
            object.__setattr__(self, "sources", (os.fspath(self.sources),))
        else:
            object.__setattr__(self, "sources", tuple(os.fspath(s) for s in self.sources))
        if not self.sources:
            raise DataConfigError("sources: at least one path is needed")
        for name in ("seq_len", "batch_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise DataConfigError(f"{name} must be a positive int, got {v!r}")
        if self.num_epochs is not None and (not isinstance(self.num_epochs, int) or self.num_epochs < 1):
            raise DataConfigError(f"num_epochs must be a positive int or None, got {self.num_epochs!r}")
        if self.packing not in PACKING_MODES:
            raise DataConfigError(f"packing must be one of {PACKING_MODES}, got {self.packing!r}")
        if min(self.num_packing_bins, self.num_threads) < 0 or min(self.prefetch, self.tokenize_batch) < 1:
            raise DataConfigError(
                "num_packing_bins and num_threads must be >= 0, prefetch and tokenize_batch >= 1"
            )
        if self.tokenize_batch > MAX_TOKENIZE_BATCH:
            raise DataConfigError(
                f"tokenize_batch must be <= {MAX_TOKENIZE_BATCH}, got {self.tokenize_batch}"
            )
        if (self.shard_index is None) != (self.shard_count is None):
            raise DataConfigError("give both shard_index and shard_count, or neither")
        if self.shard_count is not None and not 0 <= self.shard_index < self.shard_count:
            raise DataConfigError(
                f"shard_index must be in [0, shard_count), got {self.shard_index} of {self.shard_count}"
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DataConfig":
        """Builds a DataConfig from a dict; unknown keys raise DataConfigError naming them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise DataConfigError(f"unknown DataConfig keys: {unknown}")
        return cls(**d)

    def shard(self) -> tuple[int, int]:
        """(shard_index, shard_count), defaulting to jax's process index / count."""
        if self.shard_count is not None:
            return self.shard_index, self.shard_count
        import jax

        return jax.process_index(), jax.process_count()


class _TokenizeBatch(grain.transforms.Map):
    """Tokenises a list of documents with one ``encode_batch`` call (parallel inside tokenizers)."""

    def __init__(self, tokenizer, bos_id: int | None, eos_id: int | None):
        self._tok = tokenizer
        self._bos = [] if bos_id is None else [bos_id]
        self._eos = [] if eos_id is None else [eos_id]

    def map(self, texts: list[str]) -> list[dict[str, np.ndarray]]:
        if len(texts) == 1:
            encs = [self._tok.encode(texts[0], add_special_tokens=False)]
        else:
            encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [{"tokens": np.asarray(self._bos + e.ids + self._eos, dtype=np.int32)} for e in encs]


class _Unbatch(gex.FlatMapTransform):
    """Splits a tokenised group back into single documents."""

    max_fan_out = MAX_TOKENIZE_BATCH

    def flat_map(self, element):
        return element


class _Chunk(gex.FlatMapTransform):
    """Cuts a tokenised document into pieces of at most ``row_len`` tokens (first-fit packing)."""

    max_fan_out = 1 << 30

    def __init__(self, row_len: int):
        self._row_len = row_len

    def flat_map(self, element):
        toks = element["tokens"]
        return [{"tokens": toks[i : i + self._row_len]} for i in range(0, len(toks), self._row_len)]


def rows_to_example(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Turns one packed row of ``L + 1`` tokens into the training example fields.

    Args:
      row: ``tokens``, ``tokens_segment_ids``, ``tokens_positions``: int arrays ``[L + 1]``.
    Returns:
      dict of ``tokens``, ``targets``, ``segment_ids``, ``positions`` (int32 ``[L]``) and
      ``loss_mask`` (float32 ``[L]``), see the module docstring.
    """
    toks = np.asarray(row["tokens"], np.int32)
    seg = np.asarray(row["tokens_segment_ids"], np.int32)
    pos = np.asarray(row["tokens_positions"], np.int32)
    mask = (seg[1:] == seg[:-1]) & (seg[:-1] != 0)
    return {
        "tokens": toks[:-1],
        "targets": toks[1:],
        "segment_ids": seg[:-1],
        "positions": pos[:-1],
        "loss_mask": mask.astype(np.float32),
    }


def _special_id(tok, token: str) -> int:
    tid = tok.token_to_id(token)
    if tid is None:
        raise DataConfigError(
            f"the tokenizer has no {token!r} token; set add_bos/add_eos=False or use a tokenizer "
            "trained by minimax_jax.data.tokenizer"
        )
    return tid


def make_packed_dataset(config: DataConfig, tokenizer=None) -> grain.IterDataset:
    """Builds the per-host stream of packed rows (before batching).

    Each element is ``{"tokens", "tokens_segment_ids", "tokens_positions"}``, int32 ``[seq_len+1]``.
    ``tokenizer`` overrides ``config.tokenizer`` (a ``tokenizers.Tokenizer``).
    """
    tok = load_tokenizer(config.tokenizer) if tokenizer is None else tokenizer
    bos = _special_id(tok, BOS) if config.add_bos else None
    eos = _special_id(tok, EOS) if config.add_eos else None
    shard_index, shard_count = config.shard()
    source = DocumentSource(config.sources, field=config.field)
    if len(source) == 0:
        raise DataConfigError(f"sources {config.sources} hold no documents")
    ds = grain.MapDataset.source(source)
    if config.shuffle:
        ds = ds.shuffle(seed=config.seed)
    ds = ds.repeat(config.num_epochs)
    if shard_count > 1:
        ds = ds[shard_index::shard_count]
    ds = ds.batch(config.tokenize_batch, batch_fn=list).map(_TokenizeBatch(tok, bos, eos))
    if config.num_threads > 0:
        read = grain.ReadOptions(num_threads=config.num_threads, prefetch_buffer_size=config.prefetch)
    else:
        read = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    it = gex.FlatMapIterDataset(ds.to_iter_dataset(read), _Unbatch())
    row_len = config.seq_len + 1
    if config.packing == "concat":
        return gex.ConcatThenSplitIterDataset(it, length_struct={"tokens": row_len})
    per_host = config.batch_size // shard_count
    bins = config.num_packing_bins or max(4 * per_host, 1)
    it = gex.FlatMapIterDataset(it, _Chunk(row_len))
    return gex.FirstFitPackIterDataset(
        it, length_struct={"tokens": row_len}, num_packing_bins=bins, seed=config.seed,
        shuffle_bins=config.shuffle,
    )


def make_dataset(config: DataConfig, tokenizer=None) -> grain.IterDataset:
    """The per-host batched dataset; iterate it (``iter(ds)``) for checkpointable batches.

    Raises:
      DataConfigError: when ``batch_size`` is not divisible by the shard count, or bad fields.
    """
    _, shard_count = config.shard()
    if config.batch_size % shard_count:
        raise DataConfigError(
            f"batch_size={config.batch_size} (global) is not divisible by shard_count={shard_count}"
        )
    ds = make_packed_dataset(config, tokenizer).map(rows_to_example)
    return ds.batch(config.batch_size // shard_count, drop_remainder=True)


def make_train_iterator(config: DataConfig, tokenizer=None) -> grain.DatasetIterator:
    """Returns a checkpointable iterator of batches (see module docstring for the layout).

    ``it.get_state()`` / ``it.set_state(state)`` save and restore the position exactly.
    """
    return iter(make_dataset(config, tokenizer))


def _to_jsonable(x):
    if isinstance(x, dict):
        return {k: _to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return {"__tuple__": [_to_jsonable(v) for v in x]} if isinstance(x, tuple) else [
            _to_jsonable(v) for v in x
        ]
    if isinstance(x, bytes):
        return {"__bytes__": x.hex()}
    if isinstance(x, np.integer):
        return int(x)
    return x


def _from_jsonable(x):
    if isinstance(x, dict):
        if set(x) == {"__tuple__"}:
            return tuple(_from_jsonable(v) for v in x["__tuple__"])
        if set(x) == {"__bytes__"}:
            return bytes.fromhex(x["__bytes__"])
        return {k: _from_jsonable(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_from_jsonable(v) for v in x]
    return x


def save_iterator_state(iterator: grain.DatasetIterator, path: str) -> None:
    """Writes ``iterator.get_state()`` to ``path`` as JSON (tuples and bytes preserved)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(_to_jsonable(iterator.get_state()), f)


def restore_iterator_state(iterator: grain.DatasetIterator, path: str) -> None:
    """Restores a state written by :func:`save_iterator_state` into a fresh iterator built from the
    same DataConfig.

    Raises:
      FileNotFoundError: naming ``path``.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no iterator state file at {path!r}")
    with open(path) as f:
        iterator.set_state(_from_jsonable(json.load(f)))


def iterate_batches(config: DataConfig, num_batches: int, tokenizer=None) -> list[dict[str, np.ndarray]]:
    """Convenience for tests and inspection: the first ``num_batches`` batches (fewer if exhausted)."""
    out = []
    for batch in make_train_iterator(config, tokenizer):
        out.append(batch)
        if len(out) >= num_batches:
            break
    return out


__all__: Sequence[str] = (
    "DataConfig", "DataConfigError", "make_dataset", "make_packed_dataset", "make_train_iterator",
    "rows_to_example", "save_iterator_state", "restore_iterator_state", "iterate_batches",
)
