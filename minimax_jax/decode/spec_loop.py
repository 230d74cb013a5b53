"""Greedy speculative decoding with the MTP modules inside one compiled device loop (issue 34).

Per iteration of ``speculative_greedy_steps``, for every row (its cache holds positions ``< n``; the
pending token ``x_n`` is chosen but not yet fed):

1. draft ``k`` tokens with MTP depths ``1..k`` (``draft_greedy``: the math of
   ``minimax_jax.infer.drafter.MTPDrafter.draft`` with greedy choice, over the row's window of its last
   ``W`` main hidden states and tokens, kept on the device);
2. verify ``[x_n, d_1..d_k]`` at positions ``n..n+k`` in ONE ``model_step`` (``"paged"`` path), which
   also returns the verified positions' pre-final-norm hidden states;
3. accept the longest prefix of drafts equal to the verify argmax (``accept_greedy_counts``: lowest id
   on ties), emit those drafts + the bonus / correction token, advance the row by ``1 + accepted`` and
   shift its window by as many positions.

Rejected drafts' K/V stay in the cache: the paged attention shows a query only keys at positions ``<=``
its own (MSA page selection ranks only complete pages before the query's page), and the next
iteration writes positions ``n + accepted + 1 ..`` (every stale one a query could see) before any layer
reads them; tests/infer/test_spec_loop.py checks it.

Window layout (shared with the host drafter): right-aligned, ``count`` valid entries at the end, the
rest zeros in their own segment (``window_layout``); valid entry ``j`` sits at position
``length - W + j``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from minimax_jax.config import ModelConfig
from minimax_jax.decode.cache import CacheSpec
from minimax_jax.decode.step import model_step
from minimax_jax.model.layers import rms_norm, rope_frequencies
from minimax_jax.model.params import mtp_compute_kinds
from minimax_jax.model.transformer import decoder_layer, embed, unembed

__all__ = ["mtp_depth", "stack_mtp", "window_layout", "accept_greedy_counts", "draft_greedy",
           "speculative_greedy_steps"]


def mtp_depth(params, cfg: ModelConfig, depth, h_prev, next_tokens, positions, segment_ids, *, mtp=None,
              last_only: bool = False):
    """One MTP depth over a window.

    Args:
      depth: 1-based module index (a Python int, or a traced int32 with ``mtp`` given).
      mtp: optional MTP module params stacked on a leading axis (``stack_mtp``), indexed by
        ``depth - 1`` so one compilation serves every depth; default ``params["mtp"][depth - 1]``.
      h_prev: ``[B,W,H]`` previous depth's hidden state.
      next_tokens: ``[B,W]`` the token at ``position + depth`` for every window position.
      positions, segment_ids: ``[B,W]`` int32.
      last_only: unembed only the last window position (drafting needs no other): logits ``[B,1,V]``.
    Returns: ``(h [B,W,H], logits [B,W,V] float32)``; logits at ``t`` predict ``t + depth + 1``.
    """
    mod = params["mtp"][depth - 1] if mtp is None else jax.tree.map(lambda a: a[depth - 1], mtp)
    norm = functools.partial(rms_norm, eps=cfg.rms_norm_eps, kind=cfg.norm_kind)
    e = norm(embed(params, cfg, next_tokens), mod["enorm"]["scale"])
    hn = norm(h_prev.astype(e.dtype), mod["hnorm"]["scale"])
    x = jnp.concatenate([e, hn], axis=-1) @ mod["eh_proj"].astype(e.dtype)
    cos, sin = rope_frequencies(positions, cfg.rotary_dim, cfg.rope_theta)
    lcfg, lt, mt = mtp_compute_kinds(cfg)
    h, _ = decoder_layer(mod["layer"], x, lcfg, lt, mt, positions, segment_ids, cos, sin, None)
    return h, unembed(params, cfg, norm(h[:, -1:] if last_only else h, mod["final_norm"]["scale"]))


def stack_mtp(params) -> dict:
    """The MTP modules' params stacked leaf by leaf on a new leading axis."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *params["mtp"])


def _xp(*arrays):
    return jnp if any(isinstance(a, jax.Array) for a in arrays) else np


def window_layout(count, length, window: int):
    """Layout of right-aligned drafting windows (numpy or jax arrays in, the same kind out).

    Args: count ``[B]`` valid entries per row (``<= window``); length ``[B]`` the row's tokens in the main
      cache (the last valid entry is position ``length - 1``); window: ``W``.
    Returns: ``(valid [B, W] bool, positions [B, W] int32, segment_ids [B, W] int32)``: padding entries at
      position 0 in segment 1, valid ones in segment 0.
    """
    xp = _xp(count, length)
    j = xp.arange(window, dtype=xp.int32)[None]
    valid = j >= window - count[:, None]
    positions = xp.where(valid, length[:, None] - window + j, 0).astype(xp.int32)
    return valid, positions, xp.where(valid, 0, 1).astype(xp.int32)


def accept_greedy_counts(best, drafts):
    """Greedy acceptance on arrays (numpy or jax): keep the longest prefix of drafts equal to the target's
    argmax, then the target's argmax after it.

    Args: best ``[..., k+1]`` int target argmax ids (the verify logits' argmax, lowest id on ties; ``best[i]``
      is the target's choice at draft ``i``'s position); drafts ``[..., k]`` int.
    Returns: ``(accepted [...], next [...])`` int32: drafts kept, and the token after them (``best[accepted]``).
    """
    xp = _xp(best, drafts)
    k = drafts.shape[-1]
    match = (drafts == best[..., :k]).astype(xp.int32)
    accepted = xp.cumprod(match, axis=-1).sum(axis=-1).astype(xp.int32)
    nxt = xp.take_along_axis(best, accepted[..., None].astype(xp.int32), axis=-1)[..., 0]
    return accepted, nxt.astype(xp.int32)


def draft_greedy(params, mtp, cfg: ModelConfig, hidden, tokens, count, length, pending, num_draft: int):
    """``num_draft`` greedy MTP drafts after each row's pending token (device form of ``MTPDrafter.draft``).

    Args:
      params: model params; mtp: ``stack_mtp(params)``.
      hidden: ``[B, W, H]`` the window's main pre-final-norm hidden states; tokens ``[B, W]`` int32 the
        window's tokens; count, length: ``[B]`` int32 (``window_layout``); pending: ``[B]`` int32.
    Returns: ``[B, num_draft]`` int32: depth ``d``'s argmax (float32, lowest id on ties) at the last window
      position, fed to depth ``d + 1``.
    """
    b, w = tokens.shape
    valid, pos, seg = window_layout(count, length, w)
    # streams[:, w + d] = the token at position length + d (pending, then the drafts)
    streams = jnp.concatenate([tokens, pending[:, None], jnp.zeros((b, num_draft), jnp.int32)], axis=1)
    dt = jnp.dtype(cfg.dtype)

    def depth(carry, d):
        h, streams = carry
        nxt = jnp.where(valid, jax.lax.dynamic_slice_in_dim(streams, d, w, axis=1), 0)
        h, logits = mtp_depth(params, cfg, d, h, nxt, pos, seg, mtp=mtp, last_only=True)
        tok = jnp.argmax(logits[:, -1].astype(jnp.float32), axis=-1).astype(jnp.int32)
        streams = jax.lax.dynamic_update_slice_in_dim(streams, tok[:, None], w + d, axis=1)
        return (h.astype(dt), streams), None

    (_, streams), _ = jax.lax.scan(depth, (hidden.astype(dt), streams),
                                   jnp.arange(1, num_draft + 1, dtype=jnp.int32))
    return streams[:, w + 1:]


@functools.partial(jax.jit, static_argnames=("iters", "num_draft", "cfg", "spec", "implementation"),
                   donate_argnames=("cache",))
def speculative_greedy_steps(params, mtp, cache, tokens, positions, page_table, window_hidden, window_tokens,
                             window_count, *, iters: int, num_draft: int, cfg: ModelConfig, spec: CacheSpec,
                             implementation: str = "auto"):
    """``iters`` greedy speculative steps (module doc) in one compiled loop (no host round trip between them).

    Args:
      params, cache, page_table, cfg, spec, implementation: as ``model_step``; every page the positions up
        to ``positions[:, 0] + iters * (1 + num_draft) - 1`` touch must already be allocated.
      mtp: ``stack_mtp(params)`` (``num_draft <= `` its modules).
      tokens: ``[B, Q]`` int32, ``Q >= 1 + num_draft``: column 0 each row's pending token, the rest padding (the
        verify step then has the shapes of a ``Q``-row decode step, see ``DecodeEngine.query_rows``).
      positions: ``[B, Q]`` int32: column 0 the pending token's position (the row's length; ``-1`` = idle row,
        which stays idle), the rest ``-1``.
      window_hidden ``[B, W, H]``, window_tokens ``[B, W]`` int32, window_count ``[B]`` int32: each row's
        drafting window (``window_layout``: right-aligned, zeros in the padding).
      iters: static number of speculative steps (>= 1); num_draft: static ``k`` (>= 1).
    Returns: ``(emitted [B, iters, k + 1] int32, accepted [B, iters] int32, (window_hidden, window_tokens,
      window_count), cache)``: step ``i`` emits ``emitted[:, i, :accepted[:, i] + 1]`` (its accepted drafts,
      then the correction / bonus token, the next pending one); the window after the last step. The cache then
      holds the input token and every emitted token but the last; positions past that may hold stale K/V
      (never read: module doc). Idle rows' outputs are meaningless.
    """
    if iters < 1 or num_draft < 1:
        raise ValueError(f"iters and num_draft must be >= 1, got {iters}, {num_draft}")
    b, q = tokens.shape
    k, w = num_draft, window_tokens.shape[1]
    if q < 1 + k:
        raise ValueError(f"tokens has {q} columns; a verify step needs 1 + num_draft = {1 + k}")
    cols = jnp.arange(q, dtype=jnp.int32)[None]
    dt = jnp.dtype(cfg.dtype)

    def body(carry, _):
        cache, pending, pos, win_h, win_t, win_n = carry
        live = pos >= 0
        drafts = draft_greedy(params, mtp, cfg, win_h, win_t, win_n, pos, pending, k)
        vtok = jnp.zeros((b, q), jnp.int32).at[:, 0].set(pending).at[:, 1:1 + k].set(drafts)
        vpos = jnp.where(live[:, None] & (cols <= k), pos[:, None] + cols, -1)
        logits, hidden, cache = model_step(params, cache, vtok, vpos, page_table, cfg=cfg, spec=spec, path="paged",
                                           implementation=implementation, return_hidden=True)
        best = jnp.argmax(logits[:, :k + 1].astype(jnp.float32), axis=-1).astype(jnp.int32)
        acc, nxt = accept_greedy_counts(best, drafts)
        emit = jnp.where(cols[:, :k + 1] < acc[:, None], jnp.concatenate([drafts, nxt[:, None]], 1), nxt[:, None])
        # the window takes the fed tokens [pending, d_1..d_acc] and their hidden states
        shift = (acc + 1)[:, None] + jnp.arange(w, dtype=jnp.int32)[None]
        new_t = jnp.take_along_axis(jnp.concatenate([win_t, vtok[:, :k + 1]], 1), shift, axis=1)
        new_h = jnp.take_along_axis(jnp.concatenate([win_h, hidden[:, :k + 1].astype(dt)], 1), shift[..., None],
                                    axis=1)
        win_t = jnp.where(live[:, None], new_t, win_t)
        win_h = jnp.where(live[:, None, None], new_h, win_h)
        win_n = jnp.where(live, jnp.minimum(win_n + acc + 1, w), win_n)
        pending = jnp.where(live, nxt, pending)
        pos = jnp.where(live, pos + acc + 1, -1)
        return (cache, pending, pos, win_h, win_t, win_n), (emit, acc)

    init = (cache, tokens[:, 0].astype(jnp.int32), positions[:, 0].astype(jnp.int32), window_hidden.astype(dt),
            window_tokens.astype(jnp.int32), window_count.astype(jnp.int32))
    (cache, _, _, win_h, win_t, win_n), (emitted, accepted) = jax.lax.scan(body, init, None, length=iters)
    return jnp.moveaxis(emitted, 0, 1), accepted.T, (win_h, win_t, win_n), cache
