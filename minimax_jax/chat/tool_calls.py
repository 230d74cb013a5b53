"""Split MiniMax-M2 model output into reasoning, visible content and structured tool calls.

Output of one assistant turn looks like (the prompt already ended with ``<think>\\n``):

    {reasoning}\\n</think>\\n\\n{content}\\n<minimax:tool_call>\\n<invoke name="f">\\n
    <parameter name="k">{value}</parameter>\\n</invoke>\\n</minimax:tool_call>[e~[

Parsing never raises on model text: every malformed piece becomes a ``ToolCallError`` entry
(``kind`` one of ``unclosed_tool_call``, ``unmatched_close``, ``unclosed_invoke``,
``missing_name``, ``unclosed_parameter``, ``duplicate_parameter``, ``bad_argument``,
``unknown_tool``, ``unexpected_text``). A call with any error of its own (all kinds except
``unexpected_text`` and ``unmatched_close``) is not returned as a call, so a caller never executes
a half-understood call. Calls inside an unclosed ``<minimax:tool_call>`` (e.g. output cut by the
token limit) are not returned either.

Rules: ``<minimax:tool_call>`` inside the reasoning is not parsed; a parameter value is the text
between its tags minus one leading and one trailing "\\n"; values are typed by the tool's JSON
schema (``tool_args.convert_argument``) when ``tools`` is given, else kept as strings; the
invoke/parameter ``name`` attribute may use double, single or no quotes; the visible content is
the text outside the blocks, whitespace-stripped, without a trailing ``[e~[``.
Source: MODEL_FACTS.md section 1 (call format); the renderer in ``template.py`` is the inverse.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Mapping, Sequence

from minimax_jax.chat import tokens as T
from minimax_jax.chat.messages import normalize_tools
from minimax_jax.chat.tool_args import ArgumentTypeError, convert_argument

__all__ = ["ParsedOutput", "ToolCall", "ToolCallError", "parse_model_output", "parse_tool_calls",
           "split_reasoning"]

_NAME_ATTR = r"""\s+name\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s>"']+))\s*>"""
_INVOKE_TAG = re.compile(r"<invoke" + _NAME_ATTR)
_PARAM_TAG = re.compile(r"<parameter" + _NAME_ATTR)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A well-formed call: ``name`` and typed ``arguments`` (insertion order of the output)."""

    name: str
    arguments: dict

    def to_dict(self) -> dict:
        """``{"name": ..., "arguments": {...}}`` (JSON-serialisable)."""
        return {"name": self.name, "arguments": self.arguments}

    def to_openai(self, call_id: str | None = None) -> dict:
        """OpenAI ``tool_calls`` entry (arguments as a JSON string)."""
        out = {"type": "function", "function": {
            "name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}
        if call_id is not None:
            out["id"] = call_id
        return out


@dataclasses.dataclass(frozen=True)
class ToolCallError:
    """A malformed piece of output: ``kind`` (see module doc), human ``message``, the ``raw``
    text concerned, and the tool ``name`` / ``parameter`` when known."""

    kind: str
    message: str
    raw: str
    name: str | None = None
    parameter: str | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ParsedOutput:
    """Result of ``parse_model_output``. ``reasoning`` is None when the output has no thinking
    section; ``reasoning_finished`` is False when ``</think>`` never came."""

    content: str
    reasoning: str | None
    tool_calls: tuple[ToolCall, ...]
    errors: tuple[ToolCallError, ...]
    reasoning_finished: bool = True

    def to_dict(self) -> dict:
        return {"content": self.content, "reasoning": self.reasoning,
                "reasoning_finished": self.reasoning_finished,
                "tool_calls": [c.to_dict() for c in self.tool_calls],
                "errors": [e.to_dict() for e in self.errors]}

    def to_json(self, **kw) -> str:
        """JSON text of ``to_dict()`` (``ensure_ascii=False`` unless overridden)."""
        kw.setdefault("ensure_ascii", False)
        return json.dumps(self.to_dict(), **kw)


def split_reasoning(text: str, *, thinking_open: bool = True) -> tuple[str | None, str, bool]:
    """Split ``text`` into (reasoning, rest, reasoning_finished).

    ``thinking_open``: the prompt ended inside ``<think>`` (our generation prompt does), so the
    output starts with reasoning. Independently, output that starts with ``<think>`` (after
    whitespace) opens reasoning too. Reasoning runs to the first ``</think>``; it and the rest are
    stripped of surrounding newlines. Without a ``</think>`` all of an open output is reasoning.
    """
    body = text
    stripped = text.lstrip()
    if stripped.startswith(T.THINK_OPEN):
        body, thinking_open = stripped[len(T.THINK_OPEN):], True
    if not thinking_open:
        return None, text, True
    end = body.find(T.THINK_CLOSE)
    if end < 0:
        return body.strip("\n"), "", False
    return body[:end].strip("\n"), body[end + len(T.THINK_CLOSE):].strip("\n"), True


def _attr(m: re.Match) -> str:
    return next(g for g in m.groups() if g is not None)


def _strip_one_newline(v: str) -> str:
    if v.startswith("\n"):
        v = v[1:]
    if v.endswith("\n"):
        v = v[:-1]
    return v


def _stray(text: str, errors: list, where: str) -> None:
    if text.strip():
        errors.append(ToolCallError("unexpected_text", f"text outside any {where} ignored",
                                    text.strip()))


def _parse_invoke(name: str, body: str, raw: str, schemas: dict | None,
                  errors: list) -> ToolCall | None:
    """Parse the parameters of one invoke; report and return None on any own error."""
    args: dict[str, Any] = {}
    props = None
    if schemas is not None:
        if name not in schemas:
            errors.append(ToolCallError("unknown_tool", f"tool {name!r} is not declared", raw,
                                        name=name))
            return None
        props = schemas[name]
    pos = 0
    while True:
        start = body.find("<parameter", pos)
        if start < 0:
            _stray(body[pos:], errors, "<parameter>")
            break
        _stray(body[pos:start], errors, "<parameter>")
        m = _PARAM_TAG.match(body, start)
        if m is None or not _attr(m):
            errors.append(ToolCallError("missing_name", "<parameter> without a name", raw,
                                        name=name))
            return None
        pname = _attr(m)
        end = body.find("</parameter>", m.end())
        if end < 0:
            errors.append(ToolCallError("unclosed_parameter", f"parameter {pname!r} never "
                                        "closed", raw, name=name, parameter=pname))
            return None
        if pname in args:
            errors.append(ToolCallError("duplicate_parameter", f"parameter {pname!r} given "
                                        "twice", raw, name=name, parameter=pname))
            return None
        value = _strip_one_newline(body[m.end():end])
        try:
            args[pname] = convert_argument(value, (props or {}).get(pname))
        except ArgumentTypeError as e:
            errors.append(ToolCallError("bad_argument", f"parameter {pname!r}: {e}", raw,
                                        name=name, parameter=pname))
            return None
        pos = end + len("</parameter>")
    return ToolCall(name, args)


def _parse_block(block: str, schemas: dict | None, calls: list, errors: list) -> None:
    pos = 0
    while True:
        start = block.find("<invoke", pos)
        if start < 0:
            _stray(block[pos:], errors, "<invoke>")
            return
        _stray(block[pos:start], errors, "<invoke>")
        end = block.find("</invoke>", start)
        if end < 0:
            errors.append(ToolCallError("unclosed_invoke", "<invoke> never closed",
                                        block[start:]))
            return
        raw = block[start:end + len("</invoke>")]
        m = _INVOKE_TAG.match(block, start)
        if m is None or m.end() > end or not _attr(m).strip():
            errors.append(ToolCallError("missing_name", "<invoke> without a name", raw))
        else:
            call = _parse_invoke(_attr(m), block[m.end():end], raw, schemas, errors)
            if call is not None:
                calls.append(call)
        pos = end + len("</invoke>")


def _schemas(tools) -> dict | None:
    if tools is None:
        return None
    out = {}
    for fn in normalize_tools(tools):
        params = fn.get("parameters") or {}
        props = params.get("properties") if isinstance(params, Mapping) else None
        out[fn["name"]] = dict(props) if isinstance(props, Mapping) else {}
    return out


def _take_stray_closes(text: str, errors: list) -> str:
    if T.TOOL_CALL_CLOSE in text:
        errors.append(ToolCallError("unmatched_close", f"{T.TOOL_CALL_CLOSE} without an opening "
                                    "tag removed", T.TOOL_CALL_CLOSE))
        text = text.replace(T.TOOL_CALL_CLOSE, "")
    return text


def parse_tool_calls(text: str, tools: Sequence[Mapping] | None = None
                     ) -> tuple[str, list[ToolCall], list[ToolCallError]]:
    """Parse the tool-call blocks of ``text`` (output after the reasoning).

    Returns (content outside the blocks, calls, errors). ``tools``: declared tools (OpenAI or bare
    function dicts) to type arguments and reject unknown names; None keeps all values as strings.
    Raises ChatFormatError only for an invalid ``tools`` list (caller input, not model text).
    """
    schemas = _schemas(tools)
    calls: list[ToolCall] = []
    errors: list[ToolCallError] = []
    content: list[str] = []
    pos, n_open = 0, len(T.TOOL_CALL_OPEN)
    while True:
        start = text.find(T.TOOL_CALL_OPEN, pos)
        if start < 0:
            content.append(_take_stray_closes(text[pos:], errors))
            break
        content.append(_take_stray_closes(text[pos:start], errors))
        close = text.find(T.TOOL_CALL_CLOSE, start + n_open)
        reopen = text.find(T.TOOL_CALL_OPEN, start + n_open)
        if close < 0 or 0 <= reopen < close:
            stop = reopen if reopen >= 0 else len(text)
            errors.append(ToolCallError("unclosed_tool_call", f"{T.TOOL_CALL_OPEN} never closed; "
                                        "its calls are ignored", text[start:stop]))
            pos = stop
            if reopen < 0:
                break
            continue
        _parse_block(text[start + n_open:close], schemas, calls, errors)
        pos = close + len(T.TOOL_CALL_CLOSE)
    body = "".join(content).strip()
    if body.endswith(T.TURN_END):
        body = body[:-len(T.TURN_END)].rstrip()
    return body, calls, errors


def parse_model_output(text: str, tools: Sequence[Mapping] | None = None, *,
                       thinking_open: bool = True) -> ParsedOutput:
    """Separate reasoning, visible content and tool calls of one generated assistant turn.

    Args:
      text: detokenised model output (special tokens kept as text).
      tools: declared tools for argument typing (None: arguments stay strings).
      thinking_open: the prompt ended with ``<think>\\n`` (True for ``render_chat`` prompts).
    Returns:
      ParsedOutput; malformed XML is reported in ``errors``, never raised.
    """
    reasoning, rest, finished = split_reasoning(text, thinking_open=thinking_open)
    if reasoning is not None and reasoning.endswith(T.TURN_END) and not finished:
        reasoning = reasoning[:-len(T.TURN_END)].rstrip("\n")
    content, calls, errors = parse_tool_calls(rest, tools)
    return ParsedOutput(content, reasoning, tuple(calls), tuple(errors), finished)
