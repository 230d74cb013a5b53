"""MTP speculative decoding inside the continuous batch (``Scheduler(speculative="mtp")``).

Per decode iteration ONE engine step over every decoding sequence, ``Q = 1 + k`` query rows
(``k = num_draft``), hidden states returned. A sequence's first token comes from its prefill, as in
plain decoding (``DecodeEngine.prefill_start(hidden_last=window)`` hands the drafter the hidden states
of the prompt's last positions), so its prompt's cache and logits are bit for bit those of plain
decoding. Each row of the step is one of:

* a drafting sequence: its pending token and ``k`` MTP drafts (``minimax_jax.infer.drafter``), verified
  with ``minimax_jax.infer.speculative.accept_greedy`` / ``accept_sampled`` (the generation loop's
  rules; greedy output equals plain greedy decoding), the cache truncated after the accepted drafts;
* a sequence with penalties or a logit bias: its pending token only (plain decoding, as the
  generation loop requires), chosen with the scheduler's adjusted sampling.

Drafts are chosen per sequence (argmax when greedy, else drawn from its own filtered distribution with
its ``Sequence.rng``). ``drafted`` / ``accepted`` count draft tokens over the server's life. ``loop`` runs
several greedy speculative steps in one device loop (``Scheduler(decode_loop=n)``).
"""

from __future__ import annotations

import numpy as np

from minimax_jax.decode.pages import PagePoolExhausted
from minimax_jax.infer.drafter import MTPDrafter
from minimax_jax.infer.errors import EngineUnavailable
from minimax_jax.infer.speculative import accept_greedy, accept_sampled

__all__ = ["MTPStep"]


class MTPStep:
    """The speculative decode step of ``sched`` (a ``Scheduler``). Raises InferenceError (no MTP
    modules / bad ``num_draft``) or EngineUnavailable (the engine returns no hidden states)."""

    def __init__(self, sched, num_draft: int | None, window: int):
        self.sched = sched
        # a window past the engine's max_len would hold only padding
        self.drafter = MTPDrafter(sched.gen.params, sched.gen.cfg, num_draft, min(window, sched.max_len))
        if not sched.backend.supports_hidden:
            raise EngineUnavailable("MTP speculation needs an engine that returns hidden states")
        self.k = self.drafter.num_draft
        self.drafted = self.accepted = 0

    @staticmethod
    def drafts(s) -> bool:
        """Whether sequence ``s`` speculates (penalties and logit bias need plain decoding)."""
        return s.penalties is None and s.logit_bias is None

    def _chooser(self, rows, qprobs: list):
        def choose(logits, depth):
            out = np.zeros(len(rows), np.int64)
            for j, s in enumerate(rows):
                if s.sampling.greedy:
                    out[j] = int(np.argmax(logits[j]))
                else:
                    q = s.sampler.probs(logits[j:j + 1])[0]
                    qprobs[j].append(q)
                    out[j] = s.rng.choice(q.shape[-1], p=q / q.sum())
            return out
        return choose

    def step(self, rows) -> None:
        """One verification step over the decoding sequences ``rows`` (module doc)."""
        backend, q = self.sched.backend, 1 + self.k
        drafting = [s for s in rows if self.drafts(s)]
        qprobs: list = [[] for _ in drafting]
        drafts = None
        if drafting:
            drafts, _ = self.drafter.draft([s.handle for s in drafting], [s.pending for s in drafting],
                                           self._chooser(drafting, qprobs))
        where = {id(s): j for j, s in enumerate(drafting)}
        lengths = [backend.length(s.handle) for s in rows]
        toks = np.zeros((len(rows), q), np.int32)
        counts, ks = [], []
        for i, s in enumerate(rows):
            toks[i, 0] = s.pending
            kr = max(0, min(self.k, backend.max_len - lengths[i] - 1)) if id(s) in where else 0
            if kr:
                toks[i, 1:1 + kr] = drafts[where[id(s)], :kr]
            counts.append(1 + kr)
            ks.append(kr)
        logits, hidden = backend.step([s.handle for s in rows], toks, num_tokens=counts, want_hidden=True)
        for i, s in enumerate(rows):
            if id(s) not in where:
                self.sched._choose_and_emit([s], logits[i, :1])
            else:
                self._verify(s, where[id(s)], ks[i], lengths[i], drafts, qprobs, logits[i], hidden[i])

    def loop(self, rows, n: int) -> bool:
        """``n`` greedy speculative steps over ``rows`` (all ``Sequence.loopable``) in one device loop
        (``Backend.speculative_greedy``: drafting, verification and acceptance on the device; the tokens and
        accepted drafts of ``n`` calls of ``step``) when every row has room for the loop's ``n (1 + k)`` tokens;
        False (nothing done) otherwise or when the page pool cannot hold them now."""
        backend, k = self.sched.backend, self.k
        handles = [s.handle for s in rows]
        if any(backend.length(h) + n * (1 + k) > backend.max_len for h in handles):
            return False
        hidden, toks, count, _ = self.drafter.window_arrays(handles)
        try:
            emitted, accepted, (hidden, toks, count) = backend.speculative_greedy(
                handles, np.array([s.pending for s in rows], np.int32), n, self.drafter.mtp, (hidden, toks, count), k)
        except PagePoolExhausted:       # reserved all-or-nothing: nothing was written
            return False
        for i, s in enumerate(rows):
            self.drafter.set_window(s.handle, hidden[i], toks[i], int(count[i]), backend.length(s.handle))
            s.pending = int(emitted[i, -1, accepted[i, -1]])
            for em, a in zip(emitted[i], accepted[i]):
                self.drafted += k
                self.accepted += int(a)
                if self.sched.metrics is not None:
                    self.sched.metrics.verified(k, int(a))
                self.sched._emit_tokens(s, [int(t) for t in em[:a + 1]], None)
                if s.handle is None:    # finished (released) inside the loop: its later tokens are dropped
                    break
        return True

    def _verify(self, s, j: int, kr: int, length: int, drafts, qprobs, logits, hidden) -> None:
        d = drafts[j, :kr]
        if s.sampling.greedy:
            a, nxt = accept_greedy(logits[:kr + 1], d)
        else:
            target = s.sampler.probs(logits[:kr + 1])
            a, nxt = accept_sampled(target, np.stack(qprobs[j], 0)[:kr], d, s.rng)
        self.drafted += kr
        self.accepted += a
        if self.sched.metrics is not None:
            self.sched.metrics.verified(kr, a)
        self.sched.backend.truncate(s.handle, length + 1 + a)
        self.drafter.extend(s.handle, [s.pending] + [int(t) for t in d[:a]], hidden[:1 + a])
        s.pending = int(nxt)
        self.sched._emit_tokens(s, [int(t) for t in d[:a]] + [int(nxt)], logits[:a + 1])
