"""optax optimizer: AdamW + global-norm clipping + schedules + weight-decay and freezing masks.

Parameters are addressed by '/'-joined paths of the params tree, e.g. ``segments/1/attn/q_proj``,
``mtp/0/layer/mlp/router_bias`` (docs/ARCHITECTURE.md). ``optim.freeze`` regexes are matched with
``re.search`` against these paths.

Masks:
- weight decay: off for every norm scale (path contains ``norm``), every bias (path ends in ``bias``)
  and the MoE ``router_bias``; on for the other weights (embedding and lm_head included);
- trainable: off for ``optim.freeze`` matches and always for ``router_bias`` (it is moved by the
  aux-loss-free balancing rule, ``minimax_jax.model.router_bias``; a ``router_bias`` a freeze regex
  matches is held there too, ``held_router_biases``), and off for MTP modules whose loss is not computed
  (trailing zero ``optim.mtp_weights``: weight decay would otherwise move them). In the MSA warm-up phase
  with ``msa.freeze_backbone_in_warmup`` only the index branch (``index_*``) is trainable.

Frozen leaves go through ``optax.set_to_zero`` inside ``optax.multi_transform`` (no Adam moments are
kept for them) and the step function also ``stop_gradient``s them, so XLA drops their backward pass.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from minimax_jax.train.config import TrainConfig
from minimax_jax.train.losses import mtp_weights_list

__all__ = ["path_of", "leaf_paths", "decay_mask", "trainable_mask", "held_router_biases", "make_schedule",
           "make_optimizer", "resume_schedule_check",
           "PHASE_WARMUP", "PHASE_MAIN", "INDEX_PARAM_PATTERN"]

PHASE_WARMUP = "indexer_warmup"
PHASE_MAIN = "main"
INDEX_PARAM_PATTERN = r"/index_(q|k)_(proj|norm)(/|$)"


def path_of(key_path) -> str:
    """'/'-joined string of a jax key path (dict keys and list indices)."""
    parts = []
    for k in key_path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(str(k.name))
        else:
            parts.append(str(k))
    return "/".join(parts)


def leaf_paths(tree: Any) -> list[str]:
    """Paths of every leaf, in ``jax.tree.leaves`` order."""
    return [path_of(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _map_paths(fn: Callable[[str], Any], tree: Any) -> Any:
    return jax.tree_util.tree_map_with_path(lambda p, _: fn(path_of(p)), tree)


def decay_mask(tree: Any) -> Any:
    """Bool tree: True where weight decay applies (see module docstring)."""
    def decays(path: str) -> bool:
        name = path.rsplit("/", 1)[-1]
        return not ("norm" in path or name.endswith("bias") or name == "scale")
    return _map_paths(decays, tree)


def trainable_mask(tree: Any, freeze: tuple[str, ...] = (), only_index: bool = False,
                   mtp_computed: int | None = None) -> Any:
    """Bool tree: True for leaves the optimizer trains (see module docstring); ``mtp_computed``: MTP modules
    whose loss is computed (the first ones; None: all)."""
    pats = [re.compile(p) for p in freeze]
    index = re.compile(INDEX_PARAM_PATTERN)
    idle = re.compile(r"^mtp/(\d+)/")

    def trains(path: str) -> bool:
        if path.endswith("router_bias"):
            return False
        m = idle.match(path)
        if mtp_computed is not None and m and int(m.group(1)) >= mtp_computed:
            return False
        if only_index and not index.search(path):
            return False
        return not any(p.search(path) for p in pats)
    return _map_paths(trains, tree)


def held_router_biases(tree: Any, freeze: tuple[str, ...] = ()) -> Any:
    """Bool tree: True for the ``router_bias`` leaves an ``optim.freeze`` regex matches (the balancing rule
    leaves them as they are), False elsewhere."""
    pats = [re.compile(p) for p in freeze]
    return _map_paths(lambda path: path.endswith("router_bias") and any(p.search(path) for p in pats), tree)


def make_schedule(tc: TrainConfig, phase: str = PHASE_MAIN) -> optax.Schedule:
    """Learning rate as a function of the optimizer's own step count.

    The main phase runs ``run.steps - msa.indexer_warmup_steps`` steps; the MSA warm-up phase uses
    a linear warm-up to ``msa.warmup_lr`` (default ``optim.lr``), then holds it (``msa.warmup_schedule:
    constant``) or decays it by a cosine to ``schedule.min_lr_ratio`` of it at its last step (``cosine``).
    """
    s, lr = tc.schedule, float(tc.optim.lr)
    warm_msa = tc.msa.indexer_warmup_steps
    if phase == PHASE_WARMUP:
        peak = float(tc.msa.warmup_lr or lr)
        w = min(s.warmup_steps, max(warm_msa // 10, 1))
        if tc.msa.warmup_schedule == "cosine":
            # the floor at the last warm-up step (optimizer count warm_msa - 1)
            return optax.warmup_cosine_decay_schedule(0.0, peak, w, max(warm_msa - 1, w + 1), peak * float(s.min_lr_ratio))
        return optax.join_schedules([optax.linear_schedule(0.0, peak, w), optax.constant_schedule(peak)], [w])
    total = max(tc.run.steps - warm_msa, 1)
    w = min(s.warmup_steps, total)
    end = lr * float(s.min_lr_ratio)
    if s.kind == "constant":
        return optax.join_schedules([optax.linear_schedule(0.0, lr, w), optax.constant_schedule(lr)], [w])
    if s.kind == "cosine":
        decay = s.decay_steps or max(total - w, 1)
        return optax.warmup_cosine_decay_schedule(0.0, lr, w, w + decay, end)
    # WSD: warm-up, stable, then linear decay over the last decay_fraction of the steps.
    d = max(int(round(s.decay_fraction * total)), 1)
    stable_end = max(total - d, w)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, lr, w), optax.constant_schedule(lr), optax.linear_schedule(lr, end, d)],
        [w, stable_end])


def resume_schedule_check(tc: TrainConfig, saved_steps: int, step: int,
                          saved: TrainConfig | None = None) -> tuple[bool, str] | None:
    """A resume at ``step`` of a run whose checkpoint was trained with ``run.steps = saved_steps``, now
    ``tc.run.steps``: None when ``run.steps`` is unchanged, else ``(ok, one line)``. ``saved``: the checkpoint's
    training config (its schedule and learning rate are the curve trained so far; None: ``tc``'s).

    The main phase's schedule depends on ``run.steps`` (cosine without ``schedule.decay_steps``, WSD). ``ok``:
    the learning rates of every step trained so far are those the new ``run.steps`` gives too (e.g. WSD still
    in its stable phase, a constant schedule, ``schedule.decay_steps`` set): the run continues on the new
    schedule. Otherwise the new schedule would change the curve the checkpoint's optimizer was trained on
    (a cosine stretched or squeezed mid-run): not ok, the line says how to extend a run instead.
    """
    import dataclasses

    import numpy as np

    if saved_steps == tc.run.steps:
        return None
    ref = tc if saved is None else dataclasses.replace(tc, schedule=saved.schedule, optim=saved.optim, msa=saved.msa)
    before = dataclasses.replace(ref, run=dataclasses.replace(tc.run, steps=int(saved_steps)))
    warm = tc.msa.indexer_warmup_steps
    n = max(int(step) - warm, 0)             # main-phase optimizer steps trained (its count starts after the warm-up)
    change = f"run.steps {saved_steps} -> {tc.run.steps}"
    if n:
        counts = jnp.arange(n)
        old = np.asarray(jax.device_get(make_schedule(before)(counts)), np.float64)
        new = np.asarray(jax.device_get(make_schedule(tc)(counts)), np.float64)
        bad = np.flatnonzero(~np.isclose(old, new, rtol=1e-5, atol=1e-12))
        if bad.size:
            i = int(bad[0])
            kind = tc.schedule.kind
            total = max(saved_steps - warm, 1)         # make_schedule's warm-up and decay of the checkpoint's run
            w_old = min(before.schedule.warmup_steps, total)
            decay = before.schedule.decay_steps or max(total - w_old, 1)
            w_new = min(tc.schedule.warmup_steps, max(tc.run.steps - warm, 1))
            keep_w = f" schedule.warmup_steps={w_old}" if w_old != w_new else ""   # a warm-up clipped to run.steps
            fix = {"cosine": f"; to train past this schedule's end at its final learning rate, keep its cosine "
                             f"with --set schedule.decay_steps={decay}{keep_w}",
                   "wsd": "; a WSD run can be extended while it is in its stable phase, not once its decay began"
                   }.get(kind, "")
            return False, (f"{change} would change the learning rate of steps already trained ({kind} schedule: step "
                           f"{warm + i + 1} was trained at {old[i]:.4g}, the new run.steps gives {new[i]:.4g}), so the "
                           f"checkpoint's optimizer would continue on another curve; resume with run.steps="
                           f"{saved_steps}{fix}, or start a new run from an export of this one (init.mode: checkpoint)")
    return True, (f"{change}: the learning rates of the {step} steps trained so far are unchanged "
                  f"({tc.schedule.kind} schedule); continuing on the schedule of {tc.run.steps} steps")


def make_optimizer(tc: TrainConfig, params_like: Any, phase: str = PHASE_MAIN) -> tuple[optax.GradientTransformation, Any, optax.Schedule]:
    """Build the optax transformation for a phase.

    Args:
      tc: training config (optim, schedule, msa sections).
      params_like: params or abstract params (only the tree structure and paths are used).
      phase: ``PHASE_MAIN`` or ``PHASE_WARMUP``.
    Returns: ``(tx, trainable bool tree, schedule)``.
    """
    o = tc.optim
    only_index = phase == PHASE_WARMUP and tc.msa.freeze_backbone_in_warmup
    n_mtp = len(params_like.get("mtp", ())) if isinstance(params_like, dict) else 0
    computed = len(mtp_weights_list(o.mtp_weights, n_mtp)) if n_mtp else None
    paths = leaf_paths(params_like)
    for pat in o.freeze:
        if not any(re.search(pat, p) for p in paths):
            raise ValueError(f"optim.freeze pattern {pat!r} matches no parameter (paths look like {paths[0]!r}, "
                             f"{paths[-1]!r})")
    train = trainable_mask(params_like, tuple(o.freeze), only_index, computed)
    if not any(jax.tree.leaves(train)):
        raise ValueError("no trainable parameters: optim.freeze (and the phase) freezes every leaf")
    schedule = make_schedule(tc, phase)
    parts = []
    if o.clip_norm > 0:
        parts.append(optax.clip_by_global_norm(float(o.clip_norm)))
    parts.append(optax.adamw(schedule, b1=float(o.b1), b2=float(o.b2), eps=float(o.eps),
                             mu_dtype=None if o.mu_dtype is None else jnp.dtype(o.mu_dtype),
                             weight_decay=float(o.weight_decay), mask=decay_mask))
    labels = jax.tree.map(lambda t: "train" if t else "frozen", train)
    tx = optax.multi_transform({"train": optax.chain(*parts), "frozen": optax.set_to_zero()}, labels)
    return tx, train, schedule
