"""Draft tokens with the model's multi-token-prediction (MTP) modules.

MTP depth ``d`` at position ``t`` (``minimax_jax.model.mtp_forward``) reads the token at ``t + d``
and the previous depth's hidden state at ``t`` (depth 0 = the main model's pre-final-norm hidden) and
predicts the token at ``t + d + 1``. With the main model's hidden states up to position ``n - 1`` and
the freshly sampled token ``x_n``, depth 1 at ``n - 1`` proposes ``x_{n+1}``; feeding that proposal,
depth 2 at ``n - 1`` proposes ``x_{n+2}``, and so on: ``num_draft <= num_mtp_modules`` drafts.

Each MTP layer attends over the sequence, so every depth runs over a window of the last
``window`` positions (right-aligned, left padding in its own segment). A window shorter than the
context only lowers the acceptance rate; the verification step keeps the output distribution exact.
Per row the drafter keeps the last ``window`` main hidden states and tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from minimax_jax.config import ModelConfig
from minimax_jax.infer.errors import InferenceError
from minimax_jax.model.layers import rms_norm, rope_frequencies
from minimax_jax.model.params import mtp_layer_kinds
from minimax_jax.model.transformer import decoder_layer, embed, unembed

__all__ = ["MTPDrafter", "mtp_depth", "stack_mtp"]


def mtp_depth(params, cfg: ModelConfig, depth, h_prev, next_tokens, positions, segment_ids, *, mtp=None):
    """One MTP depth over a window.

    Args:
      depth: 1-based module index (a Python int, or a traced int32 with ``mtp`` given).
      mtp: optional MTP module params stacked on a leading axis (``stack_mtp``), indexed by
        ``depth - 1`` so one compilation serves every depth; default ``params["mtp"][depth - 1]``.
      h_prev: ``[B,W,H]`` previous depth's hidden state.
      next_tokens: ``[B,W]`` the token at ``position + depth`` for every window position.
      positions, segment_ids: ``[B,W]`` int32.
    Returns: ``(h [B,W,H], logits [B,W,V] float32)``; logits at ``t`` predict ``t + depth + 1``.
    """
    mod = params["mtp"][depth - 1] if mtp is None else jax.tree.map(lambda a: a[depth - 1], mtp)
    norm = functools.partial(rms_norm, eps=cfg.rms_norm_eps, kind=cfg.norm_kind)
    e = norm(embed(params, cfg, next_tokens), mod["enorm"]["scale"])
    hn = norm(h_prev.astype(e.dtype), mod["hnorm"]["scale"])
    x = jnp.concatenate([e, hn], axis=-1) @ mod["eh_proj"].astype(e.dtype)
    cos, sin = rope_frequencies(positions, cfg.rotary_dim, cfg.rope_theta)
    lt, mt = mtp_layer_kinds(cfg)
    h, _ = decoder_layer(mod["layer"], x, cfg, lt, mt, positions, segment_ids, cos, sin, None)
    return h, unembed(params, cfg, norm(h, mod["final_norm"]["scale"]))


def stack_mtp(params) -> dict:
    """The MTP modules' params stacked leaf by leaf on a new leading axis."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *params["mtp"])


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
        if window < 1:
            raise InferenceError(f"MTP window must be >= 1, got {window}")
        self.params, self.cfg, self.num_draft, self.window = params, cfg, num_draft, window
        self.tokens: dict[int, list[int]] = {}
        self.hidden: dict[int, np.ndarray] = {}
        self._len: dict[int, int] = {}          # tokens of the row in the main cache
        self._mtp = stack_mtp(params)
        self._depth = jax.jit(functools.partial(mtp_depth, cfg=cfg))

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

    def draft(self, rows, pending, choose) -> tuple[np.ndarray, np.ndarray]:
        """Propose ``num_draft`` tokens after each row's pending (sampled, not yet cached) token.

        Args:
          rows: row ids (started). pending: their pending tokens.
          choose: ``choose(logits [n, V] float32, depth) -> tokens [n]`` (greedy or a sampler that
            records its draft distribution).
        Returns: ``(drafts [n, k] int32, logits [n, k, V] float32)``: the drafts and the MTP logits
          they were chosen from.
        """
        w, n = self.window, len(rows)
        hd = self.cfg.hidden_size
        h = np.zeros((n, w, hd), np.float32)
        pos = np.zeros((n, w), np.int32)
        seg = np.ones((n, w), np.int32)
        streams, lens = [], []
        for i, r in enumerate(rows):
            L = len(self.tokens[r])
            start = self._len[r] - L
            h[i, w - L:] = self.hidden[r]
            pos[i, w - L:] = np.arange(start, start + L)
            seg[i, w - L:] = 0
            streams.append(self.tokens[r] + [int(pending[i])])
            lens.append(L)
        h_prev = jnp.asarray(h, jnp.dtype(self.cfg.dtype))
        pos_j, seg_j = jnp.asarray(pos), jnp.asarray(seg)
        drafts = np.zeros((n, self.num_draft), np.int32)
        all_logits = []
        for d in range(1, self.num_draft + 1):
            nxt = np.zeros((n, w), np.int32)
            for i, (s, L) in enumerate(zip(streams, lens)):
                nxt[i, w - L:] = s[d:d + L]
            h_prev, logits = self._depth(self.params, depth=jnp.int32(d), h_prev=h_prev,
                                         next_tokens=jnp.asarray(nxt), positions=pos_j, segment_ids=seg_j,
                                         mtp=self._mtp)
            last = np.asarray(logits[:, -1], np.float32)
            tok = np.asarray(choose(last, d), np.int32)
            drafts[:, d - 1] = tok
            all_logits.append(last)
            for i in range(n):
                streams[i].append(int(tok[i]))
        return drafts, np.stack(all_logits, 1)
