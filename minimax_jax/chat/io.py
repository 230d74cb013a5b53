"""Load a chat JSON file: ``{"messages": [...], "tools": [...]}`` (``tools`` optional).

Optional keys: ``add_generation_prompt`` (bool, default True). Any other top-level key is an
error naming it. The messages and tools are validated with the same rules as ``render_chat``.
"""

from __future__ import annotations

import dataclasses
import json
import os

from minimax_jax.chat.errors import ChatFormatError
from minimax_jax.chat.messages import normalize_messages, normalize_tools
from minimax_jax.chat.template import render_chat

__all__ = ["ChatRequest", "load_chat_file"]

_KEYS = {"messages", "tools", "add_generation_prompt"}


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """A validated chat request as read from a file (raw dicts kept, for re-rendering)."""

    messages: list
    tools: list | None = None
    add_generation_prompt: bool = True

    def render(self) -> str:
        """The prompt text (``render_chat`` of this request)."""
        return render_chat(self.messages, self.tools,
                           add_generation_prompt=self.add_generation_prompt)


def load_chat_file(path: str | os.PathLike) -> ChatRequest:
    """Read and validate a chat JSON file. Raises ChatFormatError (bad JSON, missing
    ``messages``, unknown keys, invalid messages/tools) with the file path in the message."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ChatFormatError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ChatFormatError(f"{path}: top level must be an object with 'messages'")
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise ChatFormatError(f"{path}: unknown keys {unknown}; allowed {sorted(_KEYS)}")
    if "messages" not in data:
        raise ChatFormatError(f"{path}: missing 'messages'")
    agp = data.get("add_generation_prompt", True)
    if not isinstance(agp, bool):
        raise ChatFormatError(f"{path}: 'add_generation_prompt' must be true or false")
    try:
        normalize_messages(data["messages"])
        normalize_tools(data.get("tools"))
    except ChatFormatError as e:
        raise ChatFormatError(f"{path}: {e}") from None
    return ChatRequest(list(data["messages"]), data.get("tools"), agp)
