"""Agent-trajectory source: JSONL of chat conversations or of token ids, packed per step by the prefix tree.

Each non-empty line of a ``.jsonl`` source is one trajectory, either

- ``{"messages": [...], "tools": [...]?}``: an OpenAI-style conversation (system, user, assistant with
  ``reasoning_content`` / ``tool_calls``, tool results), rendered with the MiniMax chat template (a
  ``render(messages, tools) -> str`` callable the caller passes, e.g. ``minimax_jax.chat.render_chat``
  without the generation prompt) and tokenised; with ``loss_on: assistant`` the trained tokens are
  those of every assistant turn after its ``]~b]ai\\n`` header, its closing ``[e~[`` included;
- ``{"tokens": [ids], "loss_mask": [0/1 per token]?}``: token ids (ints in ``[0, vocab_size)``; mask default: all
  ones).

``loss_on: all`` trains every token but the first. The trajectories of one step are consecutive in file
order (rollouts of one prompt should be adjacent; there is no shuffling, which would scatter them) and
are as many as fit ``batch_size / shard_count`` rows of ``seq_len`` after merging (at most
``max_trajectories`` when > 0), never more than the rest of the current pass over the file: a step holds
each trajectory at most once, and an epoch ends a step. ``minimax_jax.data.prefix_tree`` lays them out.
Multi-host: host h reads the trajectories ``h::shard_count``. The files are read, tokenised and checked
(token ids, lengths against ``seq_len`` / ``key_len``, some token trained) once, at construction.

Batches: ``prefix_tree.ROW_KEYS`` arrays ``[rows, seq_len]`` (and ``KEY_KEYS`` with ``key_len``); ``it.last_stats`` is the ``PackStats``
of the batch returned last. ``get_state()`` / ``set_state()`` restore the exact next batch; the state carries
a fingerprint of the trajectories (all hosts' alike), and ``set_state`` refuses a state saved over other data.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from minimax_jax.data.prefix_tree import PackStats, Trajectory, TreePackingError, pack_trajectories
from minimax_jax.data.sources import resolve_paths
from minimax_jax.data.tokenizer import EOS, ROLE_START, load_tokenizer

__all__ = ["TrajectoryConfig", "TrajectoryError", "TrajectoryIterator", "load_trajectories",
           "conversation_trajectory", "LOSS_ON"]

LOSS_ON = ("assistant", "all")
_AI_HEADER = ROLE_START + "ai\n"


class TrajectoryError(ValueError):
    """A trajectory file, line or setting cannot be used (the message names it)."""


@dataclasses.dataclass(frozen=True)
class TrajectoryConfig:
    """Agent trajectories (JSONL conversations or token ids), packed per step into prefix trees.

    Attributes:
      sources: JSONL files, directories (their ``*.jsonl`` files, recursively) or globs (one trajectory per line).
      seq_len: slots per packed row.
      batch_size: GLOBAL rows per step.
      tokenizer: ``tokenizer.json`` or its directory (needed for conversations).
      loss_on: ``assistant`` (the assistant turns of conversations; the given mask of token ids) or ``all``.
      merge: prefix-tree merging (False: each trajectory its own chain, the unmerged baseline).
      max_trajectories: at most this many trajectories per step and host (0 = as many as fit the rows).
      key_len: > 0: the batches also carry the per-trajectory key layout (``prefix_tree.KEY_KEYS``) of this
        many entries per row (>= seq_len; the row's trajectories unmerged must fit it), with which MSA
        layers run the ordinary MSA kernels instead of the XLA reference (0 = none).
      num_epochs: passes over the trajectories; None repeats forever.
      shard_index, shard_count: this host's shard; None = jax's process index / count.
    """

    sources: tuple[str, ...]
    seq_len: int
    batch_size: int
    tokenizer: str | None = None
    loss_on: str = "assistant"
    merge: bool = True
    max_trajectories: int = 0
    key_len: int = 0
    num_epochs: int | None = 1
    shard_index: int | None = None
    shard_count: int | None = None

    def __post_init__(self):
        srcs = (self.sources,) if isinstance(self.sources, (str, os.PathLike)) else self.sources
        object.__setattr__(self, "sources", tuple(os.fspath(s) for s in srcs))
        for name in ("seq_len", "batch_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise TrajectoryError(f"{name} must be a positive int, got {v!r}")
        if not isinstance(self.merge, bool):
            raise TrajectoryError(f"merge must be true or false, got {self.merge!r}")
        if self.loss_on not in LOSS_ON:
            raise TrajectoryError(f"loss_on must be one of {LOSS_ON}, got {self.loss_on!r}")
        if not isinstance(self.key_len, int) or isinstance(self.key_len, bool) or self.key_len < 0:
            raise TrajectoryError(f"key_len must be an int >= 0, got {self.key_len!r}")
        if 0 < self.key_len < self.seq_len:   # the MSA kernels take at most as many queries (slots) as keys
            raise TrajectoryError(f"key_len must be 0 or >= seq_len={self.seq_len}, got {self.key_len}")
        if not isinstance(self.max_trajectories, int) or self.max_trajectories < 0:
            raise TrajectoryError(f"max_trajectories must be an int >= 0, got {self.max_trajectories!r}")
        if self.num_epochs is not None and (not isinstance(self.num_epochs, int) or self.num_epochs < 1):
            raise TrajectoryError(f"num_epochs must be a positive int or None, got {self.num_epochs!r}")
        if (self.shard_index is None) != (self.shard_count is None):
            raise TrajectoryError("give both shard_index and shard_count, or neither")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrajectoryConfig":
        """From a dict; unknown keys raise TrajectoryError naming them."""
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TrajectoryError(f"unknown trajectory data keys: {unknown}")
        return cls(**d)

    def shard(self) -> tuple[int, int]:
        if self.shard_count is not None:
            return self.shard_index, self.shard_count
        import jax

        return jax.process_index(), jax.process_count()


def conversation_trajectory(text: str, tokenizer, loss_on: str = "assistant") -> Trajectory:
    """Tokenise a rendered conversation; the loss mask marks the assistant turns (module docstring)."""
    enc = tokenizer.encode(text, add_special_tokens=False)
    ids = np.asarray(enc.ids, np.int32)
    if loss_on == "all":
        return Trajectory(ids, np.ones(ids.size, np.float32))
    starts = np.asarray([s for s, _ in enc.offsets], np.int64)
    mask = np.zeros(ids.size, bool)
    at = text.find(_AI_HEADER)
    while at >= 0:
        body = at + len(_AI_HEADER)
        close = text.find(EOS, body)
        end = len(text) if close < 0 else close + len(EOS)
        mask |= (starts >= body) & (starts < end)
        at = text.find(_AI_HEADER, end)
    return Trajectory(ids, mask.astype(np.float32))


def _list_of(value: Any, ok: Callable[[Any], bool]) -> bool:
    """``value`` is a list whose every item passes ``ok``."""
    return isinstance(value, list) and all(ok(v) for v in value)


def _parse(obj: Any, where: str, tokenizer, render, loss_on: str) -> Trajectory:
    if not isinstance(obj, dict) or ("messages" in obj) == ("tokens" in obj):
        raise TrajectoryError(f"{where}: expected an object with 'messages' or 'tokens'")
    if "tokens" in obj:
        toks, mask = obj["tokens"], obj.get("loss_mask")
        if not _list_of(toks, lambda v: type(v) is int) or not toks:
            raise TrajectoryError(f"{where}: 'tokens' must be a non-empty list of integer token ids")
        if mask is not None and (not _list_of(mask, lambda v: type(v) in (int, float, bool) and v in (0, 1))
                                 or len(mask) != len(toks)):                  # 0 / 1 as ints, floats or bools
            raise TrajectoryError(f"{where}: 'loss_mask' must be a list of 0 / 1, one per token ({len(toks)})")
        if min(toks) < 0 or max(toks) >= 1 << 31:
            raise TrajectoryError(f"{where}: token id {min(toks) if min(toks) < 0 else max(toks)} is out of range")
        weights = np.ones(len(toks), np.float32) if mask is None or loss_on == "all" else np.asarray(mask, np.float32)
        return Trajectory(np.asarray(toks, np.int64), weights)
    if render is None or tokenizer is None:
        raise TrajectoryError(f"{where}: a conversation needs a tokenizer and a chat renderer")
    try:
        text = render(obj["messages"], obj.get("tools"))
    except ValueError as e:
        raise TrajectoryError(f"{where}: {e}") from None
    return conversation_trajectory(text, tokenizer, loss_on)


def load_trajectories(paths: Sequence[str] | str, tokenizer=None, render: Callable | None = None,
                      loss_on: str = "assistant") -> list[Trajectory]:
    """Every trajectory of ``paths`` in file order (module docstring). Raises TrajectoryError."""
    return [t for t, _ in _load(paths, tokenizer, render, loss_on)]


def _trajectory_files(paths) -> list[str]:
    """Files as given and glob matches as they are; from a directory only its ``*.jsonl`` files (its notes, configs
    and logs are not trajectories). Raises TrajectoryError for a directory without one."""
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    files: set[str] = set()
    for p in paths:
        found = resolve_paths(p)
        if os.path.isdir(os.path.expanduser(os.fspath(p))):
            found = [f for f in found if f.endswith(".jsonl")]
            if not found:
                raise TrajectoryError(f"directory {os.fspath(p)!r} holds no .jsonl file")
        files.update(found)
    return sorted(files)


def _load(paths, tokenizer, render, loss_on) -> list[tuple[Trajectory, str]]:
    """(trajectory, "FILE line N") in file order; a UTF-8 BOM is dropped."""
    out = []
    for path in _trajectory_files(paths):
        with open(path, "rb") as f:
            data = f.read()
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise TrajectoryError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
        for n, line in enumerate(text.split("\n"), start=1):    # JSONL lines end at "\n" only
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TrajectoryError(f"{path} line {n}: invalid JSON ({e.msg} at column {e.colno})") from None
            out.append((_parse(obj, f"{path} line {n}", tokenizer, render, loss_on), f"{path} line {n}"))
    if not out:
        raise TrajectoryError(f"sources {paths} hold no trajectories")
    return out


def _check(loaded: list[tuple[Trajectory, str]], c: TrajectoryConfig, vocab_size: int | None) -> None:
    """Up-front checks of every trajectory (all hosts' alike), each error naming its file and line."""
    limit = min(x for x in (c.seq_len, c.key_len or None) if x is not None)
    for t, where in loaded:
        if vocab_size is not None and int(t.tokens.max()) >= vocab_size:
            raise TrajectoryError(f"{where}: token id {int(t.tokens.max())} is not below the model's vocab_size "
                                  f"{vocab_size}")
        if t.tokens.size > limit:
            raise TrajectoryError(f"{where}: {t.tokens.size} tokens do not fit a row of seq_len={c.seq_len}"
                                  + (f" and key_len={c.key_len}" if c.key_len else ""))
    if not any(t.loss_mask[1:].any() for t, _ in loaded):
        raise TrajectoryError(f"sources {list(c.sources)}: no trajectory has a trained token after its first (loss_on="
                              f"{c.loss_on}" + (": no assistant turn in a conversation, no 1 in a token record's "
                                                "loss_mask)" if c.loss_on == "assistant" else ")"))


class TrajectoryIterator:
    """Per-host batches of prefix-tree-packed trajectories (module docstring)."""

    def __init__(self, config: TrajectoryConfig, render: Callable | None = None, tokenizer=None,
                 vocab_size: int | None = None):
        """``vocab_size``: when given, every token id must be below it (else TrajectoryError naming the line)."""
        self.config = config
        tok = tokenizer
        if tok is None and config.tokenizer is not None:
            try:
                tok = load_tokenizer(config.tokenizer)
            except ValueError as e:
                raise TrajectoryError(f"data.tokenizer: {e}") from None
        index, count = config.shard()
        if config.batch_size % count:
            raise TrajectoryError(f"batch_size={config.batch_size} is not divisible by shard_count={count}")
        self.rows = config.batch_size // count
        loaded = _load(config.sources, tok, render, config.loss_on)
        _check(loaded, config, vocab_size)
        self.fingerprint = _fingerprint(t for t, _ in loaded)
        self.trajectories = [t for t, _ in loaded][index::count]
        if not self.trajectories:
            raise TrajectoryError(f"shard {index} of {count} holds no trajectory")
        self.index = 0
        self.last_stats: PackStats | None = None

    def __iter__(self):
        return self

    def _take(self, n: int) -> list[Trajectory]:
        m = len(self.trajectories)
        return [self.trajectories[(self.index + i) % m] for i in range(n)]

    def _pack(self, n: int):
        try:
            return pack_trajectories(self._take(n), self.config.seq_len, self.rows, self.config.merge,
                                     self.config.key_len or None)
        except TreePackingError:
            return None

    def __next__(self) -> dict[str, np.ndarray]:
        c, m = self.config, len(self.trajectories)
        left = None if c.num_epochs is None else c.num_epochs * m - self.index
        if left is not None and left <= 0:
            raise StopIteration
        # never past the end of this pass over the file: a step holds each trajectory at most once (a repeat
        # would merge for free and silently count twice), and an epoch ends a step
        cap = min(x for x in (left, c.max_trajectories or None, m - self.index % m) if x is not None)
        best = self._pack(1)
        if best is None:
            t = self.trajectories[self.index % m]
            raise TrajectoryError(f"trajectory {self.index % m} of this shard ({t.tokens.size} tokens) does not fit "
                                  f"a row of seq_len={c.seq_len}" + (f" and key_len={c.key_len}" if c.key_len else ""))
        lo, hi = 1, 2                   # grow while it fits, then bisect between the last fit and the first miss
        while hi <= cap and (got := self._pack(hi)) is not None:
            lo, best, hi = hi, got, hi * 2
        hi = min(hi, cap + 1)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            got = self._pack(mid)
            lo, hi, best = (mid, hi, got) if got is not None else (lo, mid, best)
        rows, self.last_stats = best
        self.index += lo
        return rows

    def get_state(self) -> dict[str, Any]:
        return {"index": self.index, "fingerprint": self.fingerprint}

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores the position; raises TrajectoryError when ``state`` was saved over other trajectories
        (a state without a fingerprint, from before it was kept, is taken as it is)."""
        saved = state.get("fingerprint")
        if saved is not None and saved != self.fingerprint:
            raise TrajectoryError(
                f"sources {list(self.config.sources)}: the trajectories differ from those the checkpoint was trained "
                f"on (these files: {self.fingerprint}, the checkpoint's: {saved}), so its data position (trajectory {int(state['index'])}) "
                "means nothing here; restore the original files, or train on these in a new run.run_dir from this "
                "run's weights (python -m minimax_jax.train.export, then init.mode=checkpoint, init.path=<export>)")
        self.index = int(state["index"])


def _fingerprint(trajectories) -> str:
    """blake2b-64 hex of the trajectories' token ids and loss masks, in order."""
    h = hashlib.blake2b(digest_size=8)
    for t in trajectories:
        for a in (np.asarray(t.tokens, np.int64), np.asarray(t.loss_mask, np.float32)):
            h.update(np.int64(a.size).tobytes())
            h.update(a.tobytes())
    return h.hexdigest()
