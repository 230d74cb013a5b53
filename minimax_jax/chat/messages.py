"""Validate and normalise OpenAI-style chat messages and tool lists for the MiniMax renderer.

Input messages are dicts with ``role`` in {"system", "user", "assistant" (alias "ai"), "tool"}:

* ``content``: a string, a list of text parts (strings or ``{"type": "text", "text": str}``;
  tool messages also accept ``{"output": str}``), or ``None`` (assistant only, read as "").
* assistant ``reasoning_content``: string or absent/None. When absent, a ``...</think>`` prefix of
  ``content`` is split off as reasoning, as the published template does.
* assistant ``tool_calls``: list of ``{"function": {"name", "arguments"}}`` or
  ``{"name", "arguments"}``;
  ``arguments`` is a dict or a JSON string encoding an object (None means no arguments).
* system ``current_date`` / ``current_location``: optional strings appended to the system text.
* Other keys (``id``, ``tool_call_id``, ``name``, ...) are accepted and ignored.

Rules checked (``ChatFormatError`` names the message index): known role; a system message only at
index 0; a tool message directly after an assistant message with tool calls or after another tool
message, and no more consecutive tool results than that assistant's calls; well-typed fields.
The published template silently ignores a later system message and allows a tool result after
an intervening user turn; we reject both rather than render something the model never saw.

Tools are ``{"type": "function", "function": {...}}`` or a bare function dict ``{"name", ...}``;
normalised to the function dict (key order kept: it is rendered as JSON in that order).
Source: MODEL_FACTS.md section 1; MiniMax-M2 ``chat_template.jinja`` (see tests/fixtures/chat/).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping, Sequence

from minimax_jax.chat.errors import ChatFormatError

__all__ = ["Message", "ToolCallSpec", "normalize_messages", "normalize_tools", "visible_text"]

_ROLE_ALIASES = {"system": "system", "user": "user", "assistant": "assistant", "ai": "assistant",
                 "tool": "tool"}


@dataclasses.dataclass(frozen=True)
class ToolCallSpec:
    """One assistant tool call: ``name`` and ``arguments`` (dict, insertion order kept)."""

    name: str
    arguments: dict


@dataclasses.dataclass(frozen=True)
class Message:
    """A validated message. ``content`` is the visible text; ``reasoning`` is None when absent.

    ``tool_results`` (tool role only) holds the list of response texts when the content was a
    list of parts (each rendered as its own ``<response>`` element); otherwise None.
    """

    role: str
    content: str
    reasoning: str | None = None
    tool_calls: tuple[ToolCallSpec, ...] = ()
    tool_results: tuple[str, ...] | None = None
    current_date: str | None = None
    current_location: str | None = None


def _where(index: int) -> str:
    return f"message {index}"


def visible_text(content: Any, *, where: str, allow_none: bool = False) -> str:
    """Text of ``content`` (string or list of text parts) joined without separators.

    Raises ChatFormatError for other types or non-text parts (images are not supported).
    """
    if content is None and allow_none:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        out = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, Mapping) and part.get("type") == "text" and isinstance(
                    part.get("text"), str):
                out.append(part["text"])
            else:
                raise ChatFormatError(
                    f"{where}: content part {j} must be a string or "
                    f"{{'type': 'text', 'text': str}}, got {part!r:.80}")
        return "".join(out)
    raise ChatFormatError(f"{where}: content must be a string or a list of text parts, "
                          f"got {type(content).__name__}")


def _tool_result_parts(content: Any, where: str) -> tuple[str, ...]:
    out = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            out.append(part)
        elif isinstance(part, Mapping) and isinstance(part.get("output"), str):
            out.append(part["output"])
        elif isinstance(part, Mapping) and part.get("type") == "text" and isinstance(
                part.get("text"), str):
            out.append(part["text"])
        else:
            raise ChatFormatError(f"{where}: tool content part {j} must be a string, "
                                  f"{{'output': str}} or {{'type': 'text', 'text': str}}")
    return tuple(out)


def _parse_arguments(raw: Any, where: str) -> dict:
    if raw is None:
        return {}
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as e:
            raise ChatFormatError(f"{where}: arguments string is not valid JSON ({e})") from None
    if not isinstance(raw, Mapping):
        raise ChatFormatError(f"{where}: arguments must be an object, got {type(raw).__name__}")
    for k in raw:
        if not isinstance(k, str) or not k or '"' in k:
            raise ChatFormatError(f"{where}: argument name {k!r} must be a non-empty string "
                                  "without '\"'")
    return dict(raw)


def _tool_call(call: Any, where: str) -> ToolCallSpec:
    if not isinstance(call, Mapping):
        raise ChatFormatError(f"{where}: must be an object, got {type(call).__name__}")
    fn = call.get("function", call)
    if not isinstance(fn, Mapping):
        raise ChatFormatError(f"{where}: 'function' must be an object")
    name = fn.get("name")
    if not isinstance(name, str) or not name.strip() or '"' in name:
        raise ChatFormatError(f"{where}: needs a non-empty 'name' without '\"', got {name!r}")
    return ToolCallSpec(name=name, arguments=_parse_arguments(fn.get("arguments"), where))


def _split_inline_reasoning(content: str) -> tuple[str | None, str]:
    """Template rule: reasoning = text before the first ``</think>`` (after the last ``<think>``
    in it), newlines stripped; content = text after the last ``</think>``, newlines stripped."""
    if "</think>" not in content:
        return None, content
    parts = content.split("</think>")
    reasoning = parts[0].strip("\n").split("<think>")[-1].strip("\n")
    return reasoning, parts[-1].strip("\n")


def _optional_str(m: Mapping, key: str, where: str) -> str | None:
    v = m.get(key)
    if v is not None and not isinstance(v, str):
        raise ChatFormatError(f"{where}: '{key}' must be a string, got {type(v).__name__}")
    return v


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[Message]:
    """Validate ``messages`` (see module docstring) and return them as ``Message`` objects.

    Raises ChatFormatError naming the first offending message.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatFormatError(f"messages must be a list, got {type(messages).__name__}")
    out: list[Message] = []
    open_calls = 0  # tool results still allowed right here
    for i, m in enumerate(messages):
        where = _where(i)
        if not isinstance(m, Mapping):
            raise ChatFormatError(f"{where}: must be an object, got {type(m).__name__}")
        raw_role = m.get("role")
        role = _ROLE_ALIASES.get(raw_role) if isinstance(raw_role, str) else None
        if role is None:
            raise ChatFormatError(f"{where}: unknown role {raw_role!r}; expected one of "
                                  f"{sorted(_ROLE_ALIASES)}")
        if role == "system":
            if i != 0:
                raise ChatFormatError(f"{where}: a system message is only allowed as the first "
                                      "message")
            out.append(Message("system", visible_text(m.get("content"), where=where,
                                                      allow_none=True),
                               current_date=_optional_str(m, "current_date", where),
                               current_location=_optional_str(m, "current_location", where)))
            open_calls = 0
        elif role == "user":
            out.append(Message("user", visible_text(m.get("content"), where=where)))
            open_calls = 0
        elif role == "assistant":
            content = visible_text(m.get("content"), where=where, allow_none=True)
            reasoning = _optional_str(m, "reasoning_content", where)
            if reasoning is None:
                reasoning, content = _split_inline_reasoning(content)
            calls_raw = m.get("tool_calls") or []
            if not isinstance(calls_raw, (list, tuple)):
                raise ChatFormatError(f"{where}: 'tool_calls' must be a list")
            calls = tuple(_tool_call(c, f"{where} tool_calls[{j}]")
                          for j, c in enumerate(calls_raw))
            out.append(Message("assistant", content, reasoning=reasoning, tool_calls=calls))
            open_calls = len(calls)
        else:  # tool
            if open_calls <= 0:
                raise ChatFormatError(
                    f"{where}: tool message without a preceding assistant tool call (a tool "
                    "result must follow an assistant message with tool_calls, one result per "
                    "call)")
            open_calls -= 1
            content = m.get("content")
            if isinstance(content, (list, tuple)):
                out.append(Message("tool", "", tool_results=_tool_result_parts(content, where)))
            elif isinstance(content, str):
                out.append(Message("tool", content))
            else:
                raise ChatFormatError(f"{where}: tool content must be a string or a list, got "
                                      f"{type(content).__name__}")
    return out


def normalize_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict]:
    """Return the function dicts of ``tools`` (OpenAI ``{"type": "function", "function": f}`` or
    bare ``f``). Each needs a non-empty string ``name``; ``parameters`` when present must be an
    object. Raises ChatFormatError naming the tool index.
    """
    if tools is None:
        return []
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
        raise ChatFormatError(f"tools must be a list, got {type(tools).__name__}")
    out = []
    names = set()
    for i, t in enumerate(tools):
        if not isinstance(t, Mapping):
            raise ChatFormatError(f"tool {i}: must be an object")
        fn = t["function"] if "function" in t else t
        if not isinstance(fn, Mapping):
            raise ChatFormatError(f"tool {i}: 'function' must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not name.strip():
            raise ChatFormatError(f"tool {i}: needs a non-empty string 'name'")
        if name in names:
            raise ChatFormatError(f"tool {i}: duplicate tool name {name!r}")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, Mapping):
            raise ChatFormatError(f"tool {i} ({name}): 'parameters' must be an object")
        out.append(dict(fn))
    return out
