"""Response building without a model: a generated MiniMax turn with reasoning and a tool call becomes
an OpenAI message with ``reasoning_content`` and ``tool_calls``; the streamed deltas add up to it."""

from __future__ import annotations

import json

from minimax_jax.serve.protocol import ApiError
from minimax_jax.serve.responses import ChatDeltas, chat_message, usage

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
TURN = ("Need the weather.\n</think>\n\nLet me check.\n<minimax:tool_call>\n<invoke name=\"get_weather\">\n"
        "<parameter name=\"city\">Paris</parameter>\n<parameter name=\"days\">3</parameter>\n</invoke>\n"
        "</minimax:tool_call>")


def test_a_tool_call_turn_becomes_openai_tool_calls():
    msg, calls = chat_message(TURN, TOOLS)
    assert calls and msg["role"] == "assistant"
    assert msg["reasoning_content"] == "Need the weather." and msg["content"] == "Let me check."
    (call,) = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call-")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}   # typed by the schema


def test_streamed_deltas_add_up_to_the_message_and_hold_back_the_tool_block():
    d, parts = ChatDeltas(), {"reasoning_content": "", "content": ""}
    for n in range(1, len(TURN) + 1):
        for k, v in d.update(TURN[:n]).items():
            parts[k] += v
            assert "<minimax" not in parts["content"] and "<" not in parts["content"]
    msg, _ = chat_message(TURN, TOOLS)
    assert d.finish(msg) == {}
    assert parts == {"reasoning_content": msg["reasoning_content"], "content": msg["content"]}


def test_finish_flushes_what_was_held_back():
    d = ChatDeltas()
    assert d.update("thinking </th") == {"reasoning_content": "thinking "}
    msg, _ = chat_message("thinking </th", None)       # cut by max_tokens: the text is final now
    assert d.finish(msg) == {"reasoning_content": "</th"}


def test_plain_turn_and_usage_and_error_body():
    msg, calls = chat_message("hmm\n</think>\n\nHello!", None)
    assert not calls and msg == {"role": "assistant", "content": "Hello!", "reasoning_content": "hmm"}
    u = usage(7, [{"tokens": [1, 2], "cached_tokens": 0}, {"tokens": [3], "cached_tokens": 0}])
    assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (7, 3, 10)
    assert ApiError(429, "busy", None, "queue_full").body() == {
        "error": {"message": "busy", "type": "rate_limit_error", "param": None, "code": "queue_full"}}
