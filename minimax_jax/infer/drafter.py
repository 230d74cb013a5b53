"""Draft tokens with the model's multi-token-prediction (MTP) modules.

MTP depth ``d`` at position ``t`` (``minimax_jax.model.mtp_forward``) reads the token at ``t + d``
and the previous depth's hidden state at ``t`` (depth 0 = the main model's pre-final-norm hidden) and
predicts the token at ``t + d + 1``. With the main model's hidden states up to position ``n - 1`` and
the freshly sampled token ``x_n``, depth 1 at ``n - 1`` proposes ``x_{n+1}``; feeding that proposal,
depth 2 at ``n - 1`` proposes ``x_{n+2}``, and so on: ``num_draft <= num_mtp_modules`` drafts.

Each MTP layer attends over the sequence, so every depth runs over a window of the last
``window`` positions (right-aligned, left padding in its own segment). A window shorter than the
context only lowers the acceptance rate; the verification step keeps the output distribution exact. A model
whose MTP layers were trained with ``cfg.mtp_attention_window`` = W drafts exactly as trained once
``window >= num_draft * (W - 1) + 1`` (depth d at a position reads d windows back).
Per row the drafter keeps the last ``window`` main hidden states and tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from minimax_jax.config import ModelConfig
from minimax_jax.decode.spec_loop import mtp_depth, stack_mtp, window_layout
from minimax_jax.infer.errors import InferenceError

__all__ = ["MAX_MTP_WINDOW", "MTPDrafter", "mtp_depth", "stack_mtp"]     # the MTP math lives in minimax_jax.decode.spec_loop


#: Largest drafting window: every draft step runs the MTP layers over W positions and the host keeps W main
#: hidden states per row (W x hidden_size float32: 100 MB per row at W = 8192 for M2), so larger windows
#: cost more than drafting gains; a model trained with ``mtp_attention_window`` needs only
#: ``num_draft x (W - 1) + 1``.
MAX_MTP_WINDOW = 8192

class MTPDrafter:
    """Per-row MTP draft state and the batched drafting step.

    Args:
      params, cfg: the model (needs ``cfg.num_mtp_modules >= num_draft`` and ``params["mtp"]``).
      num_draft: drafts per step (default: all MTP modules, at most 15 so 1 + drafts <= 16 rows).
      window: positions each MTP layer attends over (static; default 64). Drafting costs
        ``num_draft`` MTP layers over ``window`` tokens per step (no MTP KV cache yet).
    Raises: InferenceError when the model has no (or too few) MTP modules.
    """

    def __init__(self, params, cfg: ModelConfig, num_draft: int | None = None, window: int = 64):
        have = cfg.num_mtp_modules if "mtp" in params else 0
        if have < 1:
            raise InferenceError("speculative decoding with MTP needs a checkpoint with MTP modules "
                                 f"(config num_mtp_modules={cfg.num_mtp_modules}, params have "
                                 f"{'an' if 'mtp' in params else 'no'} 'mtp' entry)")
        num_draft = min(have, 15) if num_draft is None else num_draft
        if not 1 <= num_draft <= min(have, 15):
            raise InferenceError(f"num_draft must be in [1, {min(have, 15)}] for this model "
                                 f"({have} MTP modules, at most 15 drafts), got {num_draft}")
        if not 1 <= window <= MAX_MTP_WINDOW:
            raise InferenceError(f"MTP window must be in [1, {MAX_MTP_WINDOW}], got {window}")
        self.params, self.cfg, self.num_draft, self.window = params, cfg, num_draft, window
        self.tokens: dict[int, list[int]] = {}
        self.hidden: dict[int, np.ndarray] = {}
        self._len: dict[int, int] = {}          # tokens of the row in the main cache
        self.mtp = stack_mtp(params)            # the modules stacked (one compiled depth; the device loop's input)
        self._depth = jax.jit(functools.partial(mtp_depth, cfg=cfg, last_only=True))

    def start(self, row: int, tokens, hidden) -> None:
        """Begin a row with its prompt tokens and the main hidden states ``[T', H]`` of the LAST
        ``T' <= len(tokens)`` of them (``T' >= 1``; only the last ``window`` are kept)."""
        if not 1 <= len(hidden) <= len(tokens):
            raise ValueError(f"need hidden states for 1..{len(tokens)} prompt tokens, got {len(hidden)}")
        keep = min(len(hidden), self.window)
        self.tokens[row] = [int(t) for t in tokens][-keep:]
        self.hidden[row] = np.asarray(hidden)[-keep:]
        self._len[row] = len(tokens)

    def extend(self, row: int, tokens, hidden) -> None:
        """Append verified tokens (now in the main cache) and their main hidden states."""
        if len(tokens) != len(hidden):
            raise ValueError(f"{len(tokens)} tokens but {len(hidden)} hidden states")
        self.tokens[row] = (self.tokens[row] + [int(t) for t in tokens])[-self.window:]
        self.hidden[row] = np.concatenate([self.hidden[row], np.asarray(hidden)], 0)[-self.window:]
        self._len[row] += len(tokens)

    def drop(self, row: int) -> None:
        self.tokens.pop(row, None)
        self.hidden.pop(row, None)
        self._len.pop(row, None)

    def window_arrays(self, rows) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The rows' drafting windows as arrays (``spec_loop.window_layout``: right-aligned, zero padding).

        Returns: ``(hidden [n, W, H] float32, tokens [n, W] int32, count [n] int32, length [n] int32)``: the last
        ``count <= W`` main hidden states and tokens of each row, and its tokens in the main cache.
        """
        w, n = self.window, len(rows)
        h = np.zeros((n, w, self.cfg.hidden_size), np.float32)
        toks = np.zeros((n, w), np.int32)
        count = np.array([len(self.tokens[r]) for r in rows], np.int32)
        for i, r in enumerate(rows):
            h[i, w - count[i]:] = self.hidden[r]
            toks[i, w - count[i]:] = self.tokens[r]
        return h, toks, count, np.array([self._len[r] for r in rows], np.int32)

    def set_window(self, row: int, hidden, tokens, count: int, length: int) -> None:
        """Replace a started row's state by a window ``(hidden [W, H], tokens [W])`` whose last ``count`` entries
        are valid (``window_arrays``' layout; e.g. after a device loop) and its main-cache length."""
        if not 0 <= count <= min(len(tokens), self.window) or len(hidden) != len(tokens):
            raise ValueError(f"bad window: {len(hidden)} hidden states, {len(tokens)} tokens, count {count}")
        w = len(tokens)
        self.tokens[row] = [int(t) for t in tokens[w - count:]]
        self.hidden[row] = np.asarray(hidden)[w - count:]
        self._len[row] = int(length)

    def draft(self, rows, pending, choose) -> tuple[np.ndarray, np.ndarray]:
        """Propose ``num_draft`` tokens after each row's pending (sampled, not yet cached) token.

        Args:
          rows: row ids (started). pending: their pending tokens.
          choose: ``choose(logits [n, V] float32, depth) -> tokens [n]`` (greedy or a sampler that
            records its draft distribution).
        Returns: ``(drafts [n, k] int32, logits [n, k, V] float32)``: the drafts and the MTP logits
          they were chosen from. (Greedy drafting on the device: ``spec_loop.draft_greedy``, the same math.)
        """
        w, n, k = self.window, len(rows), self.num_draft
        h, toks, count, length = self.window_arrays(rows)
        valid, pos, seg = window_layout(count, length, w)
        # streams[:, w + d] = the token at position length + d (pending, then the drafts)
        streams = np.concatenate([toks, np.asarray(pending, np.int32).reshape(n, 1), np.zeros((n, k), np.int32)], 1)
        h_prev = jnp.asarray(h, jnp.dtype(self.cfg.dtype))
        pos_j, seg_j = jnp.asarray(pos), jnp.asarray(seg)
        all_logits = []
        for d in range(1, k + 1):
            nxt = np.where(valid, streams[:, d:d + w], 0)
            h_prev, logits = self._depth(self.params, depth=jnp.int32(d), h_prev=h_prev,
                                         next_tokens=jnp.asarray(nxt), positions=pos_j, segment_ids=seg_j,
                                         mtp=self.mtp)
            last = np.asarray(logits[:, -1], np.float32)
            streams[:, w + d] = np.asarray(choose(last, d), np.int32)
            all_logits.append(last)
        return streams[:, w + 1:].copy(), np.stack(all_logits, 1)
