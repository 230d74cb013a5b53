"""Errors raised by checkpoint conversion. Every message names the tensor (or file) at fault and,
where it applies, the expected and the actual shape / dtype / size."""

from __future__ import annotations

__all__ = ["CheckpointError", "MissingTensorError", "UnknownTensorError", "TensorShapeError",
           "TensorDtypeError", "SourceKindError", "CorruptFileError", "ChecksumMismatch", "DestinationError",
           "DestinationExistsError",
           "first_line", "root_cause"]


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
