"""Speculative-sampling acceptance (Leviathan et al. 2023; Chen et al. 2023).

Given drafts ``d_1..d_k`` drawn from draft distributions ``q_1..q_k`` and the target model's
distributions ``p_1..p_{k+1}`` from ONE verification step (``p_i`` is the distribution of the token
at the position of ``d_i``; ``p_{k+1}`` follows the last draft):

* for ``i = 1..k``: accept ``d_i`` with probability ``min(1, p_i(d_i) / q_i(d_i))``; on the first
  rejection draw the replacement from ``norm(max(0, p_i - q_i))`` and stop;
* if all ``k`` are accepted, draw a bonus token from ``p_{k+1}``.

Every emitted token is then distributed exactly as if drawn from the target model one at a time.
Greedy decoding is the deterministic special case: accept ``d_i`` iff it equals the target's
argmax (lowest id on ties), replace it by that argmax otherwise; the output equals plain greedy.
The rule itself is ``minimax_jax.decode.spec_loop.accept_greedy_counts`` (shared with the device loop).
"""

from __future__ import annotations

import numpy as np

from minimax_jax.decode.spec_loop import accept_greedy_counts

__all__ = ["accept_greedy", "accept_sampled"]


def accept_greedy(target_logits: np.ndarray, drafts: np.ndarray) -> tuple[int, int]:
    """Greedy verification.

    Args: target_logits ``[k+1, V]``; drafts ``[k]``.
    Returns: ``(accepted, next_token)``: the number of drafts kept and the token after them.
    """
    best = np.argmax(np.asarray(target_logits, np.float32), axis=-1)
    accepted, nxt = accept_greedy_counts(best, np.asarray(drafts, np.int64).reshape(-1))
    return int(accepted), int(nxt)


def accept_sampled(target_probs: np.ndarray, draft_probs: np.ndarray, drafts: np.ndarray,
                   rng: np.random.Generator) -> tuple[int, int]:
    """Stochastic verification (module doc).

    Args:
      target_probs: ``[k+1, V]`` target distributions (already temperature / top-k / top-p filtered).
      draft_probs: ``[k, V]`` the distributions the drafts were drawn from.
      drafts: ``[k]`` token ids. rng: the row's generator.
    Returns: ``(accepted, next_token)``.
    Raises: ValueError on shape mismatch.
    """
    k = len(drafts)
    if target_probs.shape[0] != k + 1 or draft_probs.shape[0] != k:
        raise ValueError(f"need {k + 1} target and {k} draft distributions, got "
                         f"{target_probs.shape[0]} and {draft_probs.shape[0]}")
    for i in range(k):
        d = int(drafts[i])
        p, q = float(target_probs[i, d]), float(draft_probs[i, d])
        if q > 0 and rng.random() < min(1.0, p / q):
            continue
        residual = np.maximum(target_probs[i] - draft_probs[i], 0.0)
        total = residual.sum()
        # total == 0 only when p == q up to rounding; then p itself is the right distribution.
        dist = residual / total if total > 0 else target_probs[i] / target_probs[i].sum()
        return i, int(rng.choice(len(dist), p=dist))
    last = target_probs[k] / target_probs[k].sum()
    return k, int(rng.choice(len(last), p=last))
