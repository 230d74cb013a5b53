"""Errors of the inference runtime. Every message says what was wrong and what to do about it."""

from __future__ import annotations

__all__ = ["InferenceError", "CheckpointNotFound", "CheckpointMismatch", "TokenizerNotFound",
           "ContextTooLong", "EngineUnavailable", "Fp8WeightsUnavailable", "ConversionMismatch"]


class InferenceError(RuntimeError):
    """Base class: inference cannot run as asked (the CLI prints the message and exits 1)."""


class CheckpointNotFound(InferenceError):
    """The checkpoint directory is missing or holds neither our orbax format nor an HF checkpoint."""


class CheckpointMismatch(InferenceError):
    """The stored parameters do not match the config; ``mismatches`` lists ``(leaf, expected, stored)``."""

    def __init__(self, message: str, mismatches: list[tuple[str, str, str]]):
        super().__init__(message)
        self.mismatches = mismatches


class TokenizerNotFound(InferenceError):
    """No ``tokenizer.json`` where one was looked for (the message names the file)."""


class ContextTooLong(InferenceError):
    """Prompt length + max_new_tokens exceeds the model's context; raised before any compute."""


class EngineUnavailable(InferenceError):
    """The requested generation engine cannot do what was asked (e.g. no hidden states for MTP)."""


class Fp8WeightsUnavailable(InferenceError):
    """``--weights_dtype fp8`` for a checkpoint without FP8 weights (the message says how to get them)."""


class ConversionMismatch(InferenceError):
    """``--convert_dir`` holds something other than a conversion of this checkpoint at this dtype (the message
    names the difference; nothing is loaded or written)."""
