"""The training step: loss terms, gradient accumulation over micro-batches, optimizer update, router
bias update. Pure functions of ``(state, batch)``; ``minimax_jax.train.loop`` jits them with shardings.

State (a plain dict so orbax saves it as one pytree)::

    {"params": params tree, "opt_state": optax state, "step": int32 [], "rng": uint32 [2] key data}

Loss of one step (every term is a global mean over the step's whole batch, however it is split into
micro-batches and devices)::

    lm        = sum(mask * CE) / sum(mask)
    z         = optim.z_loss * sum(mask * lse^2) / sum(mask)
    mtp_d     = sum(mask_d * CE_d) / sum(mask_d)        weighted by optim.mtp_weights[d]
    kl        = indexer_kl_sum / indexer_kl_count      (mean over micro-batches) times msa.kl_coeff
    aux       = optim.aux_loss * aux["moe_aux_loss"]   (only when the model reports it)

Prefix-tree batches (``minimax_jax.data.prefix_tree``) also hold ``subtree_end`` (attention visibility)
and ``loss_index``: target t is predicted from the logits of slot ``loss_index[t]`` (its parent in the
tree), so a branch point's logits serve every child, and ``input_weight`` (how many unmerged input
positions a slot stands for), which weights the MSA indexer-KL rows: the merged loss and gradients equal the
unmerged batch's; with ``data.key_len`` also the per-trajectory key layout (``KEY_KEYS``), with which MSA
layers run the ordinary MSA kernels (``minimax_jax.model.msa_block``). MTP is refused on them (its shifted tokens are not defined at a branch point).

After the optimizer update the MoE ``router_bias`` moves by
``optim.router_bias_rate * sign(mean_load - load)`` with the load summed over the whole step
(``minimax_jax.model.router_bias.update_router_biases``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from minimax_jax.config import ModelConfig
from minimax_jax.data.prefix_tree import KEY_KEYS
from minimax_jax.model import forward, mtp_forward
from minimax_jax.model.transformer import lm_head_weight
from minimax_jax.model.router_bias import update_router_biases
from minimax_jax.train.losses import chunked_cross_entropy_sums, cross_entropy_sums, greedy_ids, mtp_targets

__all__ = ["StepSpec", "init_state", "make_train_step", "make_eval_step", "BATCH_KEYS", "batch_norms"]

BATCH_KEYS = ("tokens", "targets", "segment_ids", "positions", "loss_mask")
TREE_KEYS = ("subtree_end", "loss_index", "input_weight") + KEY_KEYS   # only in prefix-tree batches (KEY_KEYS
                                                                       # with data.key_len)


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """Static settings of a step function (hashable)."""

    cfg: ModelConfig
    kl_mode: str | None = None
    kl_coeff: float = 1.0
    z_loss: float = 0.0
    aux_loss: float = 0.0
    mtp_weights: tuple[float, ...] = ()
    grad_accum: int = 1
    remat: str = "none"
    router_bias_rate: float = 0.0
    logits_chunk: int = 0     # tokens per lm-head + CE slice (0 = whole [B,T,V] logits)
    mtp_self_targets: bool = False   # MTP targets = the main model's greedy tokens (optim.mtp_targets: self)


def init_state(params: Any, tx: optax.GradientTransformation, seed: int) -> dict[str, Any]:
    """Fresh training state for ``params``."""
    return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32),
            "rng": jax.random.key_data(jax.random.key(seed))}


def batch_norms(batch: dict[str, jax.Array], num_mtp: int) -> dict[str, jax.Array]:
    """Global token counts of the loss terms (at least 1): ``tokens`` and ``mtp{d}``."""
    mask = batch["loss_mask"].astype(jnp.float32)
    norms = {"tokens": jnp.maximum(jnp.sum(mask), 1.0)}
    for d in range(1, num_mtp + 1):
        _, m = mtp_targets(batch["targets"], mask, batch["segment_ids"], d)
        norms[f"mtp{d}"] = jnp.maximum(jnp.sum(m), 1.0)
    return norms


def _ce_sums(params, cfg: ModelConfig, chunk: int, head_out: jax.Array, targets, mask, loss_index=None):
    """CE / z sums from logits (``chunk == 0``) or from the lm head's input, slice by slice; with
    ``loss_index`` ``[B, T]`` target t is scored on row ``loss_index[t]`` of ``head_out``."""
    if loss_index is not None:
        head_out = jnp.take_along_axis(head_out, loss_index[..., None].astype(jnp.int32), axis=1)
    if chunk:
        return chunked_cross_entropy_sums(head_out, lm_head_weight(params, cfg), targets, mask, chunk)
    return cross_entropy_sums(head_out, targets, mask)


def _tree_keys(batch) -> dict | None:
    """The per-trajectory key layout of a prefix-tree batch packed with ``data.key_len``, else None."""
    return {k: batch[k] for k in KEY_KEYS} if KEY_KEYS[0] in batch else None


def _loss_fn(spec: StepSpec, trainable: Any):
    cfg = spec.cfg
    num_mtp = len(spec.mtp_weights)
    chunk = spec.logits_chunk

    def loss(params, mb, norms):
        # Frozen leaves get no gradient at all, so XLA drops their part of the backward pass.
        p = jax.tree.map(lambda x, t: x if t else jax.lax.stop_gradient(x), params, trainable)
        if num_mtp and "loss_index" in mb:
            raise ValueError("MTP losses are not defined on prefix-tree batches; set optim.mtp_weights: 0 or "
                             "use a model without MTP modules")
        out = forward(p, cfg, mb["tokens"], positions=mb["positions"], segment_ids=mb["segment_ids"],
                      indexer_kl=spec.kl_mode, return_hidden=num_mtp > 0, remat=spec.remat,
                      return_logits=not chunk, subtree_end=mb.get("subtree_end"),
                      input_weight=mb.get("input_weight"), tree_keys=_tree_keys(mb))
        ce, zs = _ce_sums(p, cfg, chunk, out.head_input if chunk else out.logits, mb["targets"], mb["loss_mask"],
                          mb.get("loss_index"))
        m = {"lm_loss": ce / norms["tokens"]}
        total = m["lm_loss"]
        if spec.z_loss:
            m["z_loss"] = spec.z_loss * zs / norms["tokens"]
            total = total + m["z_loss"]
        if num_mtp:
            outs = mtp_forward(p, cfg, out.hidden, mb["tokens"], positions=mb["positions"],
                               segment_ids=mb["segment_ids"], return_logits=not chunk)
            base = mb["targets"]
            if spec.mtp_self_targets:
                base = greedy_ids(out.head_input if chunk else out.logits,
                                  lm_head_weight(p, cfg) if chunk else None, chunk)
            for d, (lg, w) in enumerate(zip(outs, spec.mtp_weights), start=1):
                tgt, md = mtp_targets(base, mb["loss_mask"], mb["segment_ids"], d)
                ce_d, _ = _ce_sums(p, cfg, chunk, lg, tgt, md)
                m[f"mtp_loss/{d}"] = ce_d / norms[f"mtp{d}"]
                total = total + w * m[f"mtp_loss/{d}"]
        if spec.kl_mode is not None:
            cnt = jnp.maximum(out.aux["indexer_kl_count"].astype(jnp.float32), 1.0)
            m["indexer_kl"] = out.aux["indexer_kl_sum"] / cnt / spec.grad_accum
            total = total + spec.kl_coeff * m["indexer_kl"]
        if spec.aux_loss:
            if "moe_aux_loss" not in out.aux:
                raise ValueError("optim.aux_loss > 0 but the model forward does not report aux['moe_aux_loss']")
            m["moe_aux_loss"] = out.aux["moe_aux_loss"] / spec.grad_accum
            total = total + spec.aux_loss * m["moe_aux_loss"]
        m["router_load"] = out.aux["router_load"]
        m["loss"] = total
        return total, m

    return loss


def _split_micro(x: jax.Array, accum: int) -> jax.Array:
    # Row r goes to micro-batch r % accum, so a batch sharded on rows stays sharded on rows.
    return jnp.swapaxes(x.reshape(x.shape[0] // accum, accum, *x.shape[1:]), 0, 1)


def _load_stats(load: jax.Array) -> dict[str, jax.Array]:
    if load.size == 0:
        return {}
    mean = jnp.maximum(jnp.mean(load, axis=-1), 1e-9)
    return {"moe/max_load_ratio": jnp.mean(jnp.max(load, axis=-1) / mean),
            "moe/load_cv": jnp.mean(jnp.std(load, axis=-1) / mean)}


def make_train_step(spec: StepSpec, tx: optax.GradientTransformation, trainable: Any,
                    schedule: Callable, phase_start: int = 0, hold: Any = None) -> Callable:
    """``step(state, batch) -> (state, metrics)`` (not jitted).

    Args:
      spec: static settings; tx / trainable: from ``make_optimizer``; schedule: its lr schedule;
      phase_start: global step at which this phase's optimizer started (for the logged lr);
      hold: optional bool tree (``optimizer.held_router_biases``): router biases the balancing rule leaves.
    The batch holds ``BATCH_KEYS`` arrays ``[B, L]``; B must be divisible by ``spec.grad_accum``.
    """
    cfg = spec.cfg
    grad_fn = jax.value_and_grad(_loss_fn(spec, trainable), has_aux=True)
    accum = spec.grad_accum

    def step(state, batch):
        params = state["params"]
        batch = {k: batch[k] for k in BATCH_KEYS + TREE_KEYS if k in batch}
        norms = batch_norms(batch, len(spec.mtp_weights))
        if accum == 1:
            (_, metrics), grads = grad_fn(params, batch, norms)
        else:
            micro = jax.tree.map(lambda x: _split_micro(x, accum), batch)

            def body(carry, mb):
                (_, m), g = grad_fn(params, mb, norms)
                return jax.tree.map(jnp.add, carry, (g, m)), None

            first = jax.tree.map(lambda x: x[0], micro)
            m_shape = jax.eval_shape(lambda: grad_fn(params, first, norms)[0][1])
            zeros = (jax.tree.map(jnp.zeros_like, params),
                     jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), m_shape))
            (grads, metrics), _ = jax.lax.scan(body, zeros, micro)
        grad_norm = optax.tree.norm(jax.tree.map(lambda g, t: g if t else jnp.zeros((), g.dtype), grads, trainable))
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        load = metrics.pop("router_load")
        if spec.router_bias_rate and cfg.num_moe_layers:
            moved = update_router_biases(new_params, cfg, load, spec.router_bias_rate)
            new_params = moved if hold is None else jax.tree.map(lambda m, n, h: n if h else m, moved, new_params,
                                                                 hold)
        metrics.update(_load_stats(load))
        metrics["grad_norm"] = grad_norm
        metrics["lr"] = jnp.asarray(schedule(state["step"] - phase_start), jnp.float32)
        metrics["tokens"] = jnp.sum(batch["loss_mask"].astype(jnp.float32))
        new_state = {"params": new_params, "opt_state": opt_state, "step": state["step"] + 1, "rng": state["rng"]}
        return new_state, {k: v.astype(jnp.float32) for k, v in metrics.items()}

    return step


def make_eval_step(cfg: ModelConfig, logits_chunk: int = 0) -> Callable:
    """``eval(params, batch) -> (ce_sum, token_count)`` float32 scalars (no MTP, no KL); ``logits_chunk``
    as in ``StepSpec``."""
    def eval_step(params, batch):
        out = forward(params, cfg, batch["tokens"], positions=batch["positions"], segment_ids=batch["segment_ids"],
                      return_logits=not logits_chunk, subtree_end=batch.get("subtree_end"),
                      input_weight=batch.get("input_weight"), tree_keys=_tree_keys(batch))
        ce, _ = _ce_sums(params, cfg, logits_chunk, out.head_input if logits_chunk else out.logits,
                         batch["targets"], batch["loss_mask"], batch.get("loss_index"))
        return ce, jnp.sum(batch["loss_mask"].astype(jnp.float32))
    return eval_step
