"""Checkpoints with orbax ``CheckpointManager``: async saves, keep-K, exact resume, corrupt fallback.

Layout: ``run_dir/checkpoints/<step>/{state, data, meta, manifest}``:

- ``state``: the training state pytree (params, optimizer state, step, RNG key data), sharded
  arrays written by every process (``ocp.args.StandardSave``);
- ``data``: the data iterator state (JSON) of every process, a list indexed by process (each
  host restores its own position);
- ``meta``: JSON: step, training phase, model config (so a resumed sparse-CPT run needs neither the
  dense checkpoint nor the conversion again);
- ``manifest``: JSON: a checksum per ``state`` leaf (``minimax_jax.convert.manifest``), verified
  right after every restore (a step saved before manifests existed restores with one warning line).

orbax writes each step into a temporary directory and renames it when complete, so a crash during
a save never leaves a half-written step that looks finished. ``restore_latest`` walks the steps from
the newest down and falls back, in one warning line, when one cannot be read or fails its checksums
(orbax's own logs are silenced while it tries).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from minimax_jax.convert.errors import ChecksumMismatch, first_line, quiet_failed_read_teardown, root_cause
from minimax_jax.convert.manifest import default_warn, is_manifest, manifest_dict, tree_entries, verify_tree

__all__ = ["Checkpointer", "ITEMS"]

ITEMS = ("state", "data", "meta", "manifest")
_NO_MANIFEST = "no checksum manifest (saved by an older version), restored without verification"


class Checkpointer:
    """Thin wrapper over ``ocp.CheckpointManager`` for the training loop.

    ``keep``: newest steps kept (None: all); ``verify``: check restored states against their
    manifests (default on).
    """

    def __init__(self, directory: str, *, keep: int | None, async_save: bool, verify: bool = True):
        self.directory = os.path.abspath(directory)
        self.verify = verify
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)

    def all_steps(self) -> list[int]:
        """Saved steps, ascending."""
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: Any, data_state: Any, meta: dict[str, Any]) -> bool:
        """Start saving ``step`` (asynchronously when enabled). ``data_state`` must be JSON-safe.

        Every process's ``data_state`` is gathered so each host can restore its own position. The
        checksums of ``state`` are computed here, before returning (the training step may donate
        the buffers next).
        """
        if step in self.manager.all_steps():
            return False
        states = _gather_json(data_state)
        manifest = manifest_dict(tree_entries(state), writer="train")
        return self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave({"per_process": states}),
            meta=ocp.args.JsonSave(meta), manifest=ocp.args.JsonSave(manifest)), force=True)

    def wait(self) -> None:
        """Block until pending async saves are written."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    def latest_meta(self) -> tuple[int, dict[str, Any]] | None:
        """(step, meta) of the newest checkpoint whose metadata reads (nothing else restored), or None."""
        for step in sorted(self.manager.all_steps(), reverse=True):
            with _quiet():
                try:
                    got = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
                    return step, got["meta"]
                except Exception:  # noqa: BLE001 - an unreadable step: the next older one (as restore_latest)
                    continue
        return None

    def restore_latest(self, abstract_state_for: Callable[[dict[str, Any]], Any], *,
                       warn: Callable[[str], None] | None = None):
        """Restore the newest readable checkpoint.

        Args:
          abstract_state_for: ``meta -> abstract state`` (ShapeDtypeStructs with shardings) used as
            the restore target, so arrays come back sharded and typed as the run needs them.
          warn: receives the one warning line (default: ``warning: ...`` on stderr).
        Returns: ``(step, state, data_state, meta)``, or None when there is no checkpoint.
        Raises: RuntimeError when checkpoints exist but none can be read (never silently restart).
        Unreadable or corrupt (checksum) steps are skipped; once an older step is restored they are
        moved to ``<directory>_corrupt/<step>-<time>`` so the run can write those steps again, and
        ONE line says which steps, why, and the step used (it also says when that step had no
        manifest).
        """
        warn = warn or default_warn
        bad: list[tuple[int, str]] = []
        for step in sorted(self.manager.all_steps(), reverse=True):
            with _quiet():
                got = self._try_restore(step, abstract_state_for)
            if isinstance(got, Exception):
                bad.append((step, _reason(got)))
                continue
            meta = got["meta"]
            note = "" if got["verified"] else f" ({_NO_MANIFEST})"
            if bad:
                moved = self._quarantine([s for s, _ in bad])
                steps = ", ".join(str(s) for s, _ in bad)
                why = "; ".join(f"{s}: {r}" if len(bad) > 1 else r for s, r in bad)
                warn(f"checkpoint step{'s' * (len(bad) > 1)} {steps} in {self.directory} cannot be restored ({why}); "
                     f"falling back to step {step}{note}; moved {steps} to {moved}")
            elif note:
                warn(f"checkpoint step {step} in {self.directory} has {_NO_MANIFEST}")
            per = got["data"]["per_process"]
            idx = jax.process_index()
            if len(per) != jax.process_count():
                raise RuntimeError(f"checkpoint step {step} was written by {len(per)} processes; this run has "
                                   f"{jax.process_count()} (the data iterator positions cannot be mapped)")
            return step, got["state"], per[idx], meta
        if bad:
            why = "; ".join(f"{s}: {r}" for s, r in bad)
            raise RuntimeError(f"none of the checkpoints {sorted(s for s, _ in bad)} in {self.directory} can be "
                               f"restored ({why}); move them away to start afresh, or fix the model config")
        return None

    def restore_state(self, step: int, target: Any = None, *, warn: Callable[[str], None] | None = None) -> Any:
        """The ``state`` item of ``step`` (``target``: abstract state, or None for the arrays as saved),
        checked against its manifest when ``self.verify`` (a step without one: one line to ``warn``).

        Raises: ChecksumMismatch naming the corrupt leaf; orbax's errors for unreadable files.
        """
        got, verified = self._restore(step, state=ocp.args.StandardRestore(target))
        if not verified and self.verify:
            (warn or default_warn)(f"checkpoint step {step} in {self.directory} has {_NO_MANIFEST}")
        return got["state"]

    def _restore(self, step: int, **items) -> tuple[Any, bool]:
        """Restore ``items`` of ``step`` (and its manifest, checking the ``state`` item against it
        when ``self.verify``). Returns ``(restored items, whether the state was verified)``."""
        quiet_failed_read_teardown()    # a failed read's other arrays would end in tracebacks
        verified = self.verify and os.path.isdir(os.path.join(self.directory, str(step), "manifest"))
        if verified:
            items["manifest"] = ocp.args.JsonRestore()
        got = self.manager.restore(step, args=ocp.args.Composite(**items))
        if verified:
            where = f"{self.directory}/{step}"
            if not is_manifest(got["manifest"]):
                raise ChecksumMismatch(f"checkpoint {where}: its manifest is damaged")
            verify_tree(got["state"], got["manifest"], where)
        return got, verified

    def _try_restore(self, step: int, abstract_state_for: Callable[[dict[str, Any]], Any]):
        """The restored items of ``step``, or the exception that made a file unreadable. Errors of
        ``abstract_state_for`` (a model/config mismatch: the caller's error) propagate."""
        try:
            meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # noqa: BLE001 - any unreadable checkpoint falls back
            return e
        target = abstract_state_for(meta)
        try:
            got, verified = self._restore(step, state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore())
        except Exception as e:  # noqa: BLE001
            return e
        return {"meta": meta, "state": got["state"], "data": got["data"], "verified": verified or not self.verify}

    def _quarantine(self, steps: list[int]) -> str:
        """Move ``steps`` to ``<directory>_corrupt/``; returns that directory."""
        dest = self.directory + "_corrupt"
        if jax.process_index() == 0:
            os.makedirs(dest, exist_ok=True)
            for s in steps:
                src = os.path.join(self.directory, str(s))
                if os.path.isdir(src):
                    os.replace(src, os.path.join(dest, f"{s}-{int(time.time())}"))
        multihost_utils.sync_global_devices("minimax_jax.train.checkpointing.quarantine")
        self.manager.reload()
        return dest


def _reason(e: Exception) -> str:
    """Why a step could not be restored, in a few words (the corrupt tensor, or orbax's root error)."""
    if isinstance(e, ChecksumMismatch) and e.tensor:
        return f"tensor {e.tensor!r} checksum mismatch (file flipped or truncated)"
    return f"{type(root_cause(e)).__name__}: {first_line(e)}"


@contextlib.contextmanager
def _quiet():
    """Silence Python warnings and the absl / orbax / jax loggers while restore attempts run: an
    unreadable checkpoint makes orbax log its error at length, for every leaf."""
    loggers = [logging.getLogger(n) for n in ("absl", "orbax", "jax", "tensorstore")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL + 1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


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
