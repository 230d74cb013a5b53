"""Multi-process start-up: one call that wires ``jax.distributed.initialize``.

On TPU pods and under SLURM / Open MPI JAX detects the coordinator, process count and rank itself
(call ``initialize()`` with no arguments). Elsewhere (two processes on one machine in tests, or a
custom launcher) pass all three explicitly, or set ``MINIMAX_COORDINATOR``, ``MINIMAX_NUM_PROCESSES``
and ``MINIMAX_PROCESS_ID``. After it, ``jax.devices()`` lists every process's devices and
``minimax_jax.sharding.make_mesh`` builds the global mesh from them.
"""

from __future__ import annotations

import os

import jax

__all__ = ["initialize", "is_initialized", "process_index", "process_count"]

_initialized = False


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"environment variable {name}={v!r} is not an integer") from None


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               *, local_device_ids: list[int] | None = None, timeout_s: int = 300) -> None:
    """Join (or form) the multi-process JAX runtime. Call once, before any other JAX call.

    Args:
      coordinator: ``"host:port"`` of process 0's coordinator service (env ``MINIMAX_COORDINATOR``).
      num_processes: total processes (env ``MINIMAX_NUM_PROCESSES``).
      process_id: this process's rank in ``[0, num_processes)`` (env ``MINIMAX_PROCESS_ID``).
      local_device_ids: restrict this process to these local devices (e.g. one GPU per process).
      timeout_s: seconds to wait for every process to join.
    Behaviour: with none of the three given (argument or env), JAX auto-detects the cluster (TPU,
      SLURM, MPI). A single process (num_processes == 1) is a no-op.
    Raises: ValueError when only some of the three are given or they are inconsistent;
      RuntimeError when called twice.
    """
    global _initialized
    if _initialized:
        raise RuntimeError("minimax_jax.distributed.initialize was already called in this process")
    coordinator = coordinator or os.environ.get("MINIMAX_COORDINATOR") or None
    num_processes = num_processes if num_processes is not None else _env_int("MINIMAX_NUM_PROCESSES")
    process_id = process_id if process_id is not None else _env_int("MINIMAX_PROCESS_ID")
    given = [coordinator is not None, num_processes is not None, process_id is not None]
    if any(given) and not all(given):
        raise ValueError("initialize: give coordinator, num_processes and process_id together (or none of them "
                         f"for auto-detection); got coordinator={coordinator!r}, num_processes={num_processes!r}, "
                         f"process_id={process_id!r}")
    if all(given):
        if num_processes < 1 or not (0 <= process_id < num_processes):
            raise ValueError(f"initialize: need 0 <= process_id ({process_id}) < num_processes ({num_processes})")
        if num_processes == 1:
            _initialized = True
            return
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id, local_device_ids=local_device_ids,
                                   initialization_timeout=timeout_s)
    else:
        jax.distributed.initialize(local_device_ids=local_device_ids, initialization_timeout=timeout_s)
    _initialized = True


def is_initialized() -> bool:
    """Whether ``initialize`` ran in this process."""
    return _initialized


def process_index() -> int:
    """This process's rank (0 in a single process)."""
    return jax.process_index()


def process_count() -> int:
    """Number of processes in the runtime (1 in a single process)."""
    return jax.process_count()
