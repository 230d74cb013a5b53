"""Continuous batching over the paged decode engine, in one worker thread.

Each ``Sequence`` is one generated choice (a request with ``n`` choices submits ``n``). The worker
loop, per iteration: drops cancelled sequences (their slots and pages are freed), admits waiting
sequences into free engine slots (``DecodeEngine.prefill_start``: prefix-cache lookup, pages; a
sequence is admitted only while the page pool can hold every admitted sequence's prompt +
``max_tokens``), advances the admitted prompts' prefill by ONE chunk (``prefill_advance``; at most
``token_budget`` tokens per iteration counting one per decoding sequence, at least one), then runs ONE
decode step over the sequences whose prefill is done - so running streams keep decoding while a long
prompt is prefilled.
Token choice, stop rules and log-probabilities are those of the generation loop
(``minimax_jax.infer.sampler.RowSampler`` keyed by (seed, row id, step), ``minimax_jax.stopping``,
``token_logprobs``), so a greedy sequence gets the tokens ``Generator.generate`` gives its prompt.
Penalties and logit bias (``minimax_jax.infer.penalties``) are per sequence: each row of a batch
step is adjusted with its own settings and its own generated tokens before its token is chosen.
Prefix reuse is the engine's prefix cache (full pages shared by content hash across requests).
With ``speculative="mtp"`` the decode step is ``minimax_jax.serve.speculative.MTPStep`` (MTP drafts
verified in the same batched step; greedy output unchanged). With ``decode_loop = n > 1`` (multi-step
scheduling) an iteration with nobody waiting or prefilling, whose decoding sequences are all greedy without
penalties, logit bias or log-probabilities, runs ``n`` decode steps in one compiled device loop
(``DecodeEngine.decode_greedy``, or ``decode_speculative_greedy`` with ``speculative``: one host round trip
for ``n`` steps; the tokens of ``n`` single steps), and streams them after the loop; any other iteration runs
one step as before, so admission and prefill never wait for a loop.

Events go to ``Sequence.emit`` (called on the worker thread; the HTTP side bridges it to asyncio):
``{"type": "token", "text": delta, "logprobs": [entry...]}``, then one ``{"type": "done", ...}`` or
``{"type": "error", "message": ...}``. Back-pressure: ``submit`` raises ``QueueFull`` when more than
``max_queue`` sequences wait.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import threading
import time
from typing import Callable

import numpy as np

from minimax_jax.decode.pages import PagePoolExhausted
from minimax_jax.infer.generation import GenerationConfig, Generator
from minimax_jax.infer.penalties import PenaltyTracker, apply_logit_bias
from minimax_jax.infer.sampler import RowSampler, SamplingParams, token_logprobs
from minimax_jax.serve.speculative import MTPStep
from minimax_jax.stopping import StopChecker, StopConfig

__all__ = ["QueueFull", "Scheduler", "Sequence"]


class QueueFull(RuntimeError):
    """More sequences wait than the scheduler's ``max_queue``."""


@dataclasses.dataclass(eq=False)
class Sequence:
    """One choice to generate. ``logprobs``: None = off, k >= 0 = the chosen token's log-probability
    plus the k most likely tokens'. ``row_id`` keys the random draws (choice index, as ``infer.py``'s
    sample index). ``ignore_eos``: stop tokens do not end it (only ``max_tokens`` and stop strings).
    Penalties: ``sampling``'s; ``logit_bias``: None or (token ids, biases) (``apply_logit_bias``)."""

    prompt: list
    max_tokens: int
    sampling: SamplingParams
    emit: Callable[[dict], None]
    row_id: int = 0
    stop_strings: tuple = ()
    logprobs: int | None = None
    ignore_eos: bool = False
    logit_bias: tuple | None = None
    cancelled: bool = False
    # worker state
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    handle: int | None = None
    pending: int = 0
    drawn: int = 0
    ids: list = dataclasses.field(default_factory=list)
    streamed: int = 0
    cached_tokens: int = 0
    last_token_at: float = 0.0
    checker: StopChecker | None = None
    sampler: RowSampler | None = None
    penalties: PenaltyTracker | None = None
    rng: np.random.Generator | None = None      # speculative sampling's draws

    def adjust(self, logits: np.ndarray) -> np.ndarray:
        """This sequence's penalties and logit bias applied to its next-token logits ``[1, V]``."""
        x = logits
        if self.penalties is not None:
            x = self.penalties.apply(x, [0], **self.sampling.penalties())
        if self.logit_bias is not None:
            x = apply_logit_bias(x, *self.logit_bias)
        return x

    @property
    def loopable(self) -> bool:
        """Whether the next tokens are plain greedy choices (no penalties, logit bias or log-probabilities), so
        a device loop can pick them."""
        return (self.sampling.greedy and self.penalties is None and self.logit_bias is None and self.logprobs is None
                and not self.cancelled)

    def cancel(self) -> None:
        """Ask the worker to drop this sequence (thread-safe: a flag read between steps)."""
        self.cancelled = True


class Scheduler:
    """The batching loop over a ``Generator``'s paged engine.

    Args:
      generator: ``minimax_jax.infer.Generator`` (engine "paged"); its engine is built here with
        ``max_batch`` slots of ``max_len`` tokens (``Generator.reserve``; max_len rounded up to a power
        of two, capped at the model's context).
      max_queue: waiting sequences before ``submit`` raises QueueFull.
      token_budget: tokens per iteration (decode tokens + prefill tokens); None = one prefill chunk
        per prefilling sequence on top of the decode tokens.
      metrics: ``minimax_jax.serve.metrics.Metrics`` or None.
      speculative: None or "mtp" (``MTPStep``: ``num_draft`` drafts per step, default all MTP modules;
        ``mtp_window`` positions the MTP layers attend over).
      decode_loop: greedy decode steps per device loop (module docstring; 1 = one step per iteration); with
        ``speculative`` greedy speculative steps (``MTPStep.loop``).
    Raises: ValueError (bad sizes / engine / method), InferenceError (no MTP modules, no hidden states).
    """

    def __init__(self, generator: Generator, *, max_batch: int, max_len: int, max_queue: int = 64,
                 token_budget: int | None = None, metrics=None, speculative: str | None = None,
                 num_draft: int | None = None, mtp_window: int = 64, mesh=None, decode_loop: int = 1):
        if generator.engine != "paged":
            raise ValueError(f"the server needs the paged engine, got {generator.engine!r}")
        self.gen = generator
        self.mesh = mesh
        with self._on_mesh():
            generator.reserve(max_batch, max_len)
        self.backend = generator.backend
        self.engine = self.backend.engine
        self.max_len = self.backend.max_len
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.metrics = metrics
        if token_budget is not None and token_budget < 1:
            raise ValueError(f"token_budget must be >= 1 or None, got {token_budget}")
        self.token_budget = token_budget
        self.stop_ids = generator.stop_ids(GenerationConfig())
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._active: list[Sequence] = []          # decoding
        self._prefilling: list[Sequence] = []      # admitted, prompt not fully computed yet
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        if speculative not in (None, "mtp"):
            raise ValueError(f"speculative must be None or 'mtp', got {speculative!r}")
        if isinstance(decode_loop, bool) or not isinstance(decode_loop, int) or decode_loop < 1:
            raise ValueError(f"decode_loop must be an int >= 1, got {decode_loop!r}")
        self.decode_loop = decode_loop
        self.mtp = None if speculative is None else MTPStep(self, num_draft, mtp_window)
        # tokens written past a sequence's end: the drafts of a step before truncation, or a loop's tokens past
        # the sequence's last token
        k = 0 if self.mtp is None else self.mtp.k
        self._extra = max(k, decode_loop * (1 + k) - 1)

    def _on_mesh(self):
        """``sharding.use_mesh`` of ``mesh`` (thread-local: entered where the engine is built and in the worker
        thread that runs its steps), or a null context."""
        if self.mesh is None:
            return contextlib.nullcontext()
        from minimax_jax.sharding import use_mesh

        return use_mesh(*self.mesh)

    # ------------------------------------------------------------------ control
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="minimax-serve-worker", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def warm_up(self, vocab: int, timeout_s: float = 600.0) -> int:
        """Compile the engine's steps before serving, so that the first requests pay no compile time: the prefill
        step at every page-table width a prompt up to ``max_len`` uses (``DecodeEngine.compile_prefill``, all
        padding, no slot touched; with MTP drafting also its variant returning hidden states), then, one at a
        time, a greedy request (its second token from a device loop when ``decode_loop > 1``), a sampled one
        (temperature 1, never looped: the one-step decode) and, with MTP drafting, one with a repetition penalty
        (decoded without drafts); two new tokens each, prompts of random ids in ``[0, vocab)``, not counted by the
        metrics. Call after ``start`` and before serving.

        Returns the number of requests run. Raises RuntimeError when the worker is not running, or naming the
        request that failed or did not finish within ``timeout_s`` seconds."""
        if not self.alive:
            raise RuntimeError("warm_up needs a started scheduler (start() first; the worker is not running)")
        self.engine.compile_prefill()
        if self.mtp is not None:
            self.engine.compile_prefill(return_hidden=True)
        n = max(1, min(8, self.max_len - 2 - self._extra))
        runs = [("greedy", SamplingParams()), ("sampled", SamplingParams(temperature=1.0))]
        if self.mtp is not None:
            runs.append(("penalised", SamplingParams(repetition_penalty=1.1)))
        rng = np.random.default_rng(0)
        metrics, self.metrics = self.metrics, None
        try:
            for label, params in runs:
                done, errors = threading.Event(), []

                def emit(ev, done=done, errors=errors):
                    if ev["type"] == "error":
                        errors.append(ev.get("message"))
                    if ev["type"] in ("error", "done"):
                        done.set()
                what = f"{label} warm-up request"
                self.submit([Sequence(rng.integers(0, vocab, n).tolist(), 2, params, emit, ignore_eos=True)])
                if not done.wait(timeout_s):
                    raise RuntimeError(f"{what} did not finish within {timeout_s:g} s")
                if errors:
                    raise RuntimeError(f"{what} failed: {errors[0]}")
        finally:
            self.metrics = metrics
        return len(runs)

    def submit(self, seqs: list[Sequence]) -> None:
        """Queue sequences (all or none). Raises QueueFull."""
        with self._cv:
            if len(self._waiting) + len(seqs) > self.max_queue:
                raise QueueFull(f"server busy: {len(self._waiting)} sequences already wait (max_queue "
                                f"{self.max_queue}); retry later")
            for s in seqs:
                stop_ids = frozenset() if s.ignore_eos else self.stop_ids
                s.checker = StopChecker(StopConfig(stop_ids, tuple(s.stop_strings), s.max_tokens))
                s.sampler = RowSampler(s.sampling)
                s.rng = np.random.default_rng([s.sampling.seed, s.row_id])
                if s.sampling.has_penalties:
                    s.penalties = PenaltyTracker(self.gen.cfg.vocab_size)
                    s.penalties.start(0, s.prompt)
            self._waiting.extend(seqs)
            self._cv.notify_all()
        self._gauges()

    @property
    def queue_length(self) -> int:
        return len(self._waiting)

    @property
    def active_count(self) -> int:
        """Admitted sequences (prefilling or decoding)."""
        return len(self._active) + len(self._prefilling)

    def free_slots(self) -> int:
        return sum(s is None for s in self.engine.seqs)

    # ------------------------------------------------------------------ loop
    def _loop(self) -> None:
        try:
            with self._on_mesh():
                self._serve()
        except BaseException as e:   # the worker must not die silently: fail everything in flight
            self.error = e
            for s in list(self._active) + list(self._prefilling) + list(self._waiting):
                s.emit({"type": "error", "message": f"engine failure: {type(e).__name__}: {e}"})
            raise
        finally:
            for s in list(self._active) + list(self._prefilling):
                self._release(s)

    def _serve(self) -> None:
        """The worker's loop: admit, advance prefills, decode, until ``stop``."""
        while True:
            with self._cv:
                while not self._stopping and not self._waiting and not self._active and not self._prefilling:
                    self._cv.wait(0.5)
                if self._stopping:
                    break
            self._drop_cancelled()
            self._admit()
            if self._prefilling:
                self._advance()
            if self._active:
                self._step()
            self._gauges()

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.set_state(queue=len(self._waiting), active=self.active_count,
                                   free_pages=self.engine.pool.num_free, cached_pages=self.engine.pool.num_cached)

    def _release(self, s: Sequence) -> None:
        if s in self._active:
            self._active.remove(s)
        if s in self._prefilling:
            self._prefilling.remove(s)
        if s.handle is not None:
            if self.mtp is not None:
                self.mtp.drafter.drop(s.handle)
            self.backend.free(s.handle)
            s.handle = None

    def _fail(self, rows, what: str, e: Exception) -> None:
        """End ``rows`` with an error event (their slots freed); the server keeps serving the others."""
        for s in rows:
            self._release(s)
            s.emit({"type": "error", "message": f"{what} failed: {type(e).__name__}: {e}"})
            if self.metrics is not None:
                self.metrics.finished("error")

    def _drop_cancelled(self) -> None:
        for s in [s for s in self._active + self._prefilling if s.cancelled]:
            self._release(s)
            if self.metrics is not None:
                self.metrics.finished("cancelled")
        with self._cv:
            gone = [s for s in self._waiting if s.cancelled]
            for s in gone:
                self._waiting.remove(s)
        if self.metrics is not None:
            for _ in gone:
                self.metrics.finished("cancelled")

    def _pages(self, tokens: int) -> int:
        return math.ceil(tokens / self.engine.page_size)

    def _admit(self) -> None:
        slots = self.free_slots()
        # pages the active sequences may still need to reach prompt + max_tokens
        owed = sum(max(0, self._pages(len(s.prompt) + s.max_tokens + self._extra)
                       - len(self.engine.seqs[s.handle].pages))
                   for s in self._active + self._prefilling)
        budget = self.engine.pool.num_free - owed
        take: list[Sequence] = []
        with self._cv:
            while self._waiting and len(take) < slots:
                s = self._waiting[0]
                need = self._pages(len(s.prompt) + s.max_tokens + self._extra)
                if need > budget:
                    break      # wait for pages to come back
                budget -= need
                take.append(self._waiting.popleft())
        for s in take:
            try:
                hidden_last = self.mtp.drafter.window if self.mtp is not None and self.mtp.drafts(s) else 0
                s.handle = self.engine.prefill_start(s.prompt, hidden_last=hidden_last)
            except Exception as e:
                s.emit({"type": "error", "message": f"prefill failed: {type(e).__name__}: {e}"})
                if self.metrics is not None:
                    self.metrics.finished("error")
                continue
            s.cached_tokens = self.engine.seqs[s.handle].cached_tokens
            self._prefilling.append(s)

    def _advance(self) -> None:
        """One prefill chunk over the prefilling sequences (oldest first) under the token budget."""
        rows = list(self._prefilling)
        budget = None if self.token_budget is None else max(1, self.token_budget - len(self._active))
        try:
            done = self.engine.prefill_advance([s.handle for s in rows], budget)
        except Exception as e:
            self._fail(rows, "prefill", e)
            return
        finished = [s for s in rows if s.handle in done]
        if not finished:
            return
        now = time.perf_counter()
        for s in finished:
            self._prefilling.remove(s)
            self._active.append(s)
            if self.metrics is not None:
                self.metrics.admitted(len(s.prompt), s.cached_tokens, now - s.arrival)
        logits = []
        for s in finished:
            out = done[s.handle]
            if isinstance(out, tuple):      # a drafting sequence (speculative): its prompt's last hidden states
                out, hidden = out
                self.mtp.drafter.start(s.handle, s.prompt, hidden)
            logits.append(out[0])
        self._choose_and_emit(finished, np.stack(logits))

    def _step(self) -> None:
        rows = list(self._active)
        # a device loop only where nobody waits or is prefilled (they would wait for it) and every row is greedy
        loop = (self.decode_loop > 1 and not self._waiting and not self._prefilling
                and all(s.loopable for s in rows))
        if self.mtp is not None:
            try:
                if not (loop and self.mtp.loop(rows, self.decode_loop)):
                    self.mtp.step(rows)
            except Exception as e:
                self._fail([s for s in rows if s.handle is not None], "speculative decode step", e)
            return
        if loop and self._decode_loop(rows):
            return
        toks = np.array([[s.pending] for s in rows], np.int32)
        try:
            logits, _ = self.backend.step([s.handle for s in rows], toks)
        except Exception as e:     # e.g. PagePoolExhausted: fail this batch, keep serving
            self._fail(rows, "decode step", e)
            return
        self._choose_and_emit(rows, logits[:, 0])

    def _decode_loop(self, rows: list[Sequence]) -> bool:
        """``decode_loop`` greedy steps over ``rows`` (all ``loopable``) in one device loop when every row has
        room; False (nothing done) otherwise or when the page pool cannot hold a loop's pages right now (the
        caller then runs one step)."""
        n = self.decode_loop
        if any(self.engine.length(s.handle) + n > self.max_len for s in rows):
            return False
        try:
            chosen = self.backend.greedy([s.handle for s in rows], np.array([s.pending for s in rows], np.int32), n)
        except PagePoolExhausted:       # reserved all-or-nothing: nothing was written
            return False
        except Exception as e:
            self._fail(rows, "decode loop", e)
            return True
        for s, toks in zip(rows, chosen):
            s.pending = int(toks[-1])
            self._emit_tokens(s, [int(t) for t in toks], None)
        return True

    # ------------------------------------------------------------------ tokens
    def _choose_and_emit(self, rows: list[Sequence], logits: np.ndarray) -> None:
        """Choose (adjusted, ``Sequence.adjust``) and emit one token per row from ``logits [n, V]``."""
        for i, s in enumerate(rows):
            x = logits[i:i + 1]
            tok = int(s.sampler.choose(s.adjust(x), [s.row_id], [s.drawn])[0])
            s.pending = tok
            self._emit_tokens(s, [tok], x)

    def _emit_tokens(self, s: Sequence, toks: list[int], logits: np.ndarray | None) -> None:
        """Emit ``toks`` (chosen from ``logits [len(toks), V]``, row by row; None where no log-probabilities
        are asked) until the sequence ends."""
        now = time.perf_counter()
        for tok, row in zip(toks, [None] * len(toks) if logits is None else logits):
            s.drawn += 1
            entry = None if s.logprobs is None else self._logprob_entry(row, tok, s.logprobs)
            if self.metrics is not None:
                self.metrics.token(None if s.drawn == 1 else now - s.last_token_at)
            s.last_token_at = now
            if self._emit(s, tok, entry):
                return

    def _logprob_entry(self, row: np.ndarray, tok: int, k: int) -> dict:
        lp = float(token_logprobs(row[None], [tok])[0])
        ids = np.argsort(-np.asarray(row, np.float64), kind="stable")[:k]
        top = token_logprobs(np.repeat(row[None], len(ids), 0), ids) if k else []
        return {"id": tok, "logprob": lp, "top": [(int(t), float(v)) for t, v in zip(ids, top)]}

    def _emit(self, s: Sequence, tok: int, entry: dict | None) -> bool:
        """The generation loop's emission rule: stop tokens are not part of the output; text that may
        still become a stop string is held back. True when the sequence is finished (released)."""
        ck = s.checker
        res = ck.update(tok, self.gen._text(s.ids + [tok]))
        entries = []
        if res is None or res.reason != "stop_token":
            s.ids.append(tok)
            if s.penalties is not None:
                s.penalties.add(0, tok)
            if entry is not None:
                entries.append(entry)
        text = ck.emittable_text()
        delta = text[s.streamed:] if len(text) > s.streamed else ""
        s.streamed = max(s.streamed, len(text))
        if delta or entries:
            s.emit({"type": "token", "text": delta, "logprobs": entries})
        if res is not None:
            self._release(s)
            reason = "length" if res.reason == "length" else "stop"
            if self.metrics is not None:
                self.metrics.finished(reason)
            s.emit({"type": "done", "finish_reason": reason, "stop_reason": res.reason, "text": res.text,
                    "tokens": list(s.ids[:res.num_tokens]), "prompt_tokens": len(s.prompt),
                    "cached_tokens": s.cached_tokens})
        return res is not None
