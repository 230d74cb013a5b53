"""``DecodeEngine``'s compiled device loops: many decode steps per host round trip (issue 34).

``decode_greedy`` (plain greedy steps, ``step.greedy_steps``) and ``decode_speculative_greedy`` (greedy MTP
speculative steps, ``spec_loop.speculative_greedy_steps``). A mixin of ``DecodeEngine`` (it uses the engine's
slots, page tables and cache): each call reserves pages for the loop's longest outcome, runs the loop, then
records the tokens the cache now holds exactly as ``decode_step`` / ``truncate`` do (pages past the new end
released, full pages published in the prefix cache).
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np

from minimax_jax.decode.spec_loop import speculative_greedy_steps
from minimax_jax.decode.step import greedy_steps

__all__ = ["DeviceLoops"]


class DeviceLoops:
    """Mixin of ``DecodeEngine`` (needs its ``seqs``, ``tables``, ``cache``, ``_reserve``, ``_publish``)."""

    def _loop_inputs(self, tokens, slots, steps, span: int, rows: int):
        """Check a loop's arguments, reserve pages for ``length + steps * span`` tokens per slot (all or nothing)
        and return the ``[max_seqs, rows]`` token / position arrays (column 0: each slot's input token at its
        length; idle rows and other columns: padding)."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or tokens.shape[0] != len(slots):
            raise ValueError(f"tokens must be [len(slots)={len(slots)}], got {tokens.shape}")
        if len(set(slots)) != len(slots):
            raise ValueError(f"slots must be distinct, got {list(slots)}")
        if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
            raise ValueError(f"steps must be an int >= 1, got {steps!r}")
        self._reserve({s: self.length(s) + int(steps) * span for s in slots})
        tok = np.zeros((self.max_seqs, rows), np.int32)
        pos = np.full((self.max_seqs, rows), -1, np.int32)
        for i, s in enumerate(slots):
            tok[s, 0] = tokens[i]
            pos[s, 0] = self.length(s)
        return jnp.asarray(tok), jnp.asarray(pos)

    def _loop_written(self, slots, written) -> None:
        """Record ``written[i]`` (the tokens now in the cache after ``slots[i]``'s old end), release the pages
        reserved past the new end and publish full pages."""
        for s, toks in zip(slots, written):
            self.seqs[s].tokens.extend(int(t) for t in toks)
            self.truncate(s, len(self.seqs[s].tokens))
            self._publish(s)

    def decode_greedy(self, tokens, slots: Sequence[int], steps: int) -> np.ndarray:
        """``steps`` greedy decode steps in one compiled loop (``step.greedy_steps``): the host is
        reached once per call, not once per token.

        Args: tokens ``[n]`` int: each listed slot's next input token (its last chosen one); slots: live
          slot ids (distinct); steps >= 1. Pages for ``length + steps`` tokens are reserved first (all
          or nothing). With ``query_rows`` every step is padded to that many rows, as ``decode_step``.
        Returns: int32 ``[n, steps]``, the token chosen after each step (the same tokens as ``steps``
          one-row ``decode_step`` calls with argmax in between, up to the rounding of the loop's
          compiled step). The slot then holds its input token and the first ``steps - 1`` chosen ones;
          the last chosen token is the next input.
        Raises: ValueError (bad shapes / slots / steps, length past ``max_len``), PagePoolExhausted.
        """
        tok, pos = self._loop_inputs(tokens, slots, steps, 1, self.query_rows or 1)
        chosen, self.cache = greedy_steps(self.params, self.cache, tok, pos, jnp.asarray(self.tables),
                                          steps=int(steps), cfg=self.cfg, spec=self.spec,
                                          implementation=self.implementation)
        chosen = np.asarray(chosen)[list(slots)]
        self._loop_written(slots, [[int(t)] + list(c[:steps - 1]) for t, c in zip(np.asarray(tokens), chosen)])
        return chosen

    def decode_speculative_greedy(self, tokens, slots: Sequence[int], iters: int, mtp, window, num_draft: int):
        """``iters`` greedy MTP speculative steps in one compiled loop (``spec_loop.speculative_greedy_steps``):
        draft ``num_draft`` tokens on the device, verify them in one ``1 + num_draft``-row step, keep the
        accepted ones; the host is reached once per call.

        Args:
          tokens: ``[n]`` int, each listed slot's pending token (chosen, not yet in the cache); slots: live slot
            ids (distinct); iters >= 1.
          mtp: ``spec_loop.stack_mtp(params)`` (the drafter's copy: nothing is stacked here).
          window: ``(hidden [n, W, H], tokens [n, W], count [n])`` each slot's drafting window
            (``spec_loop.window_layout``; ``MTPDrafter.window_arrays``).
          num_draft: drafts per step ``k``, ``1 + k <= query_rows`` when that is set (else each step has
            ``1 + k`` rows).
        Pages for ``length + iters * (1 + k)`` tokens are reserved first (all or nothing); those past the
        new end are released after the loop.
        Returns: ``(emitted [n, iters, k + 1] int32, accepted [n, iters] int32, window)``: step ``i`` emitted
          ``emitted[:, i, :accepted[:, i] + 1]``; ``window`` as given, after the loop (numpy). The slot then
          holds its pending token and every emitted token but the last (the next pending one).
        Raises: ValueError (bad shapes / slots / iters / num_draft, length past ``max_len``), PagePoolExhausted.
        """
        k = int(num_draft)
        rows = self.query_rows or 1 + k
        if not 1 <= k < rows:
            raise ValueError(f"num_draft must be in [1, {rows - 1}] (query_rows={self.query_rows}), got {num_draft}")
        hid, wtok, cnt = (np.asarray(a) for a in window)
        if hid.shape[:2] != wtok.shape or wtok.shape[0] != len(slots) or cnt.shape != (len(slots),):
            raise ValueError(f"window must be ([n={len(slots)}, W, H], [n, W], [n]), got "
                             f"{hid.shape}, {wtok.shape}, {cnt.shape}")
        tok, pos = self._loop_inputs(tokens, slots, iters, 1 + k, rows)
        idx = np.asarray(slots, np.int64)
        full_h = np.zeros((self.max_seqs,) + hid.shape[1:], hid.dtype)
        full_t = np.zeros((self.max_seqs, wtok.shape[1]), np.int32)
        full_n = np.zeros((self.max_seqs,), np.int32)
        full_h[idx], full_t[idx], full_n[idx] = hid, wtok, cnt
        emitted, accepted, win, self.cache = speculative_greedy_steps(
            self.params, mtp, self.cache, tok, pos, jnp.asarray(self.tables), jnp.asarray(full_h),
            jnp.asarray(full_t), jnp.asarray(full_n), iters=int(iters), num_draft=k, cfg=self.cfg, spec=self.spec,
            implementation=self.implementation)
        emitted, accepted = np.asarray(emitted)[idx], np.asarray(accepted)[idx]
        out = [[t for e, a in zip(em, ac) for t in e[:a + 1]] for em, ac in zip(emitted, accepted)]
        self._loop_written(slots, [[int(t)] + o[:-1] for t, o in zip(np.asarray(tokens), out)])
        return emitted, accepted, tuple(np.asarray(a)[idx] for a in win)
