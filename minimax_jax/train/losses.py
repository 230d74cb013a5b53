"""Loss terms: next-token cross-entropy (+ z-loss), MTP targets and masks, indexer-KL normalisation.

Every function returns SUMS (not means) so that gradient accumulation and data parallelism can
divide by the global count once: the loss of a step is ``sum over the global batch / global count``,
identical however the batch is split into micro-batches or devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["cross_entropy_sums", "mtp_targets", "mtp_weights_list"]


def cross_entropy_sums(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Masked next-token cross-entropy and z-loss sums.

    Args:
      logits: ``[B, T, V]`` (any float dtype; computed in float32).
      targets: ``[B, T]`` int32 target ids.
      mask: ``[B, T]`` float weights (the pipeline's ``loss_mask``).
    Returns: ``(sum of mask * (lse - logit[target]), sum of mask * lse^2)`` as float32 scalars.
    """
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    mask = mask.astype(jnp.float32)
    return jnp.sum((lse - tgt) * mask), jnp.sum(jnp.square(lse) * mask)


def mtp_targets(targets: jax.Array, loss_mask: jax.Array, segment_ids: jax.Array, depth: int):
    """Targets and mask of MTP depth ``depth`` (1-based).

    ``mtp_forward``'s depth d predicts, at position t, the token ``t + d + 1``, i.e. ``targets[t + d]``.
    The position counts only when ``t + d < T``, ``targets[t + d]`` is a real target of the same
    document (``loss_mask[t + d]``) and token ``t + d`` is in the same document as token t.

    Returns: ``(targets_d [B,T] int32, mask_d [B,T] float32)``.
    """
    t = targets.shape[1]
    pad = ((0, 0), (0, depth))
    tgt = jnp.pad(targets[:, depth:], pad)
    m = jnp.pad(loss_mask[:, depth:].astype(jnp.float32), pad)
    same = jnp.pad((segment_ids[:, depth:] == segment_ids[:, : t - depth]).astype(jnp.float32), pad) if depth < t \
        else jnp.zeros_like(m)
    return tgt.astype(jnp.int32), m * same


def mtp_weights_list(weights, num_modules: int) -> tuple[float, ...]:
    """Per-depth MTP weights from a number (same for all depths) or a list (one per module)."""
    if not num_modules:
        return ()
    if isinstance(weights, (list, tuple)):
        if len(weights) != num_modules:
            raise ValueError(f"mtp_weights has {len(weights)} entries for {num_modules} MTP modules")
        return tuple(float(w) for w in weights)
    return (float(weights),) * num_modules
