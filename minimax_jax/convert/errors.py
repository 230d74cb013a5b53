"""Errors raised by checkpoint conversion. Every message names the tensor (or file) at fault and,
where it applies, the expected and the actual shape / dtype / size."""

from __future__ import annotations

__all__ = ["CheckpointError", "MissingTensorError", "UnknownTensorError", "TensorShapeError",
           "TensorDtypeError", "SourceKindError", "CorruptFileError", "ChecksumMismatch", "DestinationError",
           "DestinationExistsError",
           "first_line", "root_cause", "quiet_failed_read_teardown"]


class CheckpointError(ValueError):
    """A checkpoint cannot be converted or loaded; the message says which tensor or file and why."""


class MissingTensorError(CheckpointError, KeyError):
    """A tensor the config requires is absent from the checkpoint."""

    def __str__(self) -> str:  # KeyError would repr() the message; keep it readable
        return str(self.args[0]) if self.args else ""


class UnknownTensorError(CheckpointError):
    """The checkpoint holds tensors that no part of the config explains."""


class TensorShapeError(CheckpointError):
    """A tensor's shape differs from the one the config implies."""


class TensorDtypeError(CheckpointError):
    """A tensor's dtype is not one the converter accepts for it."""


class SourceKindError(TensorDtypeError):
    """The source lacks what an option asks for (``weights_dtype="fp8"`` on a checkpoint without FP8 layer
    weights): bad input, found before anything is written (CLIs exit 2)."""


class CorruptFileError(CheckpointError):
    """A safetensors file is truncated or its header is malformed."""


class ChecksumMismatch(CorruptFileError):
    """A restored tensor's checksum differs from the one its manifest recorded at save time
    (``tensor``: its dotted name, None for a damaged manifest)."""

    def __init__(self, message: str, tensor: str | None = None):
        super().__init__(message)
        self.tensor = tensor


class DestinationError(ValueError):
    """An output path (``path``) cannot be written without losing data: it overlaps a source, or it
    exists and is not a directory this tool wrote. Nothing was written (a usage error: CLIs exit 2)."""

    def __init__(self, message: str, path: str | None = None):
        super().__init__(message)
        self.path = path


class DestinationExistsError(DestinationError, FileExistsError):
    """The destination exists and replacing it was not asked for."""


def root_cause(e: BaseException) -> BaseException:
    """The innermost ``__cause__`` / ``__context__`` of ``e`` (a context ``raise ... from None``
    suppressed is not followed)."""
    seen = set()
    while id(e) not in seen:
        seen.add(id(e))
        nxt = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
        if nxt is None:
            break
        e = nxt
    return e


def first_line(e: BaseException) -> str:
    """First line of the innermost cause (tensorstore's own message, e.g. "OUT_OF_RANGE: Error reading
    "lm_head/0.0" ... not valid for value of size 100", is the root of orbax's wrapped errors)."""
    e = root_cause(e)
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]


_QUIET_INSTALLED = False


def quiet_failed_read_teardown() -> None:
    """Drop the teardown noise of an orbax / tensorstore restore that fails (call it before restoring:
    the noise can come before the restore's own exception and goes on after it).

    A restore that fails on one array closes orbax's event loop while the reads of the other arrays
    are still running; each of those then ends in ``RuntimeError: Event loop is closed`` (raised in a
    tensorstore callback) or in an orbax read coroutine that is never awaited, which Python prints as
    an "unraisable" traceback, or as "RuntimeWarning: coroutine ... was never awaited" when it is collected,
    from other threads and after the error was already reported (hundreds of lines around the one-line
    error or fallback warning); asyncio also logs the abandoned read tasks ("Task exception was never
    retrieved") when they are collected. Installs, once per process, a ``sys.unraisablehook`` that drops
    exactly those kinds and passes everything else on, a warnings filter for that coroutine's warning and
    a filter on the ``asyncio`` logger for those orbax tasks.
    """
    global _QUIET_INSTALLED
    if _QUIET_INSTALLED:
        return
    import logging
    import sys
    import warnings

    warnings.filterwarnings("ignore", message=r"coroutine '_read_array_index_and_device_put' was never awaited",
                            category=RuntimeWarning)

    previous = sys.unraisablehook

    def hook(u) -> None:
        if _is_failed_read_noise(u):
            return
        previous(u)

    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_drop_abandoned_orbax_tasks)
    _QUIET_INSTALLED = True


def _drop_abandoned_orbax_tasks(record) -> bool:
    """logging filter: False (drop) for asyncio's "Task / Future exception was never retrieved" about an
    orbax read or its tensorstore future (abandoned by a failed restore; its error was reported once already)."""
    if "exception was never retrieved" not in str(record.msg):
        return True
    text = record.getMessage()
    if "orbax" in text or "OCDBT database" in text or "TensorStore(" in text:   # orbax's task, tensorstore's future
        return False
    tb = record.exc_info[2] if record.exc_info else None
    while tb is not None:
        if "orbax" in tb.tb_frame.f_code.co_filename:
            return False
        tb = tb.tb_next
    return True


def _is_failed_read_noise(u) -> bool:
    if u.exc_type is RuntimeError and str(u.exc_value) == "Event loop is closed" and u.object is None:
        tb = getattr(u, "exc_traceback", None)     # raised right in a callback from outside Python (tensorstore)
        return tb is None or tb.tb_frame.f_code.co_name == "call_soon_threadsafe"
    code = getattr(u.object, "cr_code", None)    # a coroutine garbage-collected with its exception
    return code is not None and "orbax" in code.co_filename.replace("\\", "/")
