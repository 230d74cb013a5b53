"""Render a conversation into the MiniMax-M2 prompt text (our own Python, no Jinja).

Layout (``S`` = ``]~b]``, ``E`` = ``[e~[``; every turn ends with ``E`` + "\\n"):

    ]~!b[S system\\n{system text}[\\n\\n# Tools ... <tools>\\n<tool>{json}</tool>\\n...
         </tools> ...]E\\n
    S user\\n{text}E\\n
    S ai\\n[<think>\\n{reasoning}\\n</think>\\n\\n]{content}[\\n<minimax:tool_call>\\n
         <invoke name="f">\\n<parameter name="k">{v}</parameter>\\n...</invoke>\\n...
         </minimax:tool_call>]E\\n
    S tool\\n<response>{r1}</response>\\n<response>{r2}</response>E\\n
         (consecutive tool results share one turn)
    S ai\\n<think>\\n                                                           (generation prompt)

(no spaces after ``S`` in the real text.) Rules, matching the published template:

* System text: the first message's content if it is a non-empty system message, else
  ``default_system`` ("You are a helpful assistant."); then "\\nCurrent date: ..." and
  "\\nCurrent location: ..." when the system message carries those keys.
* Interleaved thinking: an assistant turn's reasoning is rendered only when the turn comes after
  the last user message (the current agent trajectory); earlier reasoning is dropped. Empty
  reasoning is never rendered.
* Tool arguments: strings verbatim, everything else ``json.dumps(v, ensure_ascii=False)``.
* Tool JSON: ``json.dumps(function_dict, ensure_ascii=False)`` with default separators.
* Tool results given as a list of parts render each part as "\\n<response>{part}\\n</response>".

Source: MODEL_FACTS.md section 1; checked against the MiniMax-M2 ``chat_template.jinja``
(tests/fixtures/chat/README.md says where the copy comes from) in tests/chat/test_chat_template.py.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from minimax_jax.chat import tokens as T
from minimax_jax.chat.messages import Message, normalize_messages, normalize_tools

__all__ = ["render_chat", "render_tool_call_block", "render_tools_section"]

_TOOLS_HEADER = ("\n\n# Tools\nYou may call one or more tools to assist with the user query.\n"
                 "Here are the tools available in JSONSchema format:\n")
_TOOLS_FOOTER = ("When making tool calls, use XML format to invoke tools and pass parameters:\n"
                 "\n" + T.TOOL_CALL_OPEN + "\n"
                 '<invoke name="tool-name-1">\n'
                 '<parameter name="param-key-1">param-value-1</parameter>\n'
                 '<parameter name="param-key-2">param-value-2</parameter>\n'
                 "...\n"
                 "</invoke>\n" + T.TOOL_CALL_CLOSE)


def render_tools_section(functions: Sequence[Mapping[str, Any]]) -> str:
    """Text appended to the system turn for the given (normalised) function dicts; "" if none."""
    if not functions:
        return ""
    body = "".join(f"<tool>{json.dumps(f, ensure_ascii=False)}</tool>\n" for f in functions)
    return _TOOLS_HEADER + "\n<tools>\n" + body + "</tools>\n\n" + _TOOLS_FOOTER


def _argument_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def render_tool_call_block(calls) -> str:
    """``<minimax:tool_call>`` block (no leading newline) for ToolCallSpec-like objects
    (``.name``, ``.arguments`` dict)."""
    parts = [T.TOOL_CALL_OPEN, "\n"]
    for call in calls:
        parts.append(f'<invoke name="{call.name}">\n')
        for k, v in call.arguments.items():
            parts.append(f'<parameter name="{k}">{_argument_text(v)}</parameter>\n')
        parts.append("</invoke>\n")
    parts.append(T.TOOL_CALL_CLOSE)
    return "".join(parts)


def _system_turn(first: Message | None, functions, default_system: str) -> str:
    text = first.content if first is not None and first.content else default_system
    if first is not None and first.current_date:
        text += "\nCurrent date: " + first.current_date
    if first is not None and first.current_location:
        text += "\nCurrent location: " + first.current_location
    return (T.BOS + T.ROLE_START + "system\n" + text + render_tools_section(functions)
            + T.TURN_END + "\n")


def _assistant_turn(m: Message, keep_reasoning: bool) -> str:
    out = [T.ROLE_START, "ai\n"]
    if m.reasoning and keep_reasoning:
        out += [T.THINK_OPEN, "\n", m.reasoning, "\n", T.THINK_CLOSE, "\n\n"]
    out.append(m.content)
    if m.tool_calls:
        out += ["\n", render_tool_call_block(m.tool_calls)]
    out += [T.TURN_END, "\n"]
    return "".join(out)


def _tool_response(m: Message) -> str:
    if m.tool_results is None:
        return f"\n<response>{m.content}</response>"
    return "".join(f"\n<response>{r}\n</response>" for r in m.tool_results)


def render_chat(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping] | None = None, *,
                add_generation_prompt: bool = True,
                default_system: str = T.DEFAULT_SYSTEM) -> str:
    """Render OpenAI-style ``messages`` (+ optional ``tools``) to the MiniMax-M2 prompt string.

    Args:
      messages: list of message dicts (see ``minimax_jax.chat.messages``).
      tools: list of tool dicts (OpenAI function tools or bare function schemas) or None.
      add_generation_prompt: append ``]~b]ai\\n<think>\\n`` so the model writes the next turn.
      default_system: system text used when there is no non-empty system message.
    Returns:
      The prompt text; tokenising it with the MiniMax tokenizer maps the special strings to
      their single special ids.
    Raises:
      ChatFormatError: invalid messages or tools (message names the index and the rule).
    """
    msgs = normalize_messages(messages)
    functions = normalize_tools(tools)
    first = msgs[0] if msgs and msgs[0].role == "system" else None
    convo = msgs[1:] if first is not None else msgs
    last_user = max((i for i, m in enumerate(convo) if m.role == "user"), default=-1)

    out = [_system_turn(first, functions, default_system)]
    for i, m in enumerate(convo):
        if m.role == "user":
            out.append(T.ROLE_START + "user\n" + m.content + T.TURN_END + "\n")
        elif m.role == "assistant":
            out.append(_assistant_turn(m, keep_reasoning=i > last_user))
        else:  # tool: consecutive results share one turn
            if i == 0 or convo[i - 1].role != "tool":
                out.append(T.ROLE_START + "tool")
            out.append(_tool_response(m))
            if i == len(convo) - 1 or convo[i + 1].role != "tool":
                out.append(T.TURN_END + "\n")
    if add_generation_prompt:
        out.append(T.GENERATION_PROMPT)
    return "".join(out)
