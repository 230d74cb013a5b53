"""The generation loop: batched prompts of different lengths, sampling, stops, streaming,
optional MTP speculative decoding, statistics.

Invariant of the loop, per row: the engine's cache holds every token up to position ``n - 1`` and
one sampled token ``x_n`` is *pending* (already emitted, not yet fed). A plain step feeds the pending
token (``Q = 1``) and samples the next. A speculative step drafts ``k`` tokens after ``x_n`` with the
MTP modules, feeds ``[x_n, d_1..d_k]`` in ONE step (``Q = 1 + k`` rows), keeps the accepted drafts
(``minimax_jax.infer.speculative``), truncates the cache after them, and the correction / bonus
token becomes the new pending token. With ``decode_loop > 1`` (greedy) both kinds of step run that many
times in one compiled device loop per host round trip (``loop_step``, ``spec_loop_step``).

Usage::

    gen = Generator(cfg, params, tokenizer)                       # engine="paged" by default
    out = gen.generate([[1, 5, 9], [1, 7]], GenerationConfig(max_new_tokens=32))
    out.sequences[0].tokens, out.sequences[0].text, out.stats.summary()
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import numpy as np

from minimax_jax.config import ModelConfig
from minimax_jax.infer.backends import ENGINES, Backend, make_backend
from minimax_jax.infer.drafter import MAX_MTP_WINDOW
from minimax_jax.infer.errors import ContextTooLong, EngineUnavailable, InferenceError
from minimax_jax.infer.metrics import CompileClock, GenerationStats, Timer
from minimax_jax.infer.penalties import PenaltyTracker
from minimax_jax.infer.sampler import RowSampler, SamplingParams, token_logprobs
from minimax_jax.infer.speculative import accept_greedy, accept_sampled
from minimax_jax.stopping import StopChecker, StopConfig

__all__ = ["GenerationConfig", "GenerationOutput", "Generator", "SequenceResult", "check_context"]

SPECULATIVE_METHODS = ("mtp",)
EOS_TEXT = "[e~["


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """What to generate.

    ``stop_token_ids``: None = the model's ``eos_token_id`` plus the tokenizer's ``[e~[`` id; ``()``
    = never stop on a token. ``stop_strings`` need a tokenizer. ``repeat_max_period`` /
    ``repeat_max_count``: stop on a token cycle (``minimax_jax.stopping``). ``speculative``: None or
    "mtp"; ``num_draft`` drafts per step (default: all MTP modules); ``mtp_window``: positions the
    MTP layers attend over while drafting. ``logprobs``: record each generated token's log-probability
    under the model (``SequenceResult.logprobs``). Penalties (``sampling``) need plain decoding.
    ``decode_loop``: greedy decoding runs this many steps in one compiled device loop per host round trip
    (1 = one step per round trip): plain steps (the paged engine's ``decode_greedy``) or, with
    ``speculative``, speculative steps that draft, verify and accept on the device
    (``decode_speculative_greedy``). The same tokens (and drafts accepted) as one step at a time (tested on
    the CPU; up to the loop's compiled rounding), delivered (and stop conditions checked) per loop; a row
    that stops inside a loop discards the loop's later tokens. Needs greedy sampling without penalties or
    logprobs.
    """

    max_new_tokens: int = 128
    sampling: SamplingParams = SamplingParams()
    stop_strings: tuple = ()
    stop_token_ids: tuple | None = None
    repeat_max_period: int = 0
    repeat_max_count: int = 0
    speculative: str | None = None
    num_draft: int | None = None
    mtp_window: int = 64
    logprobs: bool = False
    decode_loop: int = 1

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if isinstance(self.decode_loop, bool) or not isinstance(self.decode_loop, int) or self.decode_loop < 1:
            raise ValueError(f"decode_loop must be an int >= 1, got {self.decode_loop!r}")
        if self.decode_loop > 1:
            why = [w for w, bad in (("sampling (temperature > 0)", not self.sampling.greedy),
                                    ("penalties", self.sampling.has_penalties), ("logprobs", self.logprobs)) if bad]
            if why:
                raise ValueError(f"decode_loop > 1 runs greedy decoding (temperature 0, plain or speculative) on "
                                 f"the device; it cannot serve {', '.join(why)}")
        if isinstance(self.mtp_window, bool) or not isinstance(self.mtp_window, int) \
                or not 1 <= self.mtp_window <= MAX_MTP_WINDOW:
            raise ValueError(f"mtp_window must be an int in [1, {MAX_MTP_WINDOW}], got {self.mtp_window!r}")
        if self.speculative not in (None,) + SPECULATIVE_METHODS:
            raise ValueError(f"speculative must be None or one of {SPECULATIVE_METHODS}, got {self.speculative!r}")
        if self.speculative is not None and self.sampling.has_penalties:
            raise ValueError("repetition / presence / frequency penalties need plain decoding; "
                             "drop them or the speculative decoding")
        # the stop rules' own checks (empty stop strings, half-set repetition limits), here so that a
        # bad flag fails before the model loads rather than at the first generate()
        StopConfig((), self.stop_strings, self.max_new_tokens, self.repeat_max_period, self.repeat_max_count)

    def tokens_past_limit(self, num_draft: int = 0) -> int:
        """Cache room a row may need past its prompt + max_new_tokens: the tokens of one loop (a plain loop's
        ``decode_loop`` steps, or ``decode_loop`` speculative steps of ``1 + num_draft`` tokens each; pass
        ``num_draft`` = the drafter's drafts when ``speculative``, else 0)."""
        return self.decode_loop * (1 + num_draft)


@dataclasses.dataclass
class SequenceResult:
    """One prompt's output: generated ``tokens`` (a stop token excluded), ``text`` (trimmed at a stop
    string), ``stop_reason`` ("stop_token" | "stop_string" | "repetition" | "length" | "interrupted") and
    detail; ``logprobs``: one float per token with ``GenerationConfig.logprobs``, else None."""

    tokens: list
    text: str
    stop_reason: str
    stop_detail: object = None
    logprobs: list | None = None


@dataclasses.dataclass
class GenerationOutput:
    """``interrupted``: ``should_stop`` ended the call; unfinished rows have stop_reason "interrupted"."""

    sequences: list
    stats: GenerationStats
    interrupted: bool = False


class _Interrupted(Exception):
    """Raised between prefill chunks when ``should_stop`` says so."""


def _prompt_name(i: int, n: int) -> str:
    """How errors name prompt ``i`` of ``n``: "the prompt" when it is the only one, else "prompt i"."""
    return "the prompt" if n == 1 else f"prompt {i}"


def check_context(cfg: ModelConfig, prompt_lengths: Sequence[int], max_new_tokens: int | Sequence[int]) -> None:
    """Raise ContextTooLong (before any compute) when a prompt + max_new_tokens (one for all, or one
    per prompt) exceeds the context."""
    limit = cfg.max_position_embeddings
    per_line = not isinstance(max_new_tokens, int)      # from a prompts file: say where the value came from
    limits = list(max_new_tokens) if per_line else [max_new_tokens] * len(prompt_lengths)
    for i, (n, max_new_tokens) in enumerate(zip(prompt_lengths, limits)):
        if n + max_new_tokens > limit:
            over = n + max_new_tokens - limit
            if n < limit and over < n:   # either remedy works
                fix = f"shorten the prompt by {over} tokens or lower --max_new_tokens to at most {limit - n}"
            elif n < limit:              # max_new_tokens alone (nearly) fills the context
                fix = f"lower --max_new_tokens to at most {limit - n}"
            else:           # the prompt alone fills the context: only shortening it helps
                alone = "fills the context" if n == limit else f"is {n - limit} tokens over the context"
                fix = (f"the prompt alone {alone}, so it must be shortened: by {over} tokens to keep "
                       f"max_new_tokens={max_new_tokens}")
            if per_line and n < limit:
                fix += " (or that prompt's \"max_new_tokens\" in the prompts file)"
            raise ContextTooLong(
                f"{_prompt_name(i, len(prompt_lengths))} has {n} tokens; with max_new_tokens={max_new_tokens} that is {n + max_new_tokens} "
                f"> the model's context of {limit} tokens (max_position_embeddings); {fix}")


def _round_up_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class Generator:
    """Generation over one model with a reusable engine.

    Args:
      cfg, params: the model. tokenizer: ``tokenizers.Tokenizer`` (needed for text, stop strings and
        streaming; optional for token-only use).
      engine: "paged" (default, ``minimax_jax.decode``) or "recompute" (full forward per step).
      engine_options: passed to the paged engine (prefill_chunk, implementation, kv_dtype, ...).
      log: receives one-line messages (which engine is built).
    Raises: ValueError for an unknown engine.
    """

    def __init__(self, cfg: ModelConfig, params, tokenizer=None, *, engine: str = "paged",
                 engine_options: dict | None = None, log: Callable[[str], None] | None = None):
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; choose one of {ENGINES}")
        self.cfg, self.params, self.tokenizer = cfg, params, tokenizer
        self.engine = engine
        self.engine_options = dict(engine_options or {})
        self.log = log or (lambda _m: None)
        self.backend: Backend | None = None
        self._backend_key = None
        self._drafters: dict = {}

    # ------------------------------------------------------------------ setup
    def reserve(self, rows: int, max_len: int, speculative: bool = False) -> str:
        """Build (or grow) the engine now for ``rows`` sequences of up to ``max_len`` tokens (prompt +
        generated), so that later ``generate`` calls within that size reuse it; returns its description."""
        return self._get_backend(rows, max_len, speculative).describe()

    def _get_backend(self, n: int, max_len: int, speculative: bool) -> Backend:
        # Powers of two so later calls reuse the engine (and its compiled steps); never past the
        # model's context (speculative steps shorten their drafts near the end instead).
        max_len = min(_round_up_pow2(max(max_len, 64)), self.cfg.max_position_embeddings)
        key = (self.engine, speculative)
        b = self.backend
        if b is not None and self._backend_key == key and b.max_seqs >= n and b.max_len >= max_len:
            return b
        if b is not None and self._backend_key == key:   # grow, never shrink: no rebuild back and forth
            n, max_len = max(n, b.max_seqs), max(max_len, b.max_len)
        opts = dict(self.engine_options)
        if speculative and self.engine == "paged":
            opts["prefix_cache"] = False   # cached prefixes return no hidden states for the drafter
        self.backend = make_backend(self.engine, self.params, self.cfg, max_seqs=n, max_len=max_len, **opts)
        self._backend_key = key
        self.log(f"engine: {self.backend.describe()}")
        return self.backend

    def _drafter(self, config: GenerationConfig, longest: int):
        """The drafter for ``config``; its window is cut to the longest a row of this call can grow to
        (``longest`` tokens, rounded up to a power of two): a longer window would only hold padding."""
        from minimax_jax.infer.drafter import MTPDrafter

        window = min(config.mtp_window, _round_up_pow2(max(longest, 64)))
        key = (config.num_draft, window)
        if key not in self._drafters:
            self._drafters[key] = MTPDrafter(self.params, self.cfg, config.num_draft, window)
        return self._drafters[key]

    def stop_ids(self, config: GenerationConfig) -> frozenset:
        if config.stop_token_ids is not None:
            return frozenset(int(t) for t in config.stop_token_ids)
        ids = set() if self.cfg.eos_token_id is None else {self.cfg.eos_token_id}
        if self.tokenizer is not None and self.tokenizer.token_to_id(EOS_TEXT) is not None:
            ids.add(self.tokenizer.token_to_id(EOS_TEXT))
        return frozenset(ids)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special-token strings map to their ids; nothing is added)."""
        if self.tokenizer is None:
            raise InferenceError("text prompts need a tokenizer")
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def _text(self, ids) -> str:
        if self.tokenizer is None:
            return ""
        # Special tokens stay as text (tool-call tags); an unfinished UTF-8 sequence is held back.
        return self.tokenizer.decode(list(ids), skip_special_tokens=False).rstrip("\ufffd")

    # ------------------------------------------------------------------ main entry
    def generate(self, prompts: Sequence[Sequence[int]], config: GenerationConfig = GenerationConfig(), *,
                 on_text: Callable[[int, str], None] | None = None,
                 on_prefill_tokens: Callable[[int], None] | None = None, row_ids: Sequence[int] | None = None,
                 max_new_tokens: Sequence[int] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> GenerationOutput:
        """Generate for every prompt (token id lists of any lengths).

        Args:
          on_text: ``on_text(row, delta)`` with newly final text of a row as it is generated (text
            that may still become a stop string is held back until decided).
          on_prefill_tokens: called with the number of prompt tokens after each prefill chunk.
          row_ids: per prompt, the id its random draws are keyed by (default its index): a row's sampled
            tokens depend only on the seed, this id and its own history, so e.g. sample ``j`` of any
            prompt draws like row ``j`` of a call with that prompt alone.
          max_new_tokens: per prompt, overrides ``config.max_new_tokens``.
          should_stop: checked between prefill chunks and decode steps; once True the call returns
            what it has (``GenerationOutput.interrupted``). An engine interrupted mid-prefill is
            discarded (the next call builds a fresh one).
        Raises: ValueError (empty / out-of-vocabulary prompts), ContextTooLong, InferenceError /
          EngineUnavailable (speculative decoding not possible with this model or engine).
        """
        prompts = [[int(t) for t in p] for p in prompts]
        if not prompts:
            raise ValueError("no prompts")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"{_prompt_name(i, len(prompts))} is empty")
            bad = [t for t in p if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise ValueError(f"{_prompt_name(i, len(prompts))} has token ids outside "
                                 f"[0, {self.cfg.vocab_size}): {bad[:5]}")
        if config.stop_strings and self.tokenizer is None:
            raise InferenceError("stop strings need a tokenizer")
        limits = [config.max_new_tokens] * len(prompts) if max_new_tokens is None else [int(m) for m in max_new_tokens]
        row_ids = list(range(len(prompts))) if row_ids is None else [int(r) for r in row_ids]
        if len(limits) != len(prompts) or len(row_ids) != len(prompts) or min(limits) < 1:
            raise ValueError(f"max_new_tokens and row_ids need one entry per prompt ({len(prompts)}), "
                             "max_new_tokens >= 1")
        check_context(self.cfg, [len(p) for p in prompts], limits)
        if config.decode_loop > 1 and self.engine != "paged":
            raise EngineUnavailable(f"GenerationConfig.decode_loop > 1 needs the paged engine, not {self.engine!r}")
        spec = config.speculative is not None
        # room for a loop's tokens at the most drafts a drafter takes (15): the window bound need not be tight
        longest = max(len(p) + m for p, m in zip(prompts, limits)) + config.tokens_past_limit(15)
        drafter = self._drafter(config, longest) if spec else None
        k = drafter.num_draft if spec else 0
        rows = self.engine_options.get("query_rows")
        if spec and rows is not None and rows < 1 + k:
            raise ValueError(f"decode rows {rows} cannot hold a speculative step's 1 + {k} drafts; pad to >= {1 + k}")
        timer, clock = Timer(), CompileClock()
        slack = config.tokens_past_limit(k)     # the drafts of a step, or a loop's tokens past a row's limit
        backend = self._get_backend(len(prompts), max(len(p) + m for p, m in zip(prompts, limits)) + slack, spec)
        run = _Run(self, backend, prompts, config, drafter, on_text, limits, row_ids)
        run.stats.engine = backend.describe()
        if config.decode_loop > 1:
            run.stats.engine += f", decode loop={config.decode_loop}"

        def on_tokens(n):
            if on_prefill_tokens is not None:
                on_prefill_tokens(n)
            if should_stop is not None and should_stop():
                raise _Interrupted

        interrupted = should_stop is not None and should_stop()
        try:
            try:
                if not interrupted:
                    run.start(timer, clock, on_tokens)
            except _Interrupted:
                self.backend, interrupted = None, True   # its slots are mid-prefill: never reuse it
                run.handles = {}
            loop = config.decode_loop > 1
            step = ((run.spec_loop_step if loop else run.speculative_step) if spec
                    else run.loop_step if loop else run.plain_step)
            while run.active and not interrupted:
                if should_stop is not None and should_stop():
                    interrupted = True
                    break
                t0, w0, g0, s0 = time.perf_counter(), clock.now(), run.stats.generated_tokens, run.stats.decode_steps
                step()
                run.stats.add_step(time.perf_counter() - t0, run.stats.generated_tokens - g0, clock.since(w0) > 0,
                                   steps=run.stats.decode_steps - s0)
            run.stats.decode_s = max(0.0, timer.elapsed() - run.stats.ttft_s) if run.stats.ttft_s else 0.0
        finally:
            run.release()
        return GenerationOutput(run.results(), run.stats, interrupted)

    def generate_text(self, prompts: Sequence[str], config: GenerationConfig = GenerationConfig(), **kw
                      ) -> GenerationOutput:
        """``generate`` on text prompts (encoded with ``encode``)."""
        return self.generate([self.encode(p) for p in prompts], config, **kw)


class _Run:
    """State of one ``generate`` call (rows = prompt indices)."""

    def __init__(self, gen: Generator, backend: Backend, prompts, config: GenerationConfig, drafter, on_text,
                 limits: list[int], row_ids: list[int]):
        self.gen, self.backend, self.prompts, self.config = gen, backend, prompts, config
        self.drafter, self.on_text = drafter, on_text
        self.sampler = RowSampler(config.sampling)
        self.keys = row_ids
        self.rngs = {r: np.random.default_rng([config.sampling.seed, key]) for r, key in enumerate(row_ids)}
        stop_ids = gen.stop_ids(config)
        self.checkers = [StopChecker(StopConfig(stop_ids, tuple(config.stop_strings), m, config.repeat_max_period,
                                                config.repeat_max_count)) for m in limits]
        n = len(prompts)
        self.penalties = PenaltyTracker(gen.cfg.vocab_size) if config.sampling.has_penalties else None
        self.lps: list[list[float]] = [[] for _ in range(n)]
        self.ids: list[list[int]] = [[] for _ in range(n)]
        self.streamed = [0] * n
        self.drawn = [0] * n
        self.handles: dict[int, int] = {}
        self.pending: dict[int, int] = {}
        self.active: list[int] = []
        self.stats = GenerationStats(speculative=config.speculative, prompt_tokens=sum(map(len, prompts)),
                                     batch=n)

    # ------------------------------------------------------------------ emission
    def _emit(self, r: int, tok: int, logprob: float | None = None) -> bool:
        """Record a generated token (and its log-probability); True when row ``r`` is finished."""
        ck = self.checkers[r]
        res = ck.update(tok, self.gen._text(self.ids[r] + [tok]))
        if res is None or res.reason != "stop_token":
            self.ids[r].append(tok)
            self.lps[r].append(logprob)
            if self.penalties is not None:
                self.penalties.add(r, tok)
            self.stats.generated_tokens += 1
        if self.on_text is not None:
            text = ck.emittable_text()
            if len(text) > self.streamed[r]:
                self.on_text(r, text[self.streamed[r]:])
                self.streamed[r] = len(text)
        return res is not None

    def _finish(self, r: int) -> None:
        self.active.remove(r)
        self.backend.free(self.handles.pop(r))
        if self.drafter is not None:
            self.drafter.drop(r)

    def release(self) -> None:
        for r in list(self.handles):
            self.backend.free(self.handles.pop(r))
            if self.drafter is not None:
                self.drafter.drop(r)

    # ------------------------------------------------------------------ steps
    def _choose(self, logits: np.ndarray, rows: list[int]) -> tuple[np.ndarray, list]:
        """Sampled tokens of ``rows`` from their logits ``[n, V]`` and their log-probabilities (or Nones)."""
        x = logits if self.penalties is None else self.penalties.apply(logits, rows, **self.config.sampling.penalties())
        chosen = self.sampler.choose(x, [self.keys[r] for r in rows], [self.drawn[r] for r in rows])
        lps = token_logprobs(logits, chosen).tolist() if self.config.logprobs else [None] * len(rows)
        return chosen, lps

    def start(self, timer: Timer, clock: CompileClock, on_prefill_tokens) -> None:
        spec = self.drafter is not None
        # The drafter keeps only the last mtp_window hidden states: ask for no more (a 1M-token prompt
        # would otherwise bring every position's hidden state to the host).
        want = self.drafter.window if spec else False
        w0 = clock.now()
        handles, last, hidden = self.backend.prefill(self.prompts, want_hidden=want, on_tokens=on_prefill_tokens)
        self.stats.prefill_s = timer.elapsed()
        self.stats.prefill_compile_s = clock.since(w0)
        rows = list(range(len(self.prompts)))
        self.handles = dict(zip(rows, handles))
        if self.penalties is not None:
            for r in rows:
                self.penalties.start(r, self.prompts[r])
        first, lps = self._choose(last, rows)
        self.stats.ttft_s = timer.elapsed()
        self.active = list(rows)
        for r in rows:
            self.drawn[r] = 1
            if spec:
                self.drafter.start(r, self.prompts[r], hidden[r])
            self.pending[r] = int(first[r])
            if self._emit(r, int(first[r]), lps[r]):
                self._finish(r)

    def plain_step(self) -> None:
        rows = list(self.active)
        toks = np.array([[self.pending[r]] for r in rows], np.int32)
        logits, _ = self.backend.step([self.handles[r] for r in rows], toks)
        self.stats.decode_steps += 1
        chosen, lps = self._choose(logits[:, 0], rows)
        for r, t, lp in zip(rows, chosen, lps):
            self.drawn[r] += 1
            self.pending[r] = int(t)
            if self._emit(r, int(t), lp):
                self._finish(r)

    def loop_step(self) -> None:
        """``config.decode_loop`` greedy steps in one device loop (``Backend.greedy``); tokens past a row's
        stop are dropped (its slot is freed). Near the engine's ``max_len`` (the model's context), where a
        whole loop no longer fits, one plain step (the same greedy tokens, no new compile)."""
        rows = list(self.active)
        n = self.config.decode_loop
        if any(self.backend.length(self.handles[r]) + n > self.backend.max_len for r in rows):
            return self.plain_step()
        chosen = self.backend.greedy([self.handles[r] for r in rows],
                                     np.array([self.pending[r] for r in rows], np.int32), n)
        self.stats.decode_loop = n          # the summary names the loop only where one ran
        used = 0                            # steps whose tokens some row used (the rest ran past every stop)
        for r, toks in zip(rows, chosen):
            for i, t in enumerate(toks):
                self.drawn[r] += 1
                self.pending[r] = int(t)
                if self._emit(r, int(t)):
                    self._finish(r)
                    break
            used = max(used, i + 1)
        self.stats.decode_steps += used

    def _draft_chooser(self, rows, qprobs: list):
        sampler, rngs = self.sampler, self.rngs

        def choose(logits, depth):
            if sampler.params.greedy:
                return np.argmax(logits, axis=-1)
            q = sampler.probs(logits)
            qprobs.append(q)
            return np.array([rngs[r].choice(q.shape[-1], p=q[i] / q[i].sum()) for i, r in enumerate(rows)])

        return choose

    def speculative_step(self) -> None:
        rows = list(self.active)
        qprobs: list = []
        drafts, _ = self.drafter.draft(rows, [self.pending[r] for r in rows], self._draft_chooser(rows, qprobs))
        k = drafts.shape[1]
        lengths = [self.backend.length(self.handles[r]) for r in rows]
        ks = [max(0, min(k, self.backend.max_len - n - 1)) for n in lengths]
        toks = np.concatenate([np.array([[self.pending[r]] for r in rows], np.int32), drafts], 1)
        logits, hidden = self.backend.step([self.handles[r] for r in rows], toks, num_tokens=[1 + x for x in ks],
                                           want_hidden=True)
        self.stats.decode_steps += 1
        greedy = self.sampler.params.greedy
        target = None if greedy else self.sampler.probs(logits)      # one fixed-shape call per step
        for i, r in enumerate(rows):
            kr = ks[i]
            if greedy:
                a, nxt = accept_greedy(logits[i, :kr + 1], drafts[i, :kr])
            else:
                q = np.stack([qp[i] for qp in qprobs], 0)[:kr]
                a, nxt = accept_sampled(target[i, :kr + 1], q, drafts[i, :kr], self.rngs[r])
            self.stats.drafted += kr
            self.stats.accepted += a
            self.backend.truncate(self.handles[r], lengths[i] + 1 + a)
            kept = [self.pending[r]] + [int(t) for t in drafts[i, :a]]
            self.drafter.extend(r, kept, hidden[i, :1 + a])
            self.pending[r] = nxt
            emitted = [int(t) for t in drafts[i, :a]] + [int(nxt)]
            lps = (token_logprobs(logits[i, :a + 1], emitted).tolist() if self.config.logprobs
                   else [None] * len(emitted))
            for t, lp in zip(emitted, lps):
                if self._emit(r, t, lp):
                    self._finish(r)
                    break

    def spec_loop_step(self) -> None:
        """``config.decode_loop`` greedy speculative steps in one device loop (``Backend.speculative_greedy``):
        drafting, verification and acceptance on the device, with per step the drafts, accepted counts, tokens
        and statistics of ``speculative_step``; the drafter's windows go in and come back. Tokens past a row's
        stop are dropped (its slot is freed). Near the engine's ``max_len``, where a whole loop no longer fits,
        one host speculative step (which shortens its drafts there)."""
        rows = list(self.active)
        n, k = self.config.decode_loop, self.drafter.num_draft
        handles = [self.handles[r] for r in rows]
        if any(self.backend.length(h) + n * (1 + k) > self.backend.max_len for h in handles):
            return self.speculative_step()
        hidden, toks, count, _ = self.drafter.window_arrays(rows)
        emitted, accepted, (hidden, toks, count) = self.backend.speculative_greedy(
            handles, np.array([self.pending[r] for r in rows], np.int32), n, self.drafter.mtp, (hidden, toks, count),
            k)
        self.stats.decode_loop = n          # the summary names the loop only where one ran
        used = 0                            # steps whose tokens some row used (the rest ran past every stop)
        for i, r in enumerate(rows):
            self.drafter.set_window(r, hidden[i], toks[i], int(count[i]), self.backend.length(handles[i]))
            self.pending[r] = int(emitted[i, -1, accepted[i, -1]])
            finished = False
            for j, (em, a) in enumerate(zip(emitted[i], accepted[i])):
                self.stats.drafted += k
                self.stats.accepted += int(a)
                for t in em[:a + 1]:
                    if self._emit(r, int(t)):
                        finished = True
                        break
                if finished:
                    self._finish(r)
                    break
            used = max(used, j + 1)
        self.stats.decode_steps += used

    def results(self) -> list[SequenceResult]:
        out = []
        for r, ck in enumerate(self.checkers):
            res = ck.result
            lps = self.lps[r] if self.config.logprobs else None
            if res is None:  # only when generation was interrupted
                out.append(SequenceResult(list(self.ids[r]), ck.text, "interrupted", None, lps))
            else:
                out.append(SequenceResult(list(self.ids[r][:res.num_tokens]), res.text, res.reason, res.detail,
                                          None if lps is None else lps[:res.num_tokens]))
        return out
