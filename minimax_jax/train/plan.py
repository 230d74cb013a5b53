"""Will this training run fit? The train step compiled for GPUs this machine lacks (``train.py --plan_for``).

The run's own step (model, optimizer, remat, mesh, batch shapes) is traced with the ops' GPU choices
(``ops.assume_backend("gpu")``), lowered and compiled by XLA's GPU compiler for compile-only devices of a
target (``minimax_jax.aot``: e.g. eight H200s, from a laptop with jax's CUDA plugin and no GPU);
``compiled.memory_analysis()`` is then the compiler's per-device buffer plan. Nothing is allocated or run.
One plan per training phase (an MSA run's indexer warm-up compiles a different step).

Batch shapes: ``grain`` and ``synthetic`` rows have one layout (tokens, targets, segment ids, positions,
loss mask; ``SyntheticIterator``), so random rows of the run's ``seq_len`` x ``batch_size`` stand for them
(no corpus is read); ``trajectory`` batches come from the run's own data (their layout depends on it).
"""

from __future__ import annotations

import dataclasses

import jax

from minimax_jax import aot
from minimax_jax.ops import assume_backend, clear_implementation_report, implementation_report
from minimax_jax.train.config import TrainConfig
from minimax_jax.train.data import SyntheticIterator, make_iterator
from minimax_jax.train.loop import Trainer

__all__ = ["PhasePlan", "RunPlan", "plan_train_step", "JAX_DEFAULT_FRACTION"]

#: The share of a GPU's memory JAX's allocator takes unless ``XLA_PYTHON_CLIENT_MEM_FRACTION`` says otherwise.
JAX_DEFAULT_FRACTION = 0.75


@dataclasses.dataclass(frozen=True)
class PhasePlan:
    """XLA's buffer plan of one phase's train step, bytes per device."""

    phase: str
    temp: int
    arguments: int
    outputs: int
    aliased: int
    device_bytes: int

    @property
    def total(self) -> int:
        """What the step needs at its peak with the donated state aliased (arguments + outputs - alias + temp)."""
        return self.arguments + self.outputs - self.aliased + self.temp

    def verdict(self) -> str:
        """``fits``, ``fits with XLA_PYTHON_CLIENT_MEM_FRACTION=f`` (over JAX's default 75 %), or ``does not fit``."""
        share = self.total / self.device_bytes
        if share <= JAX_DEFAULT_FRACTION:
            return "fits"
        if share <= 0.97:
            return f"fits with XLA_PYTHON_CLIENT_MEM_FRACTION={min(0.97, share + 0.02):.2f} (JAX takes 75 % by default)"
        return "does not fit"


def _abstract_batch(tc: TrainConfig, vocab_size: int, sharding) -> dict:
    if tc.data.kind == "trajectory":
        batch = next(make_iterator(tc.data, vocab_size))
    else:
        batch = next(SyntheticIterator(tc.data.seq_len, tc.data.batch_size, vocab_size))
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in batch.items()}


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """``plan_train_step``'s answer: one ``PhasePlan`` per phase the run reaches, the mesh (text), the GPUs it
    uses (of those compiled for), their kind, and the op implementations the traced step chose."""

    phases: list[PhasePlan]
    mesh: str
    gpus_used: int
    device_kind: str
    implementations: dict


def plan_train_step(tc: TrainConfig, target: str, count: int) -> RunPlan:
    """Compile ``tc``'s train step for ``count`` compile-only GPUs of ``target`` and read XLA's plan.

    Args:
      tc: the run's configuration (its mesh must use at most ``count`` devices).
      target: a GPU target name in ``configs/gpu_targets`` or a GpuTargetConfig file (``aot.compile_only_gpus``).
      count: GPUs of one host to compile for.
    Returns: a ``RunPlan``.
    Raises: ValueError (bad target, no CUDA plugin), TrainConfigError (the run does not match the devices),
      ImplementationUnavailable (an op implementation the run names cannot be traced without a GPU).
    """
    devices = aot.compile_only_gpus(target, count)
    device_bytes = aot.gpu_target_memory(target)
    tr = Trainer(tc, devices)
    batch = _abstract_batch(tc, tr.cfg.vocab_size, tr.batch_sh)
    phases = list(dict.fromkeys([tr.phase_of(0), tr.phase_of(max(tc.run.steps - 1, 0))]))   # the ones it reaches
    plans = []
    clear_implementation_report()
    for phase in phases:
        state = tr.abstract_state(phase)
        with tr.mesh_context(), assume_backend("gpu"):
            compiled = tr.step_fn(phase).lower(state, batch).compile()
        m = compiled.memory_analysis()
        plans.append(PhasePlan(phase, int(m.temp_size_in_bytes), int(m.argument_size_in_bytes),
                               int(m.output_size_in_bytes), int(m.alias_size_in_bytes), device_bytes))
    mesh = ",".join(f"{k}={v}" for k, v in tr.mesh.shape.items() if v > 1) or "one device"
    return RunPlan(plans, mesh, int(tr.mesh.devices.size), devices[0].device_kind, implementation_report())
