"""Training data for the loop: the grain pipeline, a grain-free synthetic stream or prefix-tree packed
agent trajectories, as global arrays.

The iterators yield per-host numpy batches ``{tokens, targets, segment_ids, positions, loss_mask}``
``[batch_size / process_count, seq_len]`` (``minimax_jax.data.pipeline`` layout; trajectory batches add
``subtree_end`` and ``loss_index``, ``minimax_jax.data.prefix_tree``) and have
``get_state()`` / ``set_state(state)`` so a checkpoint restores the exact next batch.
``to_global`` turns a per-host batch into global ``jax.Array`` s with the batch sharding.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from minimax_jax.train.config import DataSection

__all__ = ["SyntheticIterator", "make_iterator", "to_global", "encode_state", "decode_state"]


class SyntheticIterator:
    """Random tokens packed into rows of random-length documents (deterministic in (seed, index)).

    Rows follow the pipeline layout: segment ids are 1-based per row, positions restart at 0 in each
    document, ``loss_mask`` is 0 on a document's last token (its target is the next document's).
    """

    def __init__(self, seq_len: int, batch_size: int, vocab_size: int, seed: int = 0, mean_doc_len: int = 0,
                 shard_index: int = 0, shard_count: int = 1):
        if batch_size % shard_count:
            raise ValueError(f"batch_size {batch_size} is not divisible by the process count {shard_count}")
        self.seq_len, self.vocab_size, self.seed = seq_len, vocab_size, seed
        self.mean_doc_len = mean_doc_len or max(seq_len // 2, 1)
        self.local = batch_size // shard_count
        self.shard_index = shard_index
        self.index = 0

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, self.index, self.shard_index])
        self.index += 1
        b, L = self.local, self.seq_len
        toks = rng.integers(0, self.vocab_size, size=(b, L + 1), dtype=np.int32)
        seg = np.zeros((b, L + 1), np.int32)
        pos = np.zeros((b, L + 1), np.int32)
        for r in range(b):
            start, doc = 0, 1
            while start < L + 1:
                n = int(min(rng.geometric(1.0 / self.mean_doc_len), L + 1 - start))
                seg[r, start:start + n] = doc
                pos[r, start:start + n] = np.arange(n)
                start, doc = start + n, doc + 1
        mask = (seg[:, 1:] == seg[:, :-1]).astype(np.float32)
        return {"tokens": toks[:, :-1], "targets": toks[:, 1:], "segment_ids": seg[:, :-1],
                "positions": pos[:, :-1], "loss_mask": mask}

    def get_state(self) -> dict[str, Any]:
        return {"index": self.index}

    def set_state(self, state: dict[str, Any]) -> None:
        self.index = int(state["index"])


def make_iterator(data: DataSection, vocab_size: int, *, sources: tuple[str, ...] | None = None,
                  eval_mode: bool = False):
    """The per-host iterator for ``data`` (``sources`` overrides the paths, e.g. for evaluation)."""
    if data.kind == "synthetic":
        f = data.fields
        seed = int(f.get("seed", 0)) + (1_000_003 if eval_mode else 0)
        return SyntheticIterator(int(f["seq_len"]), int(f["batch_size"]), vocab_size, seed,
                                 int(f.get("mean_doc_len", 0)), jax.process_index(), jax.process_count())
    if data.kind == "trajectory":
        return _trajectory_iterator(data, sources, eval_mode, vocab_size)
    from minimax_jax.data.pipeline import DataConfig, make_train_iterator

    fields = dict(data.fields)
    if sources is not None:
        fields["sources"] = tuple(sources)
    if eval_mode:
        fields.update(shuffle=False, num_epochs=None)
    return make_train_iterator(DataConfig.from_dict(fields))


def _trajectory_iterator(data: DataSection, sources, eval_mode: bool, vocab_size: int):
    import functools

    from minimax_jax.chat import render_chat
    from minimax_jax.data.trajectories import TrajectoryConfig, TrajectoryIterator

    fields = dict(data.fields)
    if sources is not None:
        fields["sources"] = tuple(sources)
    if eval_mode:
        fields["num_epochs"] = None
    render = functools.partial(render_chat, add_generation_prompt=False)     # render(messages, tools)
    return TrajectoryIterator(TrajectoryConfig.from_dict(fields), render=render, vocab_size=vocab_size)


def to_global(batch: dict[str, np.ndarray], sharding: jax.sharding.Sharding) -> dict[str, jax.Array]:
    """Per-host numpy batch -> global arrays sharded by ``sharding`` (rows split over processes)."""
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in batch.items()}


def encode_state(x: Any) -> Any:
    """JSON-safe copy of an iterator state (bytes as hex, tuples and numpy ints preserved)."""
    if isinstance(x, dict):
        return {str(k): encode_state(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return {"__tuple__": [encode_state(v) for v in x]}
    if isinstance(x, list):
        return [encode_state(v) for v in x]
    if isinstance(x, bytes):
        return {"__bytes__": x.hex()}
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    if dataclasses.is_dataclass(x):
        raise TypeError(f"cannot encode iterator state of type {type(x).__name__}")
    return x


def decode_state(x: Any) -> Any:
    """Inverse of ``encode_state``."""
    if isinstance(x, dict):
        if set(x) == {"__tuple__"}:
            return tuple(decode_state(v) for v in x["__tuple__"])
        if set(x) == {"__bytes__"}:
            return bytes.fromhex(x["__bytes__"])
        return {k: decode_state(v) for k, v in x.items()}
    if isinstance(x, list):
        return [decode_state(v) for v in x]
    return x
