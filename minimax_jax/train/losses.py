"""Loss terms: next-token cross-entropy (+ z-loss), MTP targets and masks, indexer-KL normalisation.

Every function returns SUMS (not means) so that gradient accumulation and data parallelism can
divide by the global count once: the loss of a step is ``sum over the global batch / global count``,
identical however the batch is split into micro-batches or devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from minimax_jax.ops.logits import logits_matmul
from minimax_jax.sharding import constrain

__all__ = ["cross_entropy_sums", "chunked_cross_entropy_sums", "greedy_ids", "mtp_targets", "mtp_weights_list"]


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


def chunked_cross_entropy_sums(head_input: jax.Array, head_weight: jax.Array, targets: jax.Array, mask: jax.Array,
                               chunk: int) -> tuple[jax.Array, jax.Array]:
    """``cross_entropy_sums(head_input @ head_weight, targets, mask)`` without the ``[B, T, V]`` logits.

    The sequence is cut into ``chunk``-token slices; a ``lax.scan`` computes each slice's logits
    ``[B, chunk, V]`` (float32 accumulation), its log-sum-exp and target logit, and keeps only the
    two sums. Each slice is rematerialised in the backward pass (``jax.checkpoint``), so forward and
    backward hold one slice's logits at a time: at M3's 200,064-token vocabulary a 64K-token row's
    full logits are 52 GB in float32, a 1,024-token slice's 0.8 GB. The extra cost is one more
    lm-head matmul in the backward pass. ``T`` not a multiple of ``chunk`` is padded (masked out).
    The technique is the chunked ("fused linear") cross-entropy of large-vocabulary trainers (e.g.
    Liger-Kernel's FusedLinearCrossEntropy, Wijmans et al. 2024 "Cut Your Losses"), here with XLA
    remat instead of a custom kernel.

    Args:
      head_input: ``[B, T, H]`` final-normed hidden state (``forward(..., return_logits=False)``).
      head_weight: ``[H, V]`` output projection (``lm_head_weight``; cast to ``head_input``'s dtype).
      targets: ``[B, T]`` int target ids. mask: ``[B, T]`` float weights.
      chunk: tokens per slice (>= 1).
    Returns: ``(sum of mask * (lse - logit[target]), sum of mask * lse^2)`` float32 scalars.
    Raises: ValueError for ``chunk < 1`` or mismatched shapes.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    b, t, h = head_input.shape
    if targets.shape != (b, t) or mask.shape != (b, t) or head_weight.shape[0] != h:
        raise ValueError(f"chunked_cross_entropy_sums: head_input {head_input.shape}, head_weight "
                         f"{head_weight.shape}, targets {targets.shape}, mask {mask.shape} do not match")
    n = -(-t // chunk)
    pad = n * chunk - t
    xs = (head_input, targets.astype(jnp.int32), mask.astype(jnp.float32))
    if pad:
        xs = tuple(jnp.pad(a, ((0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 2)) for a in xs)
    # [B, n*chunk, ...] -> [n, B, chunk, ...]: the scan walks the slices, the batch keeps its sharding
    xs = tuple(jnp.swapaxes(a.reshape(b, n, chunk, *a.shape[2:]), 0, 1) for a in xs)
    w = head_weight.astype(head_input.dtype)

    @jax.checkpoint
    def slice_sums(hc, tc, mc, w):
        logits = logits_matmul(hc, w)
        logits = constrain(logits, ("batch", "length", "act_vocab"))
        return cross_entropy_sums(logits, tc, mc)

    def body(carry, x):
        ce, zs = slice_sums(*x, w)
        return (carry[0] + ce, carry[1] + zs), None

    zero = jnp.zeros((), jnp.float32)
    (ce, zs), _ = jax.lax.scan(body, (zero, zero), xs)
    return ce, zs


def greedy_ids(head_out: jax.Array, head_weight: jax.Array | None = None, chunk: int = 0) -> jax.Array:
    """The model's own greedy next tokens ``argmax`` over the vocabulary, ``[B, T]`` int32, no gradient.

    ``head_out`` is ``[B, T, V]`` logits (``chunk == 0``) or the lm head's ``[B, T, H]`` input, then the
    logits are formed ``chunk`` tokens at a time (as ``chunked_cross_entropy_sums``). Ties take the lowest
    id, as greedy decoding's ``argmax`` does. These are the targets of ``optim.mtp_targets: self`` (an MTP
    drafter is accepted when it predicts the main model's greedy token, not the data's).
    """
    head_out = jax.lax.stop_gradient(head_out)
    if not chunk:
        return jnp.argmax(head_out, axis=-1).astype(jnp.int32)
    b, t, h = head_out.shape
    n = -(-t // chunk)
    x = jnp.pad(head_out, ((0, 0), (0, n * chunk - t), (0, 0)))
    x = jnp.swapaxes(x.reshape(b, n, chunk, h), 0, 1)
    w = jax.lax.stop_gradient(head_weight).astype(head_out.dtype)
    ids = jax.lax.map(lambda hc: jnp.argmax(logits_matmul(hc, w), axis=-1).astype(jnp.int32), x)
    return jnp.swapaxes(ids, 0, 1).reshape(b, n * chunk)[:, :t]


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
    """Per-depth MTP weights from a number (same for all depths) or a list (one per module). Trailing
    zero weights are dropped (those depths are not computed at all), so ``0`` turns MTP off."""
    if not num_modules:
        return ()
    if isinstance(weights, (list, tuple)):
        if len(weights) != num_modules:
            raise ValueError(f"mtp_weights has {len(weights)} entries for {num_modules} MTP modules")
        ws = [float(w) for w in weights]
    else:
        ws = [float(weights)] * num_modules
    while ws and ws[-1] == 0.0:
        ws.pop()
    return tuple(ws)
