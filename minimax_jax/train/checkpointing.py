"""Checkpoints with orbax ``CheckpointManager``: async saves, keep-K, exact resume, corrupt fallback.

Layout: ``run_dir/checkpoints/<step>/{state, data, meta}``:

- ``state``: the training state pytree (params, optimizer state, step, RNG key data), sharded
  arrays written by every process (``ocp.args.StandardSave``);
- ``data``: the data iterator state (JSON) of every process, a list indexed by process (each
  host restores its own position);
- ``meta``: JSON: step, training phase, model config (so a resumed sparse-CPT run needs neither the
  dense checkpoint nor the conversion again).

orbax writes each step into a temporary directory and renames it when complete, so a crash during
a save never leaves a half-written step that looks finished. ``restore_latest`` walks the steps from
the newest down and falls back (with a warning) when one cannot be read.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

__all__ = ["Checkpointer", "CheckpointFallbackWarning"]

log = logging.getLogger(__name__)


class CheckpointFallbackWarning(UserWarning):
    """The newest checkpoint could not be read; an older one was used."""


class Checkpointer:
    """Thin wrapper over ``ocp.CheckpointManager`` for the training loop."""

    def __init__(self, directory: str, *, keep: int, async_save: bool):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data", "meta"))

    def all_steps(self) -> list[int]:
        """Saved steps, ascending."""
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: Any, data_state: Any, meta: dict[str, Any]) -> bool:
        """Start saving ``step`` (asynchronously when enabled). ``data_state`` must be JSON-safe.

        Every process's ``data_state`` is gathered so each host can restore its own position.
        """
        if step in self.manager.all_steps():
            return False
        states = _gather_json(data_state)
        return self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave({"per_process": states}),
            meta=ocp.args.JsonSave(meta)), force=True)

    def wait(self) -> None:
        """Block until pending async saves are written."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    def restore_latest(self, abstract_state_for: Callable[[dict[str, Any]], Any]):
        """Restore the newest readable checkpoint.

        Args:
          abstract_state_for: ``meta -> abstract state`` (ShapeDtypeStructs with shardings) used as
            the restore target, so arrays come back sharded and typed as the run needs them.
        Returns: ``(step, state, data_state, meta)``, or None when there is no checkpoint.
        Raises: RuntimeError when checkpoints exist but none can be read (never silently restart).
        Emits CheckpointFallbackWarning for each unreadable step that is skipped; once an older step
        is restored, the unreadable newer ones are moved to ``<directory>_corrupt/<step>`` so the run
        can write those steps again.
        """
        bad: list[int] = []
        for step in sorted(self.manager.all_steps(), reverse=True):
            got = self._try_restore(step, abstract_state_for)
            if isinstance(got, Exception):
                msg = (f"checkpoint step {step} in {self.directory} cannot be restored "
                       f"({type(got).__name__}: {str(got)[:300]}); falling back to the previous checkpoint")
                warnings.warn(msg, CheckpointFallbackWarning, stacklevel=2)
                log.warning(msg)
                bad.append(step)
                continue
            meta = got["meta"]
            if bad:
                self._quarantine(bad)
            per = got["data"]["per_process"]
            idx = jax.process_index()
            if len(per) != jax.process_count():
                raise RuntimeError(f"checkpoint step {step} was written by {len(per)} processes; this run has "
                                   f"{jax.process_count()} (the data iterator positions cannot be mapped)")
            return step, got["state"], per[idx], meta
        if bad:
            raise RuntimeError(f"none of the checkpoints {sorted(bad)} in {self.directory} can be restored (see the "
                               "warnings above); move them away to start afresh, or fix the model config")
        return None

    def _try_restore(self, step: int, abstract_state_for: Callable[[dict[str, Any]], Any]):
        """The restored items of ``step``, or the exception that made a file unreadable. Errors of
        ``abstract_state_for`` (a model/config mismatch: the caller's error) propagate."""
        try:
            meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # noqa: BLE001 - any unreadable checkpoint falls back
            return e
        target = abstract_state_for(meta)
        try:
            got = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()))
        except Exception as e:  # noqa: BLE001
            return e
        return {"meta": meta, "state": got["state"], "data": got["data"]}

    def _quarantine(self, steps: list[int]) -> None:
        if jax.process_index() == 0:
            dest = self.directory + "_corrupt"
            os.makedirs(dest, exist_ok=True)
            for s in steps:
                src = os.path.join(self.directory, str(s))
                if os.path.isdir(src):
                    target = os.path.join(dest, f"{s}-{int(time.time())}")
                    os.replace(src, target)
                    log.warning("moved unreadable checkpoint %s to %s", src, target)
        multihost_utils.sync_global_devices("minimax_jax.train.checkpointing.quarantine")
        self.manager.reload()


def _gather_json(x: Any) -> list[Any]:
    """Every process's JSON-safe value, in process order (a one-element list on one process)."""
    if jax.process_count() == 1:
        return [x]
    import json

    import numpy as np

    raw = np.frombuffer(json.dumps(x).encode(), np.uint8)
    n = multihost_utils.process_allgather(np.array([raw.size], np.int32))
    buf = np.zeros((int(n.max()),), np.uint8)
    buf[:raw.size] = raw
    allb = multihost_utils.process_allgather(buf)
    return [json.loads(bytes(allb[i][:int(n[i][0])]).decode()) for i in range(allb.shape[0])]
