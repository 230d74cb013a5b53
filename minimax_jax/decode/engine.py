"""``DecodeEngine``: sequence slots, page tables, prefix caching and jit-compiled steps.

Host side (numpy, Python): slot bookkeeping, page allocation (``PagePool``), prefix-cache lookups
and registration (chain hashes of full pages). Device side: ``model_step`` (one jit per static
shape: ``[max_seqs, prefill_chunk]`` with page tables ``[max_seqs, w]`` for prefill chunks, ``w``
from ``prefill_table_width``: the power-of-two page bucket of the filled length, or always the full
table when the prefill runs GPU kernels (``prefill_widths``); ``[max_seqs, Q]`` with the full
``[max_seqs, pages_per_seq]`` tables for decode steps), the cache list donated and updated in place.

Prefill implementations (``prefill_implementation``, the "gather" path of ``model_step``):
``"auto"`` (default) takes the GPU kernels on a GPU backend - the Pallas MSA indexer and sparse
attention for MSA layers (``minimax_jax.ops.msa``) and the suffix-attention kernel
(``pallas_kernels.prefill.gpu_attention``) for full-attention layers; the XLA reference ops on CPU
(on TPU: the MSA ops' own ``"auto"``, XLA for dense layers). What ran is in
``minimax_jax.ops.implementation_report()`` (``msa_select_blocks``, ``msa_attention``,
``prefill_attention``, and ``<op>.auto_reason`` when a kernel did not apply). The default was
``"xla"`` until the kernels accepted queries at arbitrary positions of the gathered view: the first
GPU MSA kernels required the T queries to be the LAST T keys of the storage, which a gathered page
table (width >= the filled length) is not, ``"auto"`` had no ``supports`` check then, and dense
layers had no kernel for T != S. The layout contract of ``pallas_kernels.msa.layout`` (queries
anywhere, keys one contiguous run) and the suffix kernel removed those reasons.

Usage::

    eng = DecodeEngine(params, cfg, max_seqs=8, max_len=4096)
    slots, logits = eng.prefill([prompt_a, prompt_b])     # logits[i]: [1, V], the last prompt position
    out = eng.decode_step(np.array([[tok_a], [tok_b]]), slots)   # [2, Q, V]
    eng.truncate(slots[0], new_len)                         # drop rejected speculative tokens
    chosen = eng.decode_greedy(next_tokens, slots, 16)      # 16 greedy steps in one device loop (``loops``)
    eng.free(slots[1])
    c = eng.prefill_start(prompt_c)                         # admitted, computed a chunk per call:
    done = eng.prefill_advance([c])                         # {c: [1, V]} once its prompt is complete
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from minimax_jax import sharding
from minimax_jax.config import ModelConfig
from minimax_jax.decode import mesh_attention
from minimax_jax.decode.cache import CacheSpec, available_memory, cache_device_bytes, init_cache
from minimax_jax.decode.pages import NULL_PAGE, PagePool, chain_hashes
from minimax_jax.decode.loops import DeviceLoops
from minimax_jax.decode.step import PREFILL_IMPLEMENTATIONS, model_step

__all__ = ["DecodeEngine", "SequenceState", "CacheTooLarge", "DEFAULT_PAGE_SIZE", "MAX_QUERY_ROWS", "PREFILL_WIDTHS"]

DEFAULT_PAGE_SIZE = 64
MAX_QUERY_ROWS = 16
PREFILL_WIDTHS = ("auto", "pow2", "full")


@dataclasses.dataclass
class SequenceState:
    """Host state of one slot: its tokens (written to the cache), pages, and registered hashes."""

    tokens: list
    pages: list
    hashes: list                      # chain hashes of the first len(hashes) full pages
    cached_tokens: int = 0            # tokens that came from the prefix cache at admission
    prompt: list | None = None        # the whole prompt while ``prefill_advance`` computes it, else None
    hidden_last: int = 0              # ``prefill_advance`` keeps the hidden states of this many last prompt tokens
    hidden: list = dataclasses.field(default_factory=list)   # ... collected so far (host arrays [m, H])


_PAGE_AXIS = {"k": 1, "v": 1, "k_scale": 1, "v_scale": 1, "ki": 0, "ki_scale": 0}


class CacheTooLarge(ValueError):
    """The engine's caches would not fit in the memory available; raised before anything is allocated.
    ``needed`` / ``available``: bytes (per device; a CPU's devices share the host's memory)."""

    def __init__(self, message: str, needed: int, available: int):
        super().__init__(message)
        self.needed, self.available = needed, available


def _gib(n: int) -> str:
    return f"{n:,} bytes ({n / 2 ** 30:.2f} GiB)"


def check_cache_memory(cfg: ModelConfig, spec: CacheSpec, params, max_seqs: int, max_len: int) -> None:
    """Raise CacheTooLarge when the caches ``_new_cache`` would make do not fit in the memory their devices
    have left (``cache.available_memory``; nothing is checked where the platform does not say)."""
    make = functools.partial(init_cache, cfg, spec)
    abstract = jax.eval_shape(make)
    ctx = sharding.current()
    if ctx is not None:
        shardings = mesh_attention.cache_shardings(cfg, abstract, *ctx)
        devices = list(ctx[0].devices.flat)
    else:
        shardings = None
        devices = sorted({d for a in jax.tree.leaves(params) if isinstance(a, jax.Array) and a.committed
                          for d in a.devices()}, key=lambda d: d.id)[:1] or jax.devices()[:1]
    per_device = cache_device_bytes(abstract, shardings)
    if devices[0].platform == "cpu":             # CPU devices share the host's memory
        needed, found = per_device * len(devices), available_memory(devices[0])
    else:
        needed, found = per_device, min((m for m in map(available_memory, devices) if m is not None),
                                         default=None, key=lambda m: m[0])
    if found is None or needed <= found[0]:
        return
    where = f" per device ({len(devices)} devices)" if len(devices) > 1 and devices[0].platform != "cpu" else ""
    raise CacheTooLarge(
        f"the paged KV cache for {max_seqs} sequence(s) of up to {max_len:,} tokens needs {_gib(needed)}{where} "
        f"({spec.num_pages:,} pages of {spec.page_size} tokens, {spec.kv_dtype}), more than the {_gib(found[0])} "
        f"of {found[1]}", needed, found[0])


def _new_cache(cfg: ModelConfig, spec: CacheSpec, params):
    """Zero caches placed where ``model_step`` returns them. Inside ``sharding.use_mesh``: created on that
    mesh with K/V sharded by kv head (``mesh_attention.cache_shardings``: each device holds its heads'
    share, never the whole cache); elsewhere as ``_commit`` places them."""
    ctx = sharding.current()
    if ctx is None:
        return _commit(init_cache(cfg, spec), params)
    make = functools.partial(init_cache, cfg, spec)
    return jax.jit(make, out_shardings=mesh_attention.cache_shardings(cfg, jax.eval_shape(make), *ctx))()


def _commit(cache, params):
    """Place fresh caches where ``model_step`` returns them: on the device of the params, or
    replicated over their mesh. A jit call with uncommitted arrays is a different cache key than
    one with the committed outputs fed back, so without this every step shape of an engine over
    committed (e.g. restored) params would compile twice. Params with no committed array (outputs
    stay uncommitted too) or committed otherwise (several devices, no one mesh) keep the fresh
    caches as they are: placement only affects compile count, never results."""
    shardings = {a.sharding for a in jax.tree.leaves(params) if isinstance(a, jax.Array) and a.committed}
    meshes = {s.mesh for s in shardings if isinstance(s, jax.sharding.NamedSharding)}
    devices = set().union(*(s.device_set for s in shardings)) if shardings else set()
    if len(meshes) == 1 and all(isinstance(s, jax.sharding.NamedSharding) for s in shardings):
        return jax.device_put(cache, jax.sharding.NamedSharding(next(iter(meshes)), jax.sharding.PartitionSpec()))
    if len(devices) == 1:
        return jax.device_put(cache, jax.sharding.SingleDeviceSharding(next(iter(devices))))
    return cache


@functools.partial(jax.jit, donate_argnums=0)
def _copy_page(cache, src, dst):
    """Copy physical page ``src`` to ``dst`` in every cache array of every layer."""
    def one(name, a):
        ax = _PAGE_AXIS[name]
        row = jax.lax.dynamic_index_in_dim(a, src, axis=ax, keepdims=True)
        return jax.lax.dynamic_update_index_in_dim(a, row, dst, axis=ax)
    return [{name: one(name, a) for name, a in c.items()} for c in cache]


class DecodeEngine(DeviceLoops):
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
      implementation: decode attention implementation (``minimax_jax.ops.paged``).
      prefill_implementation: implementation for the prefill ops, one of
        ``minimax_jax.decode.step.PREFILL_IMPLEMENTATIONS`` (module docstring; ``"xla"`` = the
        reference ops everywhere).
      prefill_widths: page-table widths of the prefill steps: ``"pow2"`` (the power-of-two bucket
        of the filled pages: an XLA op's cost grows with the gathered width; one compiled step per
        bucket), ``"full"`` (always the full table: one compiled step; the kernels' cost follows
        the positions, and the extra gather is a copy of <= max_len tokens per layer), or
        ``"auto"`` (default): ``"full"`` when the prefill runs the GPU kernels (a GPU backend with
        ``"auto"`` / ``"pallas_gpu"`` and no sliding-window layer, which would run the XLA
        reference), else ``"pow2"``.
      prefix_cache: share full pages between sequences by content hash.
      query_rows: if set (1..16), every decode step is padded to this many rows so one compiled
        step serves every Q <= query_rows (padding rows are never written); None = exact Q.
    Mesh: built and run inside ``sharding.use_mesh``, the caches are sharded by kv head over the tensor
    axes and each prefill chunk's tokens split over the sequence axes (``minimax_jax.decode.mesh_attention``).
    Device loops, many steps per host round trip: ``decode_greedy``, ``decode_speculative_greedy``
    (``minimax_jax.decode.loops``).
    Raises: ValueError for inconsistent sizes; CacheTooLarge (before allocating) when the caches would not fit in
    the memory left on their devices (``check_cache_memory``).
    """

    def __init__(self, params, cfg: ModelConfig, max_seqs: int, max_len: int, page_size: int | None = None,
                 num_pages: int | None = None, kv_dtype: str | None = None, index_dtype: str | None = None,
                 prefill_chunk: int = 256, implementation: str = "auto", prefill_implementation: str = "auto",
                 prefix_cache: bool = True, query_rows: int | None = None, prefill_widths: str = "auto"):
        if cfg.has_msa:
            if page_size not in (None, cfg.index_block_size):
                raise ValueError(f"MSA models need page_size == index_block_size ({cfg.index_block_size}), "
                                 f"got {page_size}")
            page_size = cfg.index_block_size
        page_size = page_size or DEFAULT_PAGE_SIZE
        if max_seqs < 1 or max_len < 1 or prefill_chunk < 1:
            raise ValueError(f"max_seqs, max_len, prefill_chunk must be >= 1 ({max_seqs}, {max_len}, {prefill_chunk})")
        if prefill_implementation not in PREFILL_IMPLEMENTATIONS:
            raise ValueError(f"prefill_implementation must be one of {PREFILL_IMPLEMENTATIONS}, "
                             f"got {prefill_implementation!r}")
        if prefill_widths not in PREFILL_WIDTHS:
            raise ValueError(f"prefill_widths must be one of {PREFILL_WIDTHS}, got {prefill_widths!r}")
        if prefill_widths == "auto":
            kernels = (prefill_implementation == "pallas_gpu"
                       or (prefill_implementation == "auto" and jax.default_backend() == "gpu"))
            prefill_widths = "full" if kernels and "sliding" not in cfg.layer_types else "pow2"
        pages_per_seq = math.ceil(max_len / page_size)
        num_pages = num_pages or max_seqs * pages_per_seq + 1
        self.params, self.cfg = params, cfg
        self.max_seqs, self.max_len = max_seqs, max_len
        self.spec = CacheSpec(page_size, num_pages, pages_per_seq, kv_dtype or cfg.dtype,
                              index_dtype or kv_dtype or cfg.dtype, tuple(cfg.layer_types))
        self.prefill_chunk = prefill_chunk
        self.implementation = implementation
        self.prefill_implementation = prefill_implementation
        self.prefill_widths = prefill_widths
        self.prefix_cache = prefix_cache
        if query_rows is not None and not 1 <= query_rows <= MAX_QUERY_ROWS:
            raise ValueError(f"query_rows must be in [1, {MAX_QUERY_ROWS}], got {query_rows}")
        self.query_rows = query_rows
        check_cache_memory(cfg, self.spec, params, max_seqs, max_len)     # before anything is allocated
        self.pool = PagePool(num_pages)
        self.cache = _new_cache(cfg, self.spec, params)
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
             return_hidden: bool = False, *, table_width: int | None = None, logit_rows: np.ndarray | None = None):
        """One device step; returns logits, or ``(logits, hidden)`` with ``return_hidden``.

        ``table_width``: pass only the first ``table_width`` page-table columns ("gather" path; must
        cover every valid position). ``logit_rows``: ``[B, K]`` rows of ``T`` to unembed
        (``model_step``). Results stay on the device (no host transfer here).
        """
        table = self.tables if table_width is None else self.tables[:, :table_width]
        rows = None if logit_rows is None else jnp.asarray(logit_rows, jnp.int32)
        out = model_step(self.params, self.cache, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32),
                         jnp.asarray(table), rows, cfg=self.cfg, spec=self.spec, path=path,
                         implementation=implementation, return_hidden=return_hidden)
        self.cache = out[-1]
        return out[0] if not return_hidden else (out[0], out[1])

    def prefill_table_width(self, num_tokens: int) -> int:
        """Page-table columns a prefill chunk gathers when the longest row holds ``num_tokens``
        tokens after the chunk. ``prefill_widths == "full"``: ``pages_per_seq``. ``"pow2"``: the
        pages covering them, but at least those of one whole chunk (fewer keys than the chunk's
        own queries save little; fewer compiled shapes), rounded up to a power of two (few
        compiled shapes) and capped at ``pages_per_seq``.

        Keys past a row's length are masked, so any width covering the filled pages is the same
        math as the full table. Not always the same bits: XLA picks its dot / reduction kernels by
        shape, so float32 results can differ in the last bits (~1e-7 on the test models) - as the
        previous full-table path's did between two ``max_len`` values. Now they do not depend on
        ``max_len`` at all.
        """
        if not 1 <= num_tokens <= self.spec.max_len:
            raise ValueError(f"num_tokens {num_tokens} not in [1, {self.spec.max_len}]")
        if self.prefill_widths == "full":
            return self.spec.pages_per_seq
        need = math.ceil(max(num_tokens, self.prefill_chunk) / self.page_size)
        return min(self.spec.pages_per_seq, 1 << (need - 1).bit_length())

    def compile_prefill(self, max_tokens: int | None = None, return_hidden: bool = False,
                        return_all_logits: bool = False) -> list[int]:
        """Compile the prefill step for every table width a prompt of up to ``max_tokens`` tokens
        (default ``max_len``) uses, by running all-padding chunks (nothing is written but the null
        page; no slot is touched). Returns the widths compiled. Use before timing a prefill."""
        max_tokens = self.max_len if max_tokens is None else max_tokens
        lo, top = self.prefill_table_width(1), self.prefill_table_width(max_tokens)
        widths = [w for w in (1 << i for i in range(top.bit_length())) if lo <= w < top] + [top]
        c = self.prefill_chunk
        tok = np.zeros((self.max_seqs, c), np.int32)
        pos = np.full((self.max_seqs, c), -1, np.int32)
        rows = None if return_all_logits else np.zeros((self.max_seqs, 1), np.int32)
        for w in widths:
            out = self._run(tok, pos, "gather", self.prefill_implementation, return_hidden,
                            table_width=w, logit_rows=rows)
            jax.block_until_ready(out)
        return widths

    def prefill(self, prompts: Sequence[Sequence[int]], return_hidden: bool = False,
                return_all_logits: bool = False, hidden_last: int | None = None):
        """Admit prompts into free slots and run chunked prefill over their uncached suffixes.

        Each chunk gathers only the pages that can be visible to it (``prefill_table_width`` of the
        longest row after the chunk) and, by default, unembeds and copies to the host only the last
        prompt position of each row, so time and memory follow the prompt, not ``max_len``.

        Args:
          prompts: token id sequences (each ``1..max_len`` tokens).
          return_hidden: also return pre-final-norm hidden states (as ``forward(...,
            return_hidden=True)``; the MTP drafter's input).
          return_all_logits: return the logits of every computed prompt position (scoring, tests);
            default only the last one.
          hidden_last: with ``return_hidden``, keep only the hidden states of the last
            ``hidden_last`` computed positions of each prompt (None = all computed positions).
        Returns: ``(slots, logits)``: ``logits[i]`` float32 ``[1, V]`` (last prompt position), or
          ``[len(prompt_i) - cached_i, V]`` with ``return_all_logits`` (``cached_i =
          seqs[slot].cached_tokens``, the prefix-cache hit; at least one token is always computed).
          With ``return_hidden``: ``(slots, logits, hidden)``, ``hidden[i]`` ``[m_i, H]`` with ``m_i =
          len(prompt_i) - cached_i`` capped at ``hidden_last``.
        Raises: RuntimeError (no free slot), ValueError (bad length / hidden_last), PagePoolExhausted
          (nothing is admitted then).
        """
        if hidden_last is not None and hidden_last < 1:
            raise ValueError(f"hidden_last must be >= 1 or None, got {hidden_last}")
        prompts = [[int(t) for t in p] for p in prompts]
        slots = []
        try:
            for p in prompts:
                slots.append(self._admit(p))
            self._reserve({s: len(p) for s, p in zip(slots, prompts)})
        except Exception:
            for s in slots:
                self.free(s)
            raise
        # Per slot: the uncached suffix and an offset into it (no per-chunk list slicing).
        todo = {s: p[len(self.seqs[s].tokens):] for s, p in zip(slots, prompts)}
        done = dict.fromkeys(slots, 0)
        keep_from = {s: 0 if not return_hidden or hidden_last is None else max(0, len(todo[s]) - hidden_last)
                     for s in slots}
        outs: dict[int, list] = {s: [] for s in slots}
        hids: dict[int, list] = {s: [] for s in slots}
        c = self.prefill_chunk
        while any(done[s] < len(todo[s]) for s in slots):
            tok = np.zeros((self.max_seqs, c), np.int32)
            pos = np.full((self.max_seqs, c), -1, np.int32)
            rows = None if return_all_logits else np.zeros((self.max_seqs, 1), np.int32)
            took, finishing, end = {}, [], 0
            for s in slots:
                o = done[s]
                n = min(c, len(todo[s]) - o)
                if n <= 0:
                    continue
                start = len(self.seqs[s].tokens)
                tok[s, :n] = todo[s][o:o + n]
                pos[s, :n] = np.arange(start, start + n)
                took[s] = n
                end = max(end, start + n)
                if o + n == len(todo[s]):
                    finishing.append(s)
                    if rows is not None:
                        rows[s, 0] = n - 1
            out = self._run(tok, pos, "gather", self.prefill_implementation, return_hidden,
                            table_width=self.prefill_table_width(end), logit_rows=rows)
            logits, hidden = (out, None) if not return_hidden else out
            if return_all_logits or finishing:
                logits = np.asarray(logits)
            if return_hidden and any(done[s] + n > keep_from[s] for s, n in took.items()):
                hidden = np.asarray(hidden)
            for s, n in took.items():
                o = done[s]
                self.seqs[s].tokens.extend(todo[s][o:o + n])
                if return_all_logits:
                    outs[s].append(logits[s, :n])
                elif s in finishing:
                    outs[s].append(logits[s, :1])
                if return_hidden and o + n > keep_from[s]:
                    hids[s].append(hidden[s, max(0, keep_from[s] - o):n])
                done[s] = o + n
                self._publish(s)
        logits = [np.concatenate(outs[s], 0) for s in slots]
        if return_hidden:
            return slots, logits, [np.concatenate(hids[s], 0) for s in slots]
        return slots, logits

    def prefill_start(self, prompt: Sequence[int], hidden_last: int = 0) -> int:
        """Admit one prompt into a free slot (prefix-cache lookup, pages for the whole prompt) without
        computing it; ``prefill_advance`` then runs its uncached suffix a chunk at a time, between
        decode steps of other slots. ``hidden_last > 0``: ``prefill_advance`` also returns the
        pre-final-norm hidden states of the last ``hidden_last`` computed prompt positions (the MTP
        drafter's input; as ``prefill(return_hidden=True, hidden_last=...)``). Returns the slot.
        Raises as ``prefill`` (nothing admitted), ValueError for a negative ``hidden_last``."""
        if hidden_last < 0:
            raise ValueError(f"hidden_last must be >= 0, got {hidden_last}")
        prompt = [int(t) for t in prompt]
        slot = self._admit(prompt)
        try:
            self._reserve({slot: len(prompt)})
        except Exception:
            self.free(slot)
            raise
        self.seqs[slot].prompt = prompt
        self.seqs[slot].hidden_last = hidden_last
        return slot

    def prefill_remaining(self, slot: int) -> int:
        """Prompt tokens of a ``prefill_start`` slot not computed yet (0 once its prefill is done)."""
        s = self._seq(slot)
        return 0 if s.prompt is None else len(s.prompt) - len(s.tokens)

    def prefill_advance(self, slots: Sequence[int], max_tokens: int | None = None) -> dict:
        """One prefill step over ``prefill_start`` slots: up to ``prefill_chunk`` next prompt tokens of
        each, ``max_tokens`` in all (slots served in the order given; None = no limit; at least one
        token). Returns ``{slot: float32 [1, V] logits of the last prompt position}`` for the slots
        whose prompt is now complete (they take ``decode_step`` from here); a slot started with
        ``hidden_last`` maps to ``(logits, hidden [m, H])``, ``1 <= m <= hidden_last`` (the computed
        positions among its last ``hidden_last``). Raises ValueError for a slot with no pending
        prefill."""
        budget = self.prefill_chunk * len(slots) if max_tokens is None else max(1, int(max_tokens))
        c = self.prefill_chunk
        tok = np.zeros((self.max_seqs, c), np.int32)
        pos = np.full((self.max_seqs, c), -1, np.int32)
        rows = np.zeros((self.max_seqs, 1), np.int32)
        took, end = {}, 0
        for slot in slots:
            left = self.prefill_remaining(slot)
            if left <= 0:
                raise ValueError(f"slot {slot} has no pending prefill")
            n = min(c, left, budget)
            if n <= 0:
                break
            s = self.seqs[slot]
            start = len(s.tokens)
            tok[slot, :n] = s.prompt[start:start + n]
            pos[slot, :n] = np.arange(start, start + n)
            rows[slot, 0] = n - 1
            took[slot], end, budget = n, max(end, start + n), budget - n
        # Hidden states only for the chunks that reach into some slot's last ``hidden_last`` positions.
        keep_from = {slot: len(self.seqs[slot].prompt) - self.seqs[slot].hidden_last for slot in took}
        want_hidden = any(self.seqs[slot].hidden_last and len(self.seqs[slot].tokens) + n > keep_from[slot]
                          for slot, n in took.items())
        out = self._run(tok, pos, "gather", self.prefill_implementation, want_hidden,
                        table_width=self.prefill_table_width(end), logit_rows=rows)
        logits, hidden = out if want_hidden else (out, None)
        finished = [slot for slot, n in took.items() if self.prefill_remaining(slot) == n]
        if finished:
            logits = np.asarray(logits)
        res = {}
        for slot, n in took.items():
            s = self.seqs[slot]
            start = len(s.tokens)
            if s.hidden_last and start + n > keep_from[slot]:
                s.hidden.append(np.asarray(hidden[slot, max(0, keep_from[slot] - start):n]))
            s.tokens.extend(s.prompt[start:start + n])
            self._publish(slot)
            if slot in finished:
                s.prompt = None
                res[slot] = logits[slot, :1]
                if s.hidden_last:
                    res[slot] = (res[slot], np.concatenate(s.hidden, 0))
                    s.hidden = []
        return res

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
