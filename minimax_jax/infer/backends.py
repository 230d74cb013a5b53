"""Generation engines behind one small interface (``Backend``).

* ``"paged"`` (default): ``minimax_jax.decode.DecodeEngine`` - paged KV cache, chunked prefill,
  ``decode_step`` with up to 16 query rows (1 + speculative drafts), ``truncate`` to drop rejected
  drafts.
* ``"recompute"``: a full ``minimax_jax.model.forward`` over each whole sequence at every step. Slow
  (quadratic); kept as an independent oracle for tests and debugging, never chosen implicitly.

Interface (host numpy in and out)::

    handles, last_logits[n,V], hidden = backend.prefill(prompts, want_hidden=..., on_tokens=cb)
    logits[n,Q,V], hidden = backend.step(handles, tokens[n,Q], want_hidden=...)
    backend.truncate(handle, length); backend.free(handle); backend.length(handle)
    chosen[n,steps] = backend.greedy(handles, tokens[n], steps)             # device loops (paged only)
    emitted, accepted, window = backend.speculative_greedy(handles, tokens[n], iters, mtp, window, k)

``hidden`` is the main model's pre-final-norm hidden state (input of the MTP drafter): after
prefill a list of ``[m_i, H]`` arrays for the LAST ``m_i`` prompt tokens (``1 <= m_i <= len(prompt_i)``;
``want_hidden=k``, an int, caps ``m_i`` at ``k`` - pass the drafter's window so a long prompt's hidden
states never all reach the host), after a step ``[n, Q, H]``; None when not asked.
"""

from __future__ import annotations

import inspect
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from minimax_jax.config import ModelConfig
from minimax_jax.infer.errors import EngineUnavailable

__all__ = ["ENGINES", "Backend", "PagedBackend", "RecomputeBackend", "make_backend"]

ENGINES = ("paged", "recompute")


class Backend:
    """Base class; see the module doc for the contract. ``name`` and ``describe()`` say what runs."""

    name = "base"
    supports_hidden = False

    def describe(self) -> str:
        return self.name

    def prefill(self, prompts, *, want_hidden=False, on_tokens: Callable[[int], None] | None = None):
        raise NotImplementedError

    def step(self, handles, tokens, *, num_tokens=None, want_hidden=False):
        raise NotImplementedError

    def truncate(self, handle: int, length: int) -> None:
        raise NotImplementedError

    def greedy(self, handles, tokens, steps: int):
        """``steps`` greedy decode steps in one device loop: ``[n, steps]`` chosen tokens (the paged engine's
        ``decode_greedy``). Raises EngineUnavailable where the backend has no such loop."""
        raise EngineUnavailable(f"a greedy decode loop (decode_loop > 1) needs the paged engine; the {self.name} "
                                "engine decodes one step per host round trip")

    def speculative_greedy(self, handles, tokens, iters: int, mtp, window, num_draft: int):
        """``iters`` greedy MTP speculative steps in one device loop (the paged engine's
        ``decode_speculative_greedy``: ``(emitted [n, iters, k+1], accepted [n, iters], window)``). Raises
        EngineUnavailable where the backend has no such loop."""
        raise EngineUnavailable(f"a speculative decode loop (decode_loop > 1) needs the paged engine; the "
                                f"{self.name} engine verifies one speculative step per host round trip")

    def free(self, handle: int) -> None:
        raise NotImplementedError

    def length(self, handle: int) -> int:
        raise NotImplementedError


# ----------------------------------------------------------------------------- paged
def _accepts(fn, name: str) -> bool:
    return name in inspect.signature(fn).parameters


def _hidden_last(want_hidden) -> int | None:
    """``want_hidden`` -> how many trailing prompt hidden states to return (None = all).

    ``True`` means all; a positive int ``k`` the last ``k``. Raises ValueError otherwise."""
    if isinstance(want_hidden, (bool, np.bool_)) and want_hidden:
        return None
    if isinstance(want_hidden, (int, np.integer)) and not isinstance(want_hidden, bool) and want_hidden >= 1:
        return int(want_hidden)
    raise ValueError(f"want_hidden must be False, True or a positive int, got {want_hidden!r}")


#: Bounds of ``auto_prefill_chunk`` on a GPU.
PREFILL_CHUNK_MIN, PREFILL_CHUNK_MAX = 256, 16384


def auto_prefill_chunk(prompt_tokens: int, backend: str | None = None) -> int:
    """Prompt tokens per prefill step of the paged engine for a prompt of ``prompt_tokens``.

    On a GPU (the engine prefills with the Pallas kernels, whose cost follows the positions):
    ``prompt_tokens // 8`` clamped to ``[256, 16384]`` — large chunks cut the fixed costs per chunk
    (one cache-view gather and one set of kernel launches per layer) and give the kernels enough
    query rows (BENCHMARKS.md, issue 8: a 1M-token prompt takes ~64 steps with 16384-token chunks, where
    256-token chunks would run ~4000). Elsewhere 256: the XLA
    reference ops materialise ``[chunk, S]`` scores, so small chunks bound their memory.
    ``backend`` defaults to ``jax.default_backend()``.
    """
    import jax

    if (backend or jax.default_backend()) != "gpu":
        return PREFILL_CHUNK_MIN
    return max(PREFILL_CHUNK_MIN, min(PREFILL_CHUNK_MAX, int(prompt_tokens) // 8))


class PagedBackend(Backend):
    """``DecodeEngine`` wrapper. Hidden states (for MTP drafting) need an engine whose ``prefill`` /
    ``decode_step`` accept ``return_hidden=True``; otherwise asking for them raises EngineUnavailable.

    Defaults follow ``DecodeEngine``: decode and prefill ``"auto"`` (the GPU kernels on a GPU, the
    XLA reference ops on CPU; ``minimax_jax.ops.implementation_report()`` says what ran) and
    ``prefill_widths="auto"``.

    Chunked-prefill progress: the engine has no per-chunk callback, so a subclass counts the
    tokens of every ``"gather"`` step it runs (``on_tokens``). Prefill asks the engine for the last
    prompt position's logits only (``DecodeEngine.prefill`` default).
    """

    name = "paged"

    def __init__(self, params, cfg: ModelConfig, *, max_seqs: int, max_len: int, prefill_chunk: int = 256,
                 implementation: str = "auto", prefill_implementation: str = "auto", prefix_cache: bool = True,
                 kv_dtype: str | None = None, prefill_widths: str = "auto", query_rows: int | None = None):
        from minimax_jax.decode.engine import DecodeEngine

        class _CountingEngine(DecodeEngine):
            on_tokens = None

            def _run(self, tokens, positions, path, *args, **kw):
                out = super()._run(tokens, positions, path, *args, **kw)
                if path == "gather" and self.on_tokens is not None:
                    self.on_tokens(int((np.asarray(positions) >= 0).sum()))
                return out

        self.cfg = cfg
        self.engine = _CountingEngine(params, cfg, max_seqs=max_seqs, max_len=max_len, prefill_chunk=prefill_chunk,
                                      implementation=implementation, prefill_implementation=prefill_implementation,
                                      prefix_cache=prefix_cache, kv_dtype=kv_dtype, prefill_widths=prefill_widths,
                                      query_rows=query_rows)
        self.supports_hidden = self.engine_returns_hidden()
        self.max_seqs, self.max_len = max_seqs, max_len

    @staticmethod
    def engine_returns_hidden() -> bool:
        """Whether ``DecodeEngine.prefill`` and ``decode_step`` accept ``return_hidden=``."""
        from minimax_jax.decode.engine import DecodeEngine

        return _accepts(DecodeEngine.prefill, "return_hidden") and _accepts(DecodeEngine.decode_step, "return_hidden")

    def describe(self) -> str:
        e = self.engine
        return (f"paged (DecodeEngine: page_size={e.page_size}, prefill_chunk={e.prefill_chunk}, "
                f"decode impl={e.implementation}, prefill impl={e.prefill_implementation}, "
                f"prefill widths={e.prefill_widths}, decode rows={e.query_rows or 'per step'}, "
                f"slots={self.max_seqs}, max_len={self.max_len})")

    def _need_hidden(self):
        if not self.supports_hidden:
            raise EngineUnavailable(
                "the paged decode engine (minimax_jax.decode.DecodeEngine) does not return hidden states "
                "(no return_hidden= in prefill/decode_step), which MTP speculative decoding needs; "
                "run without --speculative, or with --engine recompute")

    def prefill(self, prompts, *, want_hidden=False, on_tokens=None):
        self.engine.on_tokens = on_tokens
        try:
            if want_hidden:
                self._need_hidden()
                slots, logits, hidden = self.engine.prefill(prompts, return_hidden=True,
                                                            hidden_last=_hidden_last(want_hidden))
                hidden = [np.asarray(h) for h in hidden]
            else:
                slots, logits = self.engine.prefill(prompts)
                hidden = None
        finally:
            self.engine.on_tokens = None
        for s, p, lg in zip(slots, prompts, logits):
            if len(lg) == 0:
                raise RuntimeError(f"engine returned no logits for a prompt of length {len(p)}")
        if want_hidden:
            for s, p, h in zip(slots, prompts, hidden):
                if not 1 <= len(h) <= len(p):
                    raise EngineUnavailable(
                        f"engine returned hidden states for {len(h)} of {len(p)} prompt tokens; MTP drafting "
                        "needs those of the last prompt tokens (at least one)")
        return list(slots), np.stack([np.asarray(lg[-1]) for lg in logits]), hidden

    def step(self, handles, tokens, *, num_tokens=None, want_hidden=False):
        if want_hidden:
            self._need_hidden()
            logits, hidden = self.engine.decode_step(tokens, handles, num_tokens, return_hidden=True)
            return np.asarray(logits), np.asarray(hidden)
        return np.asarray(self.engine.decode_step(tokens, handles, num_tokens)), None

    def greedy(self, handles, tokens, steps):
        return self.engine.decode_greedy(tokens, handles, steps)

    def speculative_greedy(self, handles, tokens, iters, mtp, window, num_draft):
        return self.engine.decode_speculative_greedy(tokens, handles, iters, mtp, window, num_draft)

    def truncate(self, handle, length):
        self.engine.truncate(handle, length)

    def free(self, handle):
        self.engine.free(handle)

    def length(self, handle):
        return self.engine.length(handle)


# ----------------------------------------------------------------------------- recompute
def _bucket(n: int) -> int:
    """Padded length: multiples of 32 up to 256, then powers of two (bounded recompilation)."""
    return 32 * math.ceil(n / 32) if n <= 256 else 1 << (n - 1).bit_length()


class RecomputeBackend(Backend):
    """Full forward pass over each sequence at every step (the oracle engine; no cache).

    Sequences are right-padded to a bucketed length; padding is its own segment so it never mixes
    with real tokens.
    """

    name = "recompute"
    supports_hidden = True

    def __init__(self, params, cfg: ModelConfig, *, max_seqs: int, max_len: int):
        from minimax_jax.model.transformer import forward

        self.params, self.cfg, self.max_seqs, self.max_len = params, cfg, max_seqs, max_len
        self.seqs: dict[int, list[int]] = {}
        self._next = 0

        @jax.jit
        def run(params, tokens, segs):
            out = forward(params, cfg, tokens, segment_ids=segs, return_hidden=True)
            return out.logits, out.hidden

        self._run = run

    def describe(self) -> str:
        return f"recompute (full forward per step, no KV cache; slots={self.max_seqs}, max_len={self.max_len})"

    def _forward(self, seqs: Sequence[list[int]]):
        t = _bucket(max(len(s) for s in seqs))
        toks = np.zeros((len(seqs), t), np.int32)
        segs = np.ones((len(seqs), t), np.int32)
        for i, s in enumerate(seqs):
            toks[i, :len(s)] = s
            segs[i, :len(s)] = 0
        logits, hidden = self._run(self.params, jnp.asarray(toks), jnp.asarray(segs))
        return np.asarray(logits), np.asarray(hidden)

    def prefill(self, prompts, *, want_hidden=False, on_tokens=None):
        k = _hidden_last(want_hidden) if want_hidden else None
        if len(self.seqs) + len(prompts) > self.max_seqs:
            raise RuntimeError(f"all {self.max_seqs} sequence slots are in use")
        handles = []
        for p in prompts:
            if not 1 <= len(p) <= self.max_len:
                raise ValueError(f"prompt length {len(p)} not in [1, max_len={self.max_len}]")
            self.seqs[self._next] = [int(t) for t in p]
            handles.append(self._next)
            self._next += 1
        logits, hidden = self._forward([self.seqs[h] for h in handles])
        if on_tokens is not None:
            on_tokens(sum(len(p) for p in prompts))
        last = np.stack([logits[i, len(p) - 1] for i, p in enumerate(prompts)])
        hid = None
        if want_hidden:
            hid = [hidden[i, (0 if k is None else max(0, len(p) - k)):len(p)] for i, p in enumerate(prompts)]
        return handles, last, hid

    def step(self, handles, tokens, *, num_tokens=None, want_hidden=False):
        tokens = np.asarray(tokens)
        q = tokens.shape[1]
        counts = [q] * len(handles) if num_tokens is None else [int(n) for n in num_tokens]
        for h, row, n in zip(handles, tokens, counts):
            if len(self.seqs[h]) + n > self.max_len:
                raise ValueError(f"sequence {h}: length {len(self.seqs[h]) + n} exceeds max_len {self.max_len}")
            self.seqs[h].extend(int(t) for t in row[:n])
        logits, hidden = self._forward([self.seqs[h] for h in handles])
        v, hd = logits.shape[-1], hidden.shape[-1]
        out_l = np.zeros((len(handles), q, v), np.float32)
        out_h = np.zeros((len(handles), q, hd), hidden.dtype)
        for i, (h, n) in enumerate(zip(handles, counts)):
            end = len(self.seqs[h])
            out_l[i, :n] = logits[i, end - n:end]
            out_h[i, :n] = hidden[i, end - n:end]
        return out_l, (out_h if want_hidden else None)

    def truncate(self, handle, length):
        if not 0 <= length <= len(self.seqs[handle]):
            raise ValueError(f"truncate length {length} not in [0, {len(self.seqs[handle])}]")
        del self.seqs[handle][length:]

    def free(self, handle):
        del self.seqs[handle]

    def length(self, handle):
        return len(self.seqs[handle])


def make_backend(engine: str, params, cfg: ModelConfig, *, max_seqs: int, max_len: int, **options) -> Backend:
    """Build the named engine (``ENGINES``). ``options`` go to ``PagedBackend`` (prefill_chunk,
    implementation, prefill_implementation, prefix_cache, kv_dtype, prefill_widths, query_rows). Raises
    ValueError for an unknown name."""
    if engine == "paged":
        return PagedBackend(params, cfg, max_seqs=max_seqs, max_len=max_len, **options)
    if engine == "recompute":
        if options:
            raise ValueError(f"the recompute engine takes no options, got {sorted(options)}")
        return RecomputeBackend(params, cfg, max_seqs=max_seqs, max_len=max_len)
    raise ValueError(f"unknown engine {engine!r}; choose one of {ENGINES}")
