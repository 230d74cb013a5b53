"""Errors raised by checkpoint conversion. Every message names the tensor (or file) at fault and,
where it applies, the expected and the actual shape / dtype / size."""

from __future__ import annotations

__all__ = ["CheckpointError", "MissingTensorError", "UnknownTensorError", "TensorShapeError",
           "TensorDtypeError", "CorruptFileError"]


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


class CorruptFileError(CheckpointError):
    """A safetensors file is truncated or its header is malformed."""
