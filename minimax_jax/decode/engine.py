"""``DecodeEngine``: sequence slots, page tables, prefix caching and jit-compiled steps.

Host side (numpy, Python): slot bookkeeping, page allocation (``PagePool``), prefix-cache lookups
and registration (chain hashes of full pages). Device side: ``model_step`` (one jit per static
shape: ``[max_seqs, prefill_chunk]`` for prefill chunks, ``[max_seqs, Q]`` for decode steps; padded
page tables ``[max_seqs, pages_per_seq]``), the cache list donated and updated in place.

Usage::

    eng = DecodeEngine(params, cfg, max_seqs=8, max_len=4096)
    slots, logits = eng.prefill([prompt_a, prompt_b])     # logits[i]: [n_new_i, V] for the uncached suffix
    out = eng.decode_step(np.array([[tok_a], [tok_b]]), slots)   # [2, Q, V]
    eng.truncate(slots[0], new_len)                         # drop rejected speculative tokens
    eng.free(slots[1])
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from minimax_jax.config import ModelConfig
from minimax_jax.decode.cache import CacheSpec, init_cache
from minimax_jax.decode.pages import NULL_PAGE, PagePool, chain_hashes
from minimax_jax.decode.step import model_step

__all__ = ["DecodeEngine", "SequenceState", "DEFAULT_PAGE_SIZE", "MAX_QUERY_ROWS"]

DEFAULT_PAGE_SIZE = 64
MAX_QUERY_ROWS = 16


@dataclasses.dataclass
class SequenceState:
    """Host state of one slot: its tokens (written to the cache), pages, and registered hashes."""

    tokens: list
    pages: list
    hashes: list                      # chain hashes of the first len(hashes) full pages
    cached_tokens: int = 0            # tokens that came from the prefix cache at admission


_PAGE_AXIS = {"k": 1, "v": 1, "k_scale": 1, "v_scale": 1, "ki": 0, "ki_scale": 0}


@functools.partial(jax.jit, donate_argnums=0)
def _copy_page(cache, src, dst):
    """Copy physical page ``src`` to ``dst`` in every cache array of every layer."""
    def one(name, a):
        ax = _PAGE_AXIS[name]
        row = jax.lax.dynamic_index_in_dim(a, src, axis=ax, keepdims=True)
        return jax.lax.dynamic_update_index_in_dim(a, row, dst, axis=ax)
    return [{name: one(name, a) for name, a in c.items()} for c in cache]


class DecodeEngine:
    """Paged-cache inference engine over a params tree.

    Args:
      params: model params (docs/ARCHITECTURE.md); cfg: ``ModelConfig``.
      max_seqs: sequence slots (the static batch of every step).
      max_len: longest sequence in tokens (prompt + generated).
      page_size: tokens per page; must equal ``cfg.index_block_size`` for MSA models (default);
        ``DEFAULT_PAGE_SIZE`` otherwise.
      num_pages: physical pages including the null page (default: enough for every slot at
        ``max_len`` plus one). Fewer pages oversubscribe: allocation raises ``PagePoolExhausted``.
      kv_dtype, index_dtype: cache dtypes ("float32", "bfloat16", "float8_e4m3fn"); default cfg.dtype.
      prefill_chunk: tokens per prefill step (static).
      implementation: decode attention implementation (``minimax_jax.decode.ops``).
      prefill_implementation: implementation for the prefill ops (``minimax_jax.ops``).
      prefix_cache: share full pages between sequences by content hash.
      query_rows: if set (1..16), every decode step is padded to this many rows so one compiled
        step serves every Q <= query_rows (padding rows are never written); None = exact Q.
    Raises: ValueError for inconsistent sizes.
    """

    def __init__(self, params, cfg: ModelConfig, max_seqs: int, max_len: int, page_size: int | None = None,
                 num_pages: int | None = None, kv_dtype: str | None = None, index_dtype: str | None = None,
                 prefill_chunk: int = 256, implementation: str = "auto", prefill_implementation: str = "xla",
                 prefix_cache: bool = True, query_rows: int | None = None):
        if cfg.has_msa:
            if page_size not in (None, cfg.index_block_size):
                raise ValueError(f"MSA models need page_size == index_block_size ({cfg.index_block_size}), "
                                 f"got {page_size}")
            page_size = cfg.index_block_size
        page_size = page_size or DEFAULT_PAGE_SIZE
        if max_seqs < 1 or max_len < 1 or prefill_chunk < 1:
            raise ValueError(f"max_seqs, max_len, prefill_chunk must be >= 1 ({max_seqs}, {max_len}, {prefill_chunk})")
        pages_per_seq = math.ceil(max_len / page_size)
        num_pages = num_pages or max_seqs * pages_per_seq + 1
        self.params, self.cfg = params, cfg
        self.max_seqs, self.max_len = max_seqs, max_len
        self.spec = CacheSpec(page_size, num_pages, pages_per_seq, kv_dtype or cfg.dtype,
                              index_dtype or kv_dtype or cfg.dtype, tuple(cfg.layer_types))
        self.prefill_chunk = prefill_chunk
        self.implementation = implementation
        self.prefill_implementation = prefill_implementation
        self.prefix_cache = prefix_cache
        if query_rows is not None and not 1 <= query_rows <= MAX_QUERY_ROWS:
            raise ValueError(f"query_rows must be in [1, {MAX_QUERY_ROWS}], got {query_rows}")
        self.query_rows = query_rows
        self.pool = PagePool(num_pages)
        self.cache = init_cache(cfg, self.spec)
        self.tables = np.zeros((max_seqs, pages_per_seq), np.int32)
        self.seqs: list[SequenceState | None] = [None] * max_seqs

    # ------------------------------------------------------------------ slots
    @property
    def page_size(self) -> int:
        return self.spec.page_size

    def length(self, slot: int) -> int:
        return len(self._seq(slot).tokens)

    def _seq(self, slot: int) -> SequenceState:
        if not 0 <= slot < self.max_seqs or self.seqs[slot] is None:
            raise ValueError(f"slot {slot} holds no sequence")
        return self.seqs[slot]

    def _admit(self, prompt: Sequence[int]) -> int:
        free = [i for i, s in enumerate(self.seqs) if s is None]
        if not free:
            raise RuntimeError(f"all {self.max_seqs} sequence slots are in use; free one first")
        if not 1 <= len(prompt) <= self.max_len:
            raise ValueError(f"prompt length {len(prompt)} not in [1, max_len={self.max_len}]")
        slot = free[0]
        pages, hashes = [], []
        if self.prefix_cache:
            # Keep at least one token to compute so the last prompt token's logits exist.
            hashes = chain_hashes(prompt[: len(prompt) - 1], self.page_size)
            pages = self.pool.lookup(hashes)
            hashes = hashes[: len(pages)]
        n = len(pages) * self.page_size
        self.seqs[slot] = SequenceState(list(prompt[:n]), pages, hashes, cached_tokens=n)
        self.tables[slot] = NULL_PAGE
        self.tables[slot, : len(pages)] = pages
        return slot

    def free(self, slot: int) -> None:
        """Release a slot and its page references (registered pages stay cached until evicted)."""
        s = self._seq(slot)
        self.pool.release(s.pages)
        self.seqs[slot] = None
        self.tables[slot] = NULL_PAGE

    def truncate(self, slot: int, length: int) -> None:
        """Shorten a sequence to ``length`` tokens (e.g. drop rejected speculative tokens).

        Pages past the new end are released; a now-partial last page that is shared or published
        in the prefix cache is first copied to a private page (copy on write).
        """
        s = self._seq(slot)
        if not 0 <= length <= len(s.tokens):
            raise ValueError(f"truncate length {length} not in [0, {len(s.tokens)}]")
        keep = math.ceil(length / self.page_size)
        self.pool.release(s.pages[keep:])
        del s.pages[keep:]
        del s.tokens[length:]
        full = length // self.page_size
        del s.hashes[full:]
        if length % self.page_size:
            last = s.pages[-1]
            if self.pool.refcount(last) > 1 or last in self.pool._hash_of:
                (new,) = self.pool.allocate(1)
                self.cache = _copy_page(self.cache, jnp.int32(last), jnp.int32(new))
                self.pool.release([last])
                s.pages[-1] = new
        self.tables[slot] = NULL_PAGE
        self.tables[slot, : len(s.pages)] = s.pages

    # ------------------------------------------------------------------ pages
    def _reserve(self, plans: dict[int, int]) -> None:
        """Allocate pages so each slot can hold ``plans[slot]`` tokens (all or nothing)."""
        taken: list[tuple[int, list[int]]] = []
        try:
            for slot, new_len in plans.items():
                s = self._seq(slot)
                if new_len > self.max_len:
                    raise ValueError(f"slot {slot}: length {new_len} exceeds max_len {self.max_len}")
                need = math.ceil(new_len / self.page_size) - len(s.pages)
                if need > 0:
                    got = self.pool.allocate(need)
                    taken.append((slot, got))
                    s.pages.extend(got)
        except Exception:
            for slot, got in taken:
                del self.seqs[slot].pages[-len(got):]
                self.pool.release(got)
            raise
        for slot in plans:
            s = self.seqs[slot]
            self.tables[slot, : len(s.pages)] = s.pages

    def _publish(self, slot: int) -> None:
        """Register newly completed full pages of ``slot`` in the prefix cache."""
        if not self.prefix_cache:
            return
        s = self.seqs[slot]
        full = len(s.tokens) // self.page_size
        if full <= len(s.hashes):
            return
        done = len(s.hashes)
        s.hashes += chain_hashes(s.tokens[done * self.page_size: full * self.page_size], self.page_size,
                                 s.hashes[-1] if s.hashes else None)
        for i in range(done, full):
            self.pool.register(s.pages[i], s.hashes[i])

    # ------------------------------------------------------------------ steps
    def _run(self, tokens: np.ndarray, positions: np.ndarray, path: str, implementation: str,
             return_hidden: bool = False):
        """One device step; returns logits, or ``(logits, hidden)`` with ``return_hidden``."""
        out = model_step(self.params, self.cache, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32),
                         jnp.asarray(self.tables), cfg=self.cfg, spec=self.spec, path=path,
                         implementation=implementation, return_hidden=return_hidden)
        self.cache = out[-1]
        return out[0] if not return_hidden else (out[0], out[1])

    def prefill(self, prompts: Sequence[Sequence[int]], return_hidden: bool = False):
        """Admit prompts into free slots and run chunked prefill over their uncached suffixes.

        Returns: ``(slots, logits)`` with ``logits[i]`` float32 ``[len(prompt_i) - cached_i, V]``
          for the prompt tokens computed here (``cached_i = seqs[slot].cached_tokens``); with
          ``return_hidden`` also ``hidden[i]`` ``[len(prompt_i) - cached_i, H]`` (pre-final-norm,
          as ``forward(..., return_hidden=True)``): ``(slots, logits, hidden)``.
        Raises: RuntimeError (no free slot), ValueError (bad length), PagePoolExhausted (nothing
          is admitted then).
        """
        slots = []
        try:
            for p in prompts:
                slots.append(self._admit([int(t) for t in p]))
            self._reserve({s: len(p) for s, p in zip(slots, prompts)})
        except Exception:
            for s in slots:
                self.free(s)
            raise
        todo = {s: [int(t) for t in p][len(self.seqs[s].tokens):] for s, p in zip(slots, prompts)}
        outs: dict[int, list] = {s: [] for s in slots}
        hids: dict[int, list] = {s: [] for s in slots}
        c = self.prefill_chunk
        while any(todo.values()):
            tok = np.zeros((self.max_seqs, c), np.int32)
            pos = np.full((self.max_seqs, c), -1, np.int32)
            took = {}
            for s, rest in todo.items():
                n = min(c, len(rest))
                if n:
                    start = len(self.seqs[s].tokens)
                    tok[s, :n] = rest[:n]
                    pos[s, :n] = np.arange(start, start + n)
                    took[s] = n
            out = self._run(tok, pos, "gather", self.prefill_implementation, return_hidden=return_hidden)
            logits, hidden = (out, None) if not return_hidden else out
            logits = np.asarray(logits)
            hidden = None if hidden is None else np.asarray(hidden)
            for s, n in took.items():
                self.seqs[s].tokens.extend(todo[s][:n])
                todo[s] = todo[s][n:]
                outs[s].append(logits[s, :n])
                if hidden is not None:
                    hids[s].append(hidden[s, :n])
                self._publish(s)
        logits = [np.concatenate(outs[s], 0) for s in slots]
        if return_hidden:
            return slots, logits, [np.concatenate(hids[s], 0) for s in slots]
        return slots, logits

    def decode_step(self, tokens, slots: Sequence[int], num_tokens: Sequence[int] | None = None,
                    return_hidden: bool = False):
        """Append ``Q`` tokens per listed slot (1 main + drafts) and return their logits.

        Args:
          tokens: ``[n, Q]`` int token ids, ``1 <= Q <= 16``; row ``i`` goes to ``slots[i]``.
          slots: live slot ids (distinct).
          num_tokens: optional per-row count ``<= Q`` of real tokens (the rest is padding).
          return_hidden: also return the pre-final-norm hidden states ``[n, Q, H]``.
        Returns: float32 ``[n, Q, V]`` logits (rows past ``num_tokens`` are meaningless), or
          ``(logits, hidden)`` with ``return_hidden``.
        Raises: ValueError (bad shapes / slots / length), PagePoolExhausted.
        """
        tokens = np.asarray(tokens)
        q_in = tokens.shape[-1] if tokens.ndim == 2 else 0
        if tokens.ndim != 2 or tokens.shape[0] != len(slots) or not 1 <= tokens.shape[1] <= MAX_QUERY_ROWS:
            raise ValueError(f"tokens must be [len(slots)={len(slots)}, Q<=16], got {tokens.shape}")
        if len(set(slots)) != len(slots):
            raise ValueError(f"slots must be distinct, got {list(slots)}")
        q = tokens.shape[1]
        counts = [q] * len(slots) if num_tokens is None else [int(n) for n in num_tokens]
        if any(not 0 <= n <= q for n in counts):
            raise ValueError(f"num_tokens must lie in [0, Q={q}], got {counts}")
        if self.query_rows is not None:
            if q > self.query_rows:
                raise ValueError(f"Q={q} exceeds the engine's query_rows={self.query_rows}")
            tokens = np.pad(tokens, ((0, 0), (0, self.query_rows - q)))
            q = self.query_rows
        self._reserve({s: self.length(s) + n for s, n in zip(slots, counts)})
        tok = np.zeros((self.max_seqs, q), np.int32)
        pos = np.full((self.max_seqs, q), -1, np.int32)
        for i, (s, n) in enumerate(zip(slots, counts)):
            start = self.length(s)
            tok[s, :n] = tokens[i, :n]
            pos[s, :n] = np.arange(start, start + n)
        out = self._run(tok, pos, "paged", self.implementation, return_hidden=return_hidden)
        logits, hidden = (out, None) if not return_hidden else out
        for i, (s, n) in enumerate(zip(slots, counts)):
            self.seqs[s].tokens.extend(int(t) for t in tokens[i, :n])
            self._publish(s)
        logits = np.asarray(logits)[list(slots), :q_in]
        if return_hidden:
            return logits, np.asarray(hidden)[list(slots), :q_in]
        return logits
