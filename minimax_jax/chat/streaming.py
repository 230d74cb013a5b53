"""Streaming helper: does the output so far end inside an unfinished tool call?

A server streaming text to a client must hold back text that may become part of a
``<minimax:tool_call>`` block. ``tool_call_state`` classifies the end of the text:

* ``"reasoning"``: still inside the thinking section (tool-call tags there are not calls);
* ``"in_tool_call"``: an opened ``<minimax:tool_call>`` has no ``</minimax:tool_call>`` yet;
* ``"partial_tag"``: the text ends with a proper prefix of ``<minimax:tool_call>`` (e.g. "<mini");
* ``"content"``: none of these; everything so far is final visible content or closed blocks.

``ends_inside_tool_call`` is True for the two tool-call states. Both run in O(len(text)).
"""

from __future__ import annotations

from minimax_jax.chat import tokens as T
from minimax_jax.chat.tool_calls import split_reasoning

__all__ = ["ends_inside_tool_call", "tool_call_state"]


def tool_call_state(text: str, *, thinking_open: bool = True) -> str:
    """State at the end of ``text`` (see module doc). ``thinking_open`` as in
    ``parse_model_output``."""
    _, _, finished = split_reasoning(text, thinking_open=thinking_open)
    if not finished:
        return "reasoning"
    start = text.rfind(T.TOOL_CALL_OPEN)
    think_end = text.find(T.THINK_CLOSE) if thinking_open or text.lstrip().startswith(
        T.THINK_OPEN) else -1
    if start > think_end and text.find(T.TOOL_CALL_CLOSE, start) < 0:
        return "in_tool_call"
    for k in range(len(T.TOOL_CALL_OPEN) - 1, 0, -1):
        if text.endswith(T.TOOL_CALL_OPEN[:k]):
            return "partial_tag"
    return "content"


def ends_inside_tool_call(text: str, *, thinking_open: bool = True) -> bool:
    """True when the text ends inside an unfinished tool call or a partial opening tag."""
    return tool_call_state(text, thinking_open=thinking_open) in ("in_tool_call", "partial_tag")
