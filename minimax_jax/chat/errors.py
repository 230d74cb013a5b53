"""Error type of the chat package."""

from __future__ import annotations


class ChatFormatError(ValueError):
    """A conversation, tool list or chat file is malformed; the message says where and why."""
