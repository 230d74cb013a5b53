"""The training loop: mesh, state, phases, data, checkpoints, metrics, stop signals.

``train(tc)`` runs a ``TrainConfig`` to ``run.steps`` and returns a summary dict. Order of work:

1. model config (files only) and every check that can fail (``validate_against``): before any
   parameter is created or anything is compiled;
2. mesh and shardings (``minimax_jax.sharding``); the state is created / restored directly sharded;
3. resume: the newest readable checkpoint in ``run_dir/checkpoints`` (older ones on failure, with a
   warning); else the ``init`` section's params;
4. the loop: one jitted step per phase (MSA indexer warm-up with dense KL, then main), metrics every
   ``log_every`` steps (the first step of each phase, which compiles, apart: ``compile_s``, not in
   ``tokens_per_s``), async checkpoint every ``checkpoint.every`` steps, a final save, and on SIGINT /
   SIGTERM a save of the step in hand before returning (``interrupt``; a second Ctrl-C aborts).

The run holds ``run_dir``'s lock throughout (``run_lock``); a resume first drops the metrics /
TensorBoard records past the restored step (``metrics_truncate``), so every step is logged once. A resume
with another ``run.steps`` than the checkpoint's continues on the new schedule only when the learning rates
of the steps already trained stay the same (``optimizer.resume_schedule_check``; else TrainConfigError,
nothing written).

Multi-host (TPU pods, multi-node GPU): every process runs the same command after
``minimax_jax.distributed.initialize()``; each reads its own shard of the data (the pipeline uses
``jax.process_index()``), the global batch is assembled with ``jax.make_array_from_process_local_data``,
and orbax writes one checkpoint from all processes.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import jax
import numpy as np
import yaml

from minimax_jax.atomic_file import write_atomic
from minimax_jax.config import ModelConfig
from minimax_jax.model import abstract_params, params_shardings
from minimax_jax.ops.registry import implementation_report
from minimax_jax.sharding import load_rules, make_mesh, replicated, use_mesh, batch_sharding
from minimax_jax.train.checkpointing import Checkpointer
from minimax_jax.train.config import TrainConfig, TrainConfigError, from_dict, validate_against
from minimax_jax.train.data import decode_state, encode_state, make_iterator, to_global
from minimax_jax.interrupt import StopSignals
from minimax_jax.train.losses import mtp_weights_list
from minimax_jax.train.metrics import MetricsWriter, peak_flops_per_device, train_flops
from minimax_jax.train.metrics_truncate import truncate_after
from minimax_jax.train.model_init import initial_params, model_configs
from minimax_jax.train.optimizer import (PHASE_MAIN, PHASE_WARMUP, held_router_biases, make_optimizer, path_of,
                                        resume_schedule_check)
from minimax_jax.train.run_lock import RunLock
from minimax_jax.train.step import StepSpec, init_state, make_eval_step, make_train_step

__all__ = ["train", "Trainer", "resume_refusal"]


class Trainer:
    """Holds the mesh, shardings, optimizers and compiled steps of one run (see module docstring)."""

    def __init__(self, tc: TrainConfig, devices: list | None = None):
        self.tc = tc
        self.cfg, self.src_cfg = model_configs(tc)
        devices = list(jax.devices() if devices is None else devices)
        platform = {"cuda": "gpu", "rocm": "gpu"}.get(devices[0].platform, devices[0].platform)
        spec = validate_against(tc, self.cfg, len(devices), jax.process_count(), platform)
        n = spec.data * spec.fsdp * spec.expert * spec.sequence * spec.tensor
        self.mesh = make_mesh(spec, devices[:n])
        self.rules = load_rules("default")
        self.warmup_steps = tc.msa.indexer_warmup_steps if self.cfg.has_msa else 0
        self.param_sh = params_shardings(self.cfg, self.mesh, self.rules)
        self.batch_sh = batch_sharding(self.mesh, self.rules)
        self.rep = replicated(self.mesh)
        self.abstract = abstract_params(self.cfg)
        self._opt: dict[str, Any] = {}
        self._steps: dict[str, Any] = {}

    def mesh_context(self):
        """``use_mesh`` for tracing (sharding constraints, expert-parallel MoE); a no-op on one device."""
        return use_mesh(self.mesh, self.rules) if self.mesh.devices.size > 1 else contextlib.nullcontext()

    # ------------------------------------------------------------------ phases
    def phase_of(self, step: int) -> str:
        return PHASE_WARMUP if step < self.warmup_steps else PHASE_MAIN

    def optimizer(self, phase: str):
        if phase not in self._opt:
            self._opt[phase] = make_optimizer(self.tc, self.abstract, phase)
        return self._opt[phase]

    def state_shardings(self, phase: str) -> dict[str, Any]:
        tx, _, _ = self.optimizer(phase)
        opt_abs = jax.eval_shape(tx.init, self.abstract)
        opt_sh = _mirror_shardings(opt_abs, self.abstract, self.param_sh, self.rep)
        return {"params": self.param_sh, "opt_state": opt_sh, "step": self.rep, "rng": self.rep}

    def abstract_state(self, phase: str) -> dict[str, Any]:
        """ShapeDtypeStructs (with shardings) of the state of ``phase``: the restore target."""
        tx, _, _ = self.optimizer(phase)
        shapes = jax.eval_shape(lambda p: init_state(p, tx, 0), self.abstract)
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
                            self.state_shardings(phase))

    def fresh_opt_state(self, phase: str, params: Any) -> Any:
        tx, _, _ = self.optimizer(phase)
        return jax.jit(tx.init, out_shardings=self.state_shardings(phase)["opt_state"])(params)

    def router_bias_rate(self, phase: str) -> float:
        """The aux-loss-free balancing rate of ``phase``: 0 in an MSA warm-up with a frozen backbone
        (the router biases are backbone state: an indexer-only warm-up must leave the network that
        the selection serves unchanged), else ``optim.router_bias_rate``."""
        if phase == PHASE_WARMUP and self.tc.msa.freeze_backbone_in_warmup:
            return 0.0
        return float(self.tc.optim.router_bias_rate)

    def is_compiled(self, phase: str) -> bool:
        """Whether the train step of ``phase`` was built (its next call does not compile)."""
        return phase in self._steps

    def step_fn(self, phase: str):
        """The jitted train step of ``phase`` (compiled on first use)."""
        if phase not in self._steps:
            tc, cfg = self.tc, self.cfg
            tx, trainable, schedule = self.optimizer(phase)
            if phase == PHASE_WARMUP:
                kl_mode = "dense"
            else:
                kl_mode = "sparse" if cfg.has_msa and tc.msa.kl_coeff > 0 else None
            spec = StepSpec(cfg=cfg, kl_mode=kl_mode, kl_coeff=float(tc.msa.kl_coeff), z_loss=float(tc.optim.z_loss),
                            aux_loss=float(tc.optim.aux_loss),
                            mtp_weights=mtp_weights_list(tc.optim.mtp_weights, cfg.num_mtp_modules),
                            grad_accum=tc.optim.grad_accum, remat=tc.run.remat,
                            router_bias_rate=self.router_bias_rate(phase), logits_chunk=tc.run.logits_chunk,
                            mtp_self_targets=tc.optim.mtp_targets == "self")
            fn = make_train_step(spec, tx, trainable, schedule, 0 if phase == PHASE_WARMUP else self.warmup_steps,
                                 hold=held_router_biases(self.abstract, tuple(tc.optim.freeze)))
            sh = self.state_shardings(phase)
            self._steps[phase] = jax.jit(fn, in_shardings=(sh, self.batch_sh), out_shardings=(sh, self.rep),
                                         donate_argnums=(0,))
        return self._steps[phase]

    def initial_state(self) -> dict[str, Any]:
        phase = self.phase_of(0)
        src_sh = params_shardings(self.src_cfg, self.mesh, self.rules) if self.src_cfg is not None else None
        with self.mesh_context():
            params = initial_params(self.tc, self.cfg, self.src_cfg, self.param_sh, src_sh)
            tx, _, _ = self.optimizer(phase)
            sh = self.state_shardings(phase)
            make = jax.jit(lambda p: init_state(p, tx, self.tc.run.seed), out_shardings=sh)
            return make(params)

    def run_step(self, phase: str, state, batch):
        with self.mesh_context():
            return self.step_fn(phase)(state, to_global(batch, self.batch_sh))

    def evaluate(self, params) -> float:
        """Mean held-out loss over ``run.eval_batches`` batches of ``run.eval_sources``."""
        if not hasattr(self, "_eval"):
            self._eval = jax.jit(make_eval_step(self.cfg, self.tc.run.logits_chunk), in_shardings=(self.param_sh, self.batch_sh),
                                 out_shardings=(self.rep, self.rep))
        it = make_iterator(self.tc.data, self.cfg.vocab_size, sources=self.tc.run.eval_sources, eval_mode=True)
        ce = cnt = 0.0
        with self.mesh_context():
            for _, batch in zip(range(self.tc.run.eval_batches), it):
                a, b = self._eval(params, to_global(batch, self.batch_sh))
                ce, cnt = ce + float(a), cnt + float(b)
        return ce / max(cnt, 1.0)


def _mirror_shardings(tree: Any, params_abs: Any, params_sh: Any, default: Any) -> Any:
    """Shardings for an optimizer-state tree: a leaf whose path ENDS with a param's path and has the
    param's shape (Adam moments) takes that param's sharding; anything else (counts) ``default``."""
    by_path = {}
    for (kp, a), sh in zip(jax.tree_util.tree_flatten_with_path(params_abs)[0], jax.tree.leaves(params_sh)):
        by_path[path_of(kp)] = (tuple(a.shape), sh)

    def pick(kp, leaf):
        parts = path_of(kp).split("/")
        for i in range(len(parts)):
            hit = by_path.get("/".join(parts[i:]))
            if hit is not None and hit[0] == tuple(leaf.shape):
                return hit[1]
        return default
    return jax.tree_util.tree_map_with_path(pick, tree)


def _meta(tr: Trainer, step: int, phase: str) -> dict[str, Any]:
    return {"step": int(step), "phase": phase, "model_config": tr.cfg.to_dict(), "train_config": tr.tc.to_dict()}


def _check_meta(tr: Trainer, meta: dict[str, Any]) -> None:
    saved = ModelConfig.from_dict(meta["model_config"])
    ignore = {"attention_impl", "sliding_attention_impl", "moe_impl", "msa_impl", "dtype", "param_dtype"}  # restore casts dtypes
    diff = [k for k, v in saved.to_dict().items() if k not in ignore and tr.cfg.to_dict()[k] != v]
    if diff:
        raise TrainConfigError(f"the run directory's checkpoints were written for a different model config "
                               f"(fields {diff}); use a new run.run_dir or the original model settings")


def settings_changes(saved: dict[str, Any] | None, now: dict[str, Any]) -> list[str]:
    """``"section.key: old -> new"`` for every training setting that differs between the config a
    checkpoint was written with and the current one (``run`` and ``checkpoint`` sections excluded:
    extending ``run.steps`` or the save policy is a normal resume). Empty for old checkpoints
    without a saved config."""
    if not saved:
        return []

    def flat(d: Any, prefix: str = "") -> dict[str, Any]:
        if not isinstance(d, dict):
            return {prefix[:-1]: d}
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}."))
        return out

    a, b = flat(saved), flat(now)
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b))
            if k.split(".")[0] not in ("run", "checkpoint") and a.get(k) != b.get(k)]


def _saved_config(raw: dict[str, Any]) -> TrainConfig | None:
    """The checkpoint's training config (its ``train_config`` metadata), or None when it no longer parses (a
    config key renamed since): the resume check then rebuilds the trained curve from today's settings and says
    so in its line."""
    try:
        return from_dict(raw)
    except (TrainConfigError, TypeError, ValueError):
        return None


def _schedule_check(tc: TrainConfig, step: int, meta: dict[str, Any]) -> tuple[bool, str] | None:
    """``optimizer.resume_schedule_check`` of a resume at ``step`` from a checkpoint with ``meta``."""
    saved_raw = meta.get("train_config") or {}
    saved_steps = (saved_raw.get("run") or {}).get("steps")
    if saved_steps is None:
        return None
    saved = _saved_config(saved_raw)
    check = resume_schedule_check(tc, int(saved_steps), step, saved)
    if check is None or saved is not None:
        return check
    return check[0], (check[1] + " (the checkpoint's training config no longer parses: its curve was rebuilt from "
                       "today's schedule settings)")


def resume_refusal(tc: TrainConfig) -> str | None:
    """The one line a resume in ``tc.run.run_dir`` would be refused with because ``run.steps`` changes the
    learning rates already trained (``train`` raises TrainConfigError with it), or None. Reads only the newest
    checkpoint's metadata; writes nothing (``train.py --check_only``)."""
    directory = os.path.join(tc.run.run_dir, "checkpoints")
    if not tc.checkpoint.resume or not os.path.isdir(directory):
        return None
    ck = Checkpointer(directory, keep=None, async_save=False)
    try:
        got = ck.latest_meta()
    finally:
        ck.close()
    if got is None or got[0] >= tc.run.steps:
        return None
    check = _schedule_check(tc, got[0], got[1])
    return check[1] if check is not None and not check[0] else None


def _write_yaml_atomic(path: str, obj: Any) -> None:
    """Write ``obj`` as YAML to ``path`` via a temporary sibling renamed into place (never half-written)."""
    write_atomic(path, yaml.safe_dump(obj, sort_keys=False).encode())


def train(tc: TrainConfig, devices: list | None = None) -> dict[str, Any]:
    """Run training (see module docstring). Returns ``{"status", "step", "metrics", "run_dir", "checkpoint"}``.

    ``status``: ``completed`` | ``interrupted`` (SIGINT, saved) | ``preempted`` (SIGTERM, saved) |
    ``stopped`` (``run.stop_after``) | ``data_exhausted`` (a finite data stream ended; saved).
    ``checkpoint``: the directory of the last step this call saved (None when it saved none).
    Holds ``run_dir``'s lock for the whole run (``run_lock``); raises ``RunDirError`` when the
    directory cannot be written and ``RunDirLockedError`` when another process trains in it.
    """
    tr = Trainer(tc, devices)
    data_it = make_iterator(tc.data, tr.cfg.vocab_size)    # bad data fails here, before the run dir is touched
    lock = RunLock(tc.run.run_dir) if jax.process_index() == 0 else None
    sig = StopSignals(sigterm=tc.checkpoint.save_on_sigterm)
    try:
        return _train(tr, sig, data_it)
    finally:
        sig.close()
        if lock is not None:
            lock.release()


class TrainingDiverged(RuntimeError):
    """The training loss or gradient norm became NaN or infinite (the run stops without saving that state)."""


def _check_finite(metrics: dict[str, Any], step: int, saved: set[int]) -> None:
    """TrainingDiverged when the step's ``loss`` or ``grad_norm`` (the update it applied) is not finite
    (``saved``: the steps with a checkpoint in this run dir)."""
    for name in ("loss", "grad_norm"):
        value = float(metrics.get(name, 0.0))
        if not np.isfinite(value):
            last = f"the last checkpoint is step {max(saved)}" if saved else "no checkpoint was saved"
            raise TrainingDiverged(f"the {name} is {value} at step {step}: stopping without saving this state "
                                   f"({last}); lower optim.lr or check the data")


def _train(tr: Trainer, sig: StopSignals, data_it) -> dict[str, Any]:
    tc = tr.tc
    run_dir = tc.run.run_dir
    is_main = jax.process_index() == 0
    ck = Checkpointer(os.path.join(run_dir, "checkpoints"), keep=tc.checkpoint.keep, async_save=tc.checkpoint.async_save)
    restored = None
    if tc.checkpoint.resume and ck.all_steps():
        def target(meta):
            _check_meta(tr, meta)
            return tr.abstract_state(meta["phase"])
        restored = ck.restore_latest(target)
    if restored is not None:
        step, state, data_state, meta = restored
        phase = meta["phase"]
        data_it.set_state(decode_state(data_state))
    else:
        step, phase = 0, tr.phase_of(0)
        state = tr.initial_state()
    dropped = {}
    idle = restored is not None and step >= tc.run.steps     # nothing to train: the run's files stay as they are
    steps_note = None
    if restored is not None and not idle:     # another run.steps: refused (nothing written) if it changes the LR curve
        check = _schedule_check(tc, step, meta)
        if check is not None and not check[0]:
            raise TrainConfigError(check[1])
        steps_note = check[1] if check is not None else None
    if is_main and not idle:  # only now: a refused resume (another model config) leaves the run's files as they were
        _write_yaml_atomic(os.path.join(run_dir, "config.yaml"), tc.to_dict())
        _write_yaml_atomic(os.path.join(run_dir, "model_config.yaml"), tr.cfg.to_dict())  # the resolved model
        if tc.checkpoint.resume:  # the steps past the restored one are trained again: log them once
            dropped = truncate_after(run_dir, step)
    writer = MetricsWriter(run_dir, total_steps=tc.run.steps, start_step=step, tensorboard=tc.run.tensorboard,
                           progress=tc.run.progress, is_main=is_main)
    if restored is not None:
        writer.message(f"resumed from step {step} ({run_dir}/checkpoints)")
        if idle:
            writer.message(f"warning: the run is already at step {step} >= run.steps {tc.run.steps}: nothing to "
                           f"train; raise run.steps to continue it, or use a new run.run_dir for a new run")
        if steps_note:
            writer.message(steps_note)
        changes = settings_changes(meta.get("train_config"), tc.to_dict())
        if changes:
            writer.message("warning: resuming with training settings that differ from the checkpoint's "
                           f"(the data iterator and the optimizer state continue from the checkpoint, its moments "
                           f"cast to this run's optim.mu_dtype / parameter dtypes): {'; '.join(changes)}")
    if dropped:
        writer.message(f"dropped the log records past step {step} (they are trained again): " +
                       ", ".join(f"{k}: {n}" for k, n in dropped.items()))
    peak = peak_flops_per_device(tr.mesh.devices.flat[0].device_kind, tc.run.peak_tflops)
    status, metrics, done_here = "completed", {}, 0
    t0, flops, toks, excluded = time.perf_counter(), 0.0, 0.0, 0.0  # excluded: eval / recall seconds
    tree = [0.0, 0.0, 0.0]  # prefix-tree batches since the last log: tokens before, after, before (timed)
    pending: dict[str, float] = {}  # compile_s for the next metrics row

    saved = {step} if restored is not None else set()
    last_saved = None
    reported_impls: dict[str, str] = {}

    def save(s):
        nonlocal last_saved
        if s not in saved:
            if done_here:                # never a checkpoint of a diverged state
                _check_finite(jax.device_get({k: m[k] for k in ("loss", "grad_norm") if k in m}), s, saved)
            ck.save(s, state, encode_state(data_it.get_state()), _meta(tr, s, phase))
            saved.add(s)
            last_saved = s

    def untimed(fn):
        """Run ``fn`` (an evaluation) outside the throughput clock."""
        nonlocal excluded
        jax.block_until_ready(m)
        t = time.perf_counter()
        out = fn()
        excluded += time.perf_counter() - t
        return out

    try:
        while step < tc.run.steps:
            if sig.signum is not None:
                status = "interrupted" if sig.interrupted else "preempted"
                what = f"saving step {step} and stopping" if done_here else "stopping (no step trained yet)"
                writer.message(f"{'interrupt' if sig.interrupted else 'SIGTERM'}: {what}")
                break
            want = tr.phase_of(step)
            if want != phase:  # MSA warm-up done: fresh optimizer for the main phase
                with tr.mesh_context():
                    state = {**state, "opt_state": tr.fresh_opt_state(want, state["params"])}
                phase = want
                writer.message(f"step {step}: indexer warm-up done, switching to sparse training")
            try:
                batch = next(data_it)
            except StopIteration:
                status = "data_exhausted"
                break
            packed = getattr(data_it, "last_stats", None)   # PackStats of a trajectory batch
            if packed is not None:
                tree[0] += packed.tokens_before * jax.process_count()
                tree[1] += packed.tokens_after * jax.process_count()
            compiling = not tr.is_compiled(phase)
            if compiling:
                writer.message(f"step {step + 1}: compiling the train step ({phase} phase)...")
            t_call = time.perf_counter()
            state, m = tr.run_step(phase, state, batch)
            step += 1
            done_here += 1
            writer.advance()
            if compiling:  # the jit call returns once compiled (the step runs asynchronously): not timed
                compile_s = time.perf_counter() - t_call
                jax.block_until_ready(m)
                first_s = time.perf_counter() - t_call
                writer.message(f"compiled in {compile_s:.1f} s (first step done in {first_s:.1f} s)")
                pending["compile_s"] = pending.get("compile_s", 0.0) + compile_s
                t0, flops, toks, excluded = time.perf_counter(), 0.0, 0.0, 0.0
                tree[2] = 0.0
            else:
                flops += train_flops(tr.cfg, batch["positions"]) * jax.process_count()
                toks += float(np.asarray(batch["tokens"]).size) * jax.process_count()
                tree[2] += packed.tokens_before * jax.process_count() if packed is not None else 0.0
            impls = implementation_report()       # filled while a step is traced: say which kernels run
            if impls != reported_impls:
                writer.message(f"step {step} ({phase}): implementations " +
                               ", ".join(f"{k}={v}" for k, v in sorted(impls.items())))
                reported_impls = dict(impls)
            if step % tc.run.log_every == 0 or step == tc.run.steps:
                metrics = {k: float(v) for k, v in jax.device_get(m).items()}
                dt = max(time.perf_counter() - t0 - excluded, 1e-9)
                if toks:
                    metrics["tokens_per_s"] = toks / dt
                    metrics["model_tflops_per_s"] = flops / dt / 1e12
                    if peak:
                        metrics["mfu"] = flops / dt / (peak * tr.mesh.devices.size)
                    if tree[2]:
                        metrics["tree/original_tokens_per_s"] = tree[2] / dt
                if tree[1]:
                    metrics.update({"tree/tokens_before": tree[0], "tree/tokens_after": tree[1],
                                    "tree/saving": 1.0 - tree[1] / tree[0]})
                tree[:] = [0.0, 0.0, 0.0]
                metrics["phase_warmup"] = float(phase == PHASE_WARMUP)
                metrics.update(pending)
                pending.clear()
                if tc.run.eval_every and step % tc.run.eval_every == 0:
                    metrics["eval_loss"] = tr.evaluate(state["params"])
                writer.write(step, metrics)
                _check_finite(metrics, step, saved)
                t0, flops, toks, excluded = time.perf_counter(), 0.0, 0.0, 0.0
            elif tc.run.eval_every and step % tc.run.eval_every == 0:
                writer.write(step, {"eval_loss": untimed(lambda: tr.evaluate(state["params"]))})
            if tc.run.recall_every and step % tc.run.recall_every == 0 and tr.cfg.has_msa and jax.process_count() == 1:
                from minimax_jax.eval.recall import indexer_recall

                rec = untimed(lambda: indexer_recall(jax.device_get(state["params"]), tr.cfg,
                                                     np.asarray(batch["tokens"])[0]))
                writer.write(step, {"indexer_recall": rec["mean"],
                                    **{f"indexer_recall/layer{k}": v for k, v in rec["layers"].items()}})
            if tc.checkpoint.every and step % tc.checkpoint.every == 0:
                save(step)
            if tc.run.stop_after and done_here >= tc.run.stop_after:
                status = "stopped"
                break
        if done_here or status not in ("interrupted", "preempted"):  # a stop before any step: nothing new
            save(step)
        ck.wait()
    finally:
        ck.close()
        writer.close()
    ckpt = None if last_saved is None else os.path.join(ck.directory, str(last_saved))
    return {"status": status, "step": step, "metrics": metrics, "run_dir": run_dir, "checkpoint": ckpt}
